"""The host path of a 4 KiB pydatacopy.put, piece by piece, on the CPU (no GPU, no NVSHMEM).

    python scripts/profile_host_path.py [--calls N]

What stands in for what a GPU would give: CPU tensors stand in for CUDA ones (the core's
device is reported as -1, what get_device() returns for a CPU tensor), torch's current stream
is a fake that returns 0 (on a GPU, torch._C._cuda_getCurrentRawStream: one more C call), and
the core's put is _C._host_path_probe (put_fast's arguments and GIL release, no work: the
crossing alone). The core's own work (one symmetric lookup, the cudaMemcpyAsync) and a bare
cudaMemcpyAsync are measured on the GPU by the bench's host rows (python -m pydatacopy.bench
--ops host). Each figure: the best of 7 repetitions of N calls, in ns per call.

It also times put_many's list form per row (reading the tensors through the native pass) and
the whole of put_many(1024 rows) up to the core, and send/sendrecv's Python side: their fast path
against the checked one (every call's before 2026-12-02), no-op Python functions standing in for
both the engine's methods and the fast entries (_C.send_fast, _C.sendrecv_fast), so that the two
figures differ by the Python layer alone (pybind11's dispatch of the methods against the
METH_FASTCALL entries: about 0.1 us more, as put's, measured above).
"""

from __future__ import annotations

import argparse
import timeit

import torch

import pydatacopy
from pydatacopy import _C, _torch_utils
from pydatacopy.send_recv import send_recv as _send_recv
from pydatacopy.rma import transfer as _transfer


class _FakeCore:
    """_C with the calls that need NVSHMEM or a GPU answered as an initialised PE 0 of 2 on a
    device whose tensors report get_device() == -1."""

    def __getattr__(self, name):
        return getattr(_C, name)

    is_initialized = staticmethod(lambda: True)
    cuda_device = staticmethod(lambda: -1)
    n_pes = staticmethod(lambda: 2)
    my_pe = staticmethod(lambda: 0)
    default_timeout_seconds = staticmethod(lambda: 60.0)
    put_fast = staticmethod(_C._host_path_probe)
    get_fast = staticmethod(_C._host_path_probe)
    send_fast = recv_fast = sendrecv_fast = staticmethod(lambda *args: None)


class _NoOpEngine:
    """The send/recv engine's methods as no-ops, as cheap as the fast entries' stand-ins."""

    send = recv = sendrecv = batch = staticmethod(lambda *args: None)


