"""What the driver says of torch's memory under each allocator setting (issue 36's items 2-3), one
process: run once per PYTORCH_CUDA_ALLOC_CONF. Prints, for tensors of a few sizes (and a view into
one), the pointer attributes zero-copy keys on (range, mapping, buffer and block IDs, legacy IPC,
allowed handle types, pool), then tries what an expandable segment's export would do: retain the
physical allocation under a pointer, export it as a POSIX file descriptor, import it again, map it
at a new address and write through that mapping (checked through the tensor). Then frees the
tensors, empties torch's cache, allocates again and says which IDs changed. A probe, not a test."""

from __future__ import annotations

import ctypes
import os

import torch

cuda = ctypes.CDLL("libcuda.so.1")
ATTR = {"range_start": 11, "range_size": 12, "buffer_id": 7, "legacy_ipc": 10, "handle_types": 14,
        "mempool": 17, "mapping_size": 18, "mapping_base": 19, "block_id": 20}
POSIX_FD = 1


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def attr(ptr: int, name: str):
    value = ctypes.c_uint64(0)
    rc = cuda.cuPointerGetAttribute(ctypes.byref(value), ATTR[name], ctypes.c_uint64(ptr))
    return value.value if rc == 0 else f"rc={rc}"


def attrs(ptr: int) -> dict:
    out = {name: attr(ptr, name) for name in ATTR}
    for key in ("range_start", "mapping_base"):
        if isinstance(out[key], int):
            out[key + "_off"] = ptr - out[key]
    return out


def try_export(ptr: int, nbytes: int) -> str:
    """Retain, export as a POSIX fd, import, map at a new address, write 0x5a through it."""
    handle = ctypes.c_uint64(0)
    rc = cuda.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_uint64(ptr))
    if rc:
        return f"retain rc={rc}", 0
    fd = ctypes.c_int(-1)
    rc = cuda.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, ctypes.c_uint64(0))
    cuda.cuMemRelease(handle)
    if rc:
        return f"export rc={rc}", 0
    imported = ctypes.c_uint64(0)
    rc = cuda.cuMemImportFromShareableHandle(ctypes.byref(imported), ctypes.c_void_p(fd.value), POSIX_FD)
    os.close(fd.value)
    if rc:
        return f"import rc={rc}", 0
    base, size = attr(ptr, "mapping_base"), attr(ptr, "mapping_size")
    va = ctypes.c_uint64(0)
    steps = []
    rc = cuda.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                  ctypes.c_uint64(0))
    steps.append(f"reserve rc={rc}")
    rc = cuda.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), imported, ctypes.c_uint64(0))
    steps.append(f"map rc={rc}")
    desc = AccessDesc(Location(1, torch.cuda.current_device()), 3)
    rc = cuda.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))
    steps.append(f"access rc={rc}")
    offset = ptr - base
    n = min(nbytes, size - offset)
    rc = cuda.cuMemsetD8_v2(ctypes.c_uint64(va.value + offset), ctypes.c_ubyte(0x5A), ctypes.c_size_t(n))
    torch.cuda.synchronize()
    steps.append(f"memset rc={rc}")
    cuda.cuMemUnmap(va, ctypes.c_size_t(size))
    cuda.cuMemAddressFree(va, ctypes.c_size_t(size))
    cuda.cuMemRelease(imported)
    return " ".join(steps), n


def main() -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    print("PYTORCH_CUDA_ALLOC_CONF =", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), flush=True)
    sizes = [4 << 20, 64 << 20, 256 << 20]
    tensors = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    before = {}
    for n, t in zip(sizes, tensors):
        for label, ptr, length in ((f"{n >> 20}M", t.data_ptr(), n), (f"{n >> 20}M+{n // 2}", t.data_ptr() + n // 2, n // 2),
                                   (f"{n >> 20}M end-1", t.data_ptr() + n - 1, 1)):
            a = attrs(ptr)
            before[label] = a
            print(label, a, flush=True)
        said, written = try_export(t.data_ptr(), n)
        ok = written > 0 and bool((t[:written] == 0x5A).all().item())
        print(f"  export {n >> 20}M: {said}; {written} bytes written through the import, seen in the tensor: {ok}",
              flush=True)
    ptrs = [t.data_ptr() for t in tensors]
    del tensors
    torch.cuda.empty_cache()
    again = [torch.zeros(n, dtype=torch.uint8, device="cuda") for n in sizes]
    for n, t, old in zip(sizes, again, ptrs):
        a = attrs(t.data_ptr())
        b = before[f"{n >> 20}M"]
        print(f"after empty_cache {n >> 20}M: same address {t.data_ptr() == old}, buffer_id {b['buffer_id']}->{a['buffer_id']}, "
              f"block_id {b['block_id']}->{a['block_id']}, mapping_base same {a['mapping_base'] == b['mapping_base']}", flush=True)
    pool = ctypes.c_uint64(0)
    rc = cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
    print("default pool rc", rc, flush=True)


if __name__ == "__main__":
    main()