def _ns(statement: str, names: dict, calls: int) -> float:
    return min(timeit.repeat(statement, globals=names, number=calls, repeat=7)) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()
    calls = args.calls

    _transfer._C = _torch_utils._C = _send_recv._C = _FakeCore()
    _transfer._raw_stream = _send_recv._raw_stream = lambda device: 0
    _send_recv._engine = _NoOpEngine()
    _torch_utils.current_raw_stream = lambda device: 0
    _torch_utils.bind()  # what init() leaves: device -1, 2 PEs, the timeout read
    dst = torch.zeros(4096, dtype=torch.uint8)
    src = torch.zeros(4096, dtype=torch.uint8)
    def group(timeout):  # an all-to-all's shape: a send and a recv per message, 16 each way
        with pydatacopy.group():
            for _ in range(16):
                pydatacopy.send(src, 1, timeout=timeout)
                pydatacopy.recv(dst, 1, timeout=timeout)

    names = {"group": group, "pydatacopy": pydatacopy, "_C": _C, "_transfer": _transfer, "dst": dst, "src": src,
             "torch": torch, "check_int": _torch_utils.check_int, "_torch_utils": _torch_utils}
    rows = [
        ("pydatacopy.put(dst, src, 1), the whole Python path", "pydatacopy.put(dst, src, 1)"),
        ("  the checked path (what every call took before)",
         "_transfer._require_init('put'); check_int('pe', 1, None, 2**31 - 1);"
         " _transfer._check_tensor(dst, 'dst'); _transfer._check_tensor(src, 'src');"
         " n = _transfer._check_pair(dst, src, 'put');"
         " _C._host_path_probe(dst.data_ptr(), src.data_ptr(), n, 1, _transfer._stream(None), _transfer._path('auto'));"
         " _transfer._keep_alive(None, dst, src)"),
        ("bare: the crossing with two data_ptr() (the bench baseline's Python side)",
         "_C._host_path_probe(dst.data_ptr(), src.data_ptr(), 4096, 1, 0, 0)"),
        ("pieces", None),
        ("  _C crossing, no arguments (_C.is_initialized)", "_C.is_initialized()"),
        ("  _C crossing, put's 6 arguments + GIL release (_host_path_probe, as _C.put_fast)",
         "_C._host_path_probe(1, 2, 4096, 1, 0, 0)"),

        ("  _C.is_symmetric(address, bytes) (a map lookup under a lock)", "_C.is_symmetric(1, 1)"),
        ("  tensor.data_ptr()", "dst.data_ptr()"),
        ("  tensor.get_device()", "dst.get_device()"),
        ("  tensor.is_contiguous()", "dst.is_contiguous()"),
        ("  tensor.dtype is other.dtype", "dst.dtype is src.dtype"),
        ("  tensor.nbytes", "dst.nbytes"),
        ("  tensor.numel() * tensor.element_size()", "dst.numel() * dst.element_size()"),
        ("  isinstance(tensor, torch.Tensor)", "isinstance(dst, torch.Tensor)"),
        ("  check_int('pe', 1, None, 2**31 - 1)", "check_int('pe', 1, None, 2**31 - 1)"),
        ("  _require_init('put') (a crossing)", "_transfer._require_init('put')"),
        ("  _check_tensor(dst, 'dst') (one crossing for the device)", "_transfer._check_tensor(dst, 'dst')"),
        ("  _check_pair(dst, src, 'put')", "_transfer._check_pair(dst, src, 'put')"),
        ("  _path('auto')", "_transfer._path('auto')"),
        ("  _C.default_timeout_seconds() (getenv + strtod: a timeout=None per call before)",
         "_C.default_timeout_seconds()"),
        ("  timeout_seconds(None) now (read once at init)", "_torch_utils.timeout_seconds(None)"),
        ("  _keep_alive(None, dst, src)", "_transfer._keep_alive(None, dst, src)"),
        ("send/recv's Python side (no-ops for the engine and the fast entries)", None),
        ("  pydatacopy.send(src, 1): the fast path", "pydatacopy.send(src, 1)"),
        ("  pydatacopy.send(src, 1, timeout=60.0): the checked path", "pydatacopy.send(src, 1, timeout=60.0)"),
        ("  pydatacopy.sendrecv(src, 1, dst, 1): the fast path", "pydatacopy.sendrecv(src, 1, dst, 1)"),
        ("  pydatacopy.sendrecv(src, 1, dst, 1, timeout=60.0): the checked path",
         "pydatacopy.sendrecv(src, 1, dst, 1, timeout=60.0)"),
        ("  group() of 16 sends and 16 recvs: the fast path", "group(None)"),
        ("  group() of 16 sends and 16 recvs, timeout=60.0: the checked path", "group(60.0)"),
    ]
    print(f"{'ns per call':>12}  what")
    for label, statement in rows:
        if statement is None:
            print(f"{'':>12}  {label}")
            continue
        print(f"{_ns(statement, names, calls):12.0f}  {label}")

    # put_many's list form: the native pass reads each row's tensors (type, device, layout,
    # address, size, dtype) and then the core refuses the call (no NVSHMEM): per row, the read.
    for count in (1, 1024):
        dsts = [torch.zeros(4096, dtype=torch.uint8) for _ in range(count)]
        srcs = [torch.zeros(4096, dtype=torch.uint8) for _ in range(count)]
        statement = ("try:\n    _C.put_many_tensors(dsts, srcs, 0, 0, 0, -1, torch.Tensor)\n"
                     "except _C.Error:\n    pass")
        per_call = _ns(statement, dict(names, dsts=dsts, srcs=srcs), max(calls // (10 * count), 5))
        print(f"{per_call:12.0f}  put_many's native row pass + a refusal, {count} row(s)")
    base = _ns("try:\n    _C.put_many_tensors([], [], 0, 0, 0, -1, torch.Tensor)\nexcept _C.Error:\n    pass",
               names, calls // 10)
    print(f"{(per_call - base) / 1024:12.0f}  put_many's list form per row (1024 rows, the refusal taken off)")


if __name__ == "__main__":
    main()
