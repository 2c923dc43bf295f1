"""The environment variables pydatacopy and NVSHMEM read, parsed and checked by pydatacopy first
(the machine they are checked against is probes.py's).

NVSHMEM parses its own variables when it creates a unique ID and when it starts, and a value it
cannot parse ends the process: NVSHMEM 3.4.5 prints "Invalid size in environment variable
'SYMMETRIC_SIZE'" and then dies of a segmentation fault. get_unique_id(), init(),
init_nvshmem() and the doctor therefore check every variable below before NVSHMEM sees it, and
answer a bad value with pydatacopy.Error naming the call, the variable and what to set.

Sizes follow NVSHMEM's own grammar (src/host/.../env_defs_internal.h, nvshmemi_atol_scaled): a
number as C's strtod reads it, then optionally one of k/K, m/M, g/G, t/T (2^10 ... 2^40), and
NVSHMEM ignores whatever follows that letter. pydatacopy accepts every value NVSHMEM accepts and
reads as intended, and refuses:
- what NVSHMEM refuses and crashes on: ``lots``, ``-1``, an empty value, ``1 G``, ``1024B``,
  a plain number with trailing blanks (``"1024 "``);
- what NVSHMEM accepts but turns into nonsense: a negative value with a suffix (``-1G`` wraps to
  16 EiB), ``nan``, ``inf``, more than 2^64 - 1 bytes;
- text after the suffix other than ``B``/``iB`` (``2GiB``, ``2GB`` are fine): NVSHMEM would read
  ``20kk`` or ``1Gx`` as 20K or 1G, which is not what anybody writing them meant;
- a symmetric heap of 0 bytes: init() takes its send/recv staging from that heap.
"""


from __future__ import annotations

import math
import os
import re
import socket
from typing import Mapping

from .. import _C
from .._limits import INT32_MAX, MAX_CHUNK_BYTES, MAX_SEND_BLOCKS, MAX_TIMEOUT_S, SIZE_MAX
from . import probes as _probes

Error = _C.Error

# NVSHMEM 3.4.5's variables of kind "size" (env_defs.h), all parsed when an ID is created; each
# was checked against libnvshmem_host.so.3: a bad value prints "Invalid size in environment
# variable" (and SYMMETRIC_SIZE's then crashes the process).
NVSHMEM_SIZE_VARIABLES = (
    "NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_MAX_MEMORY_PER_GPU", "NVSHMEM_CUMEM_GRANULARITY",
    "NVSHMEM_FCOLLECT_LL_THRESHOLD", "NVSHMEM_FCOLLECT_LL128_THRESHOLD",
    "NVSHMEM_FCOLLECT_NVLS_THRESHOLD", "NVSHMEM_REDUCESCATTER_NVLS_THRESHOLD",
    "NVSHMEM_REDUCE_SCRATCH_SIZE",
)
NVSHMEM_DEFAULT_SYMMETRIC_SIZE = 1 << 30

# NCCL variable -> the NVSHMEM variable that means the same thing (init() copies NCCL's over
# where NVSHMEM's is unset; see _network.apply_network_settings).
NCCL_TO_NVSHMEM = {
    "NCCL_SOCKET_IFNAME": "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
    "NCCL_SOCKET_FAMILY": "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY",
    "NCCL_IB_HCA": "NVSHMEM_HCA_LIST",
}

_SCALES = {"k": 10, "m": 20, "g": 30, "t": 40}
# strtod's numbers: decimal with optional exponent, or hexadecimal with optional binary exponent,
# or inf/infinity/nan; optional sign; leading blanks skipped.
_DECIMAL = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_HEX = r"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?"
_SPECIAL = r"[+-]?(?:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)"
_NUMBER = re.compile(rf"\s*({_HEX}|{_DECIMAL}|{_SPECIAL})", re.IGNORECASE)

_SIZE_HOWTO = "a byte count with an optional k, M, G or T suffix, e.g. 2G, 1536M or 1073741824"


class SettingError(ValueError):
    """One environment variable's value is wrong; str() says why and what to set."""


def _number(text: str) -> tuple[float, str]:
    match = _NUMBER.match(text)
    if not match:
        raise SettingError("no number at its start")
    literal = match.group(1)
    value = float.fromhex(literal) if "x" in literal.lower() else float(literal)
    return value, text[match.end():]


def parse_nvshmem_size(text: str, name: str = "NVSHMEM_SYMMETRIC_SIZE", *,
                       allow_zero: bool = False) -> int:
    """Bytes that NVSHMEM will read from `text`, with NVSHMEM's grammar (see the module's
    docstring). Raises SettingError, saying what to write instead, for anything else."""
    shown = f"{name}={text!r}"
    try:
        value, rest = _number(text)
    except SettingError:
        raise SettingError(f"{shown} is not a size: write {_SIZE_HOWTO}") from None
    scale = 0
    if rest:
        letter, trailer = rest[0].lower(), rest[1:]
        if letter not in _SCALES:
            what = ("blanks after the number" if rest.isspace() else f"{rest!r} after the number")
            raise SettingError(f"{shown} has {what}, which NVSHMEM cannot read (it would end the "
                               f"process): write {_SIZE_HOWTO}")
        if trailer.strip().lower() not in ("", "b", "ib"):
            meant = text[:len(text) - len(rest) + 1].strip()
            raise SettingError(f"{shown} means {meant} to NVSHMEM, which reads only the first "
                               f"letter after the number and ignores {trailer!r}: write {_SIZE_HOWTO}")
        scale = _SCALES[letter]
    if math.isnan(value) or math.isinf(value):
        raise SettingError(f"{shown} is not a finite size: write {_SIZE_HOWTO}")
    if value < 0:
        raise SettingError(f"{shown} is negative: write {_SIZE_HOWTO}")
    nbytes = math.ceil(value * (1 << scale))
    if nbytes > SIZE_MAX:
        raise SettingError(f"{shown} is more than 2^64 - 1 bytes: write {_SIZE_HOWTO}")
    if nbytes == 0 and not allow_zero:
        raise SettingError(f"{shown} leaves no room: pydatacopy.init() takes its send/recv staging "
                           f"from this heap; write {_SIZE_HOWTO}, or unset it for NVSHMEM's 1G")
    return nbytes


def symmetric_size(environ: Mapping[str, str] = os.environ) -> int:
    """The symmetric heap NVSHMEM will reserve per PE, in bytes (NVSHMEM_SYMMETRIC_SIZE, else
    NVSHMEM's default of 1 GiB). Raises SettingError for a value NVSHMEM cannot use."""
    text = environ.get("NVSHMEM_SYMMETRIC_SIZE")
    return NVSHMEM_DEFAULT_SYMMETRIC_SIZE if text is None else parse_nvshmem_size(text)


def nvshmem_bool(text: str) -> bool:
    """How NVSHMEM reads a set boolean variable: off when it starts with 0, n, N, f or F, else on
    (an empty value included)."""
    return not text or text[0] not in "0nNfF"


# ---- pydatacopy's own variables ------------------------------------------------------------

_SECONDS = re.compile(rf"\s*(?:{_DECIMAL}|{_HEX})", re.IGNORECASE)


def parse_seconds(text: str, name: str, default: float) -> float:
    """A positive, finite number of seconds, as the core reads PYDATACOPY_TIMEOUT_S (strtod over
    the whole value), at most MAX_TIMEOUT_S."""
    match = _SECONDS.fullmatch(text)
    if match:
        literal = text.strip()
        seconds = float.fromhex(literal) if "x" in literal.lower() else float(literal)
        if 0 < seconds <= MAX_TIMEOUT_S:
            return seconds
    raise SettingError(f"{name}={text!r} is not a positive number of seconds (at most "
                       f"{MAX_TIMEOUT_S:.0e}): set it to e.g. {default:g}, or unset it for the "
                       f"default {default:g}")


def parse_int(text: str, name: str, minimum: int, maximum: int, example: int | str,
              meaning: str) -> int:
    """A whole number in [minimum, maximum], written in decimal digits."""
    stripped = text.strip()
    if not re.fullmatch(r"\+?[0-9]+", stripped):
        raise SettingError(f"{name}={text!r} is not a whole number ({meaning}): set it to e.g. "
                           f"{example}, or unset it")
    value = int(stripped)
    if not minimum <= value <= maximum:
        raise SettingError(f"{name}={value} is out of range: {meaning} must be in [{minimum}, "
                           f"{maximum}]; set it to e.g. {example}, or unset it")
    return value


def parse_switch(text: str, name: str, meaning: str) -> bool:
    """0/1 switches. The core treats every value but unset, empty and 0 as on, so a 'false'
    would switch it on: refuse anything but 0 and 1 (exactly: the core reads ' 0' as on)."""
    if text in ("", "0"):
        return False
    if text == "1":
        return True
    raise SettingError(f"{name}={text!r} must be 1 ({meaning}) or 0 (or unset)")


# (variable, default) of send/recv's staging, and their ranges.
SEND_RECV_DEFAULTS = {"PYDATACOPY_CHUNK_BYTES": 8 << 20, "PYDATACOPY_NUM_CHUNKS": 4,
                      "PYDATACOPY_SEND_BLOCKS": 128}
SEND_RECV_RANGES = {"chunk_bytes": (1, MAX_CHUNK_BYTES), "num_chunks": (2, INT32_MAX),
                    "blocks": (1, MAX_SEND_BLOCKS)}
_SEND_RECV_MEANING = {
    "PYDATACOPY_CHUNK_BYTES": ("chunk_bytes", "bytes per send/recv staging chunk"),
    "PYDATACOPY_NUM_CHUNKS": ("num_chunks", "staging chunks per peer"),
    "PYDATACOPY_SEND_BLOCKS": ("blocks", "thread blocks per send or recv"),
}


def send_recv_settings(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int]:
    """(chunk_bytes, num_chunks, blocks) from PYDATACOPY_CHUNK_BYTES, PYDATACOPY_NUM_CHUNKS and
    PYDATACOPY_SEND_BLOCKS, else 8 MiB, 4 and 128. Raises SettingError for a bad value."""
    values = []
    for name, default in SEND_RECV_DEFAULTS.items():
        text = environ.get(name)
        if text is None:
            values.append(default)
            continue
        argument, meaning = _SEND_RECV_MEANING[name]
        low, high = SEND_RECV_RANGES[argument]
        values.append(parse_int(text, name, low, high, default, meaning))
    return values[0], values[1], values[2]


def world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """WORLD_SIZE (torchrun sets it), or None when unset."""
    text = environ.get("WORLD_SIZE")
    if text is None:
        return None
    return parse_int(text, "WORLD_SIZE", 1, INT32_MAX, 2, "the number of processes in the job, "
                     "which torchrun sets")


def local_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """LOCAL_RANK (torchrun sets it: this process's index on its node), or None when unset."""
    text = environ.get("LOCAL_RANK")
    if text is None:
        return None
    return parse_int(text, "LOCAL_RANK", 0, INT32_MAX, 0, "this process's index on its node, "
                     "which torchrun sets")


def local_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """LOCAL_WORLD_SIZE (torchrun sets it: the number of processes on this node), or None when
    unset or not a positive whole number (then not torchrun's, as network.py reads it too)."""
    text = environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and text.isascii() and int(text) > 0 else None


#: The most ranks pydatacopy lets share one GPU (MPS serves at most 48 clients per GPU on Volta
#: and up to 60 on later GPUs; without MPS every one more rank is one more time slice).
MAX_RANKS_PER_GPU = 64


def ranks_per_gpu(environ: Mapping[str, str] = os.environ) -> int:
    """PYDATACOPY_RANKS_PER_GPU (default 1): how many ranks of a node share one CUDA device.
    choose_device gives local rank r the device r // ranks_per_gpu."""
    text = environ.get("PYDATACOPY_RANKS_PER_GPU")
    if text is None:
        return 1
    return parse_int(text, "PYDATACOPY_RANKS_PER_GPU", 1, MAX_RANKS_PER_GPU, 2,
                     "how many ranks of a node share one GPU: local rank r uses CUDA device r // it")


def mps_thread_percentage(environ: Mapping[str, str] = os.environ) -> float | None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the share of a GPU's threads, so of its SMs, an MPS
    client may use), or None when unset. NVSHMEM reads it with atof and sums it over the PEs of
    one GPU; pydatacopy refuses what is not a number in (0, 100]."""
    text = environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 100:
        raise SettingError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={text!r} is not a percentage in "
                           "(0, 100]: the share of the GPU's SMs this MPS client may use; with K "
                           "ranks on one GPU set it to 100/K or less (e.g. 50 for two), or unset it")
    return value


def select_interfaces(spec: str, addresses: list[tuple[str, int]],
                      family: int | None = None) -> list[str]:
    """The interfaces NCCL's (and NVSHMEM's) findInterfaces picks for an IFNAME value: a comma
    list of name prefixes (``eth,ib``), each optionally ``name:port``; ``=`` first for exact
    names (``=eth0``); ``^`` first to exclude instead (``^docker,lo``, ``^=eth1``)."""
    exclude = spec.startswith("^")
    if exclude:
        spec = spec[1:]
    exact = spec.startswith("=")
    if exact:
        spec = spec[1:]
    prefixes = [item.split(":", 1)[0] for item in spec.split(",")]
    prefixes = [p for p in prefixes if p]

    def listed(name: str) -> bool:
        if not prefixes:
            return True
        return any(name == p if exact else name.startswith(p) for p in prefixes)

    chosen: list[str] = []
    for name, fam in addresses:
        if family is not None and fam != family:
            continue
        if listed(name) != exclude and name not in chosen:
            chosen.append(name)
    return chosen


_FAMILIES = {"AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6}


def network_settings(environ: Mapping[str, str] = os.environ) -> dict[str, tuple[str, str]]:
    """NVSHMEM variable -> (value, the variable it comes from) as init() will hand them to
    NVSHMEM: NVSHMEM's own where set, else NCCL's."""
    settings = {}
    for nccl_name, nvshmem_name in NCCL_TO_NVSHMEM.items():
        if nvshmem_name in environ:
            settings[nvshmem_name] = (environ[nvshmem_name], nvshmem_name)
        elif nccl_name in environ:
            settings[nvshmem_name] = (environ[nccl_name], nccl_name)
    return settings


def _origin(value: str, source: str, target: str) -> str:
    if source == target:
        return f"{source}={value!r}"
    return f"{source}={value!r} (which pydatacopy hands to NVSHMEM as {target})"


def check_interfaces(environ: Mapping[str, str] = os.environ,
                     addresses: list[tuple[str, int]] | None = None) -> list[str]:
    """The interfaces NVSHMEM's bootstrap may use (empty: NVSHMEM chooses); SettingError when
    the interface or family setting selects none (NVSHMEM would fail with 'No socket interface
    found', status 7), or NVSHMEM_BOOTSTRAP_UID_SESSION_ID is not HOST:PORT."""
    settings = network_settings(environ)
    family = None
    if "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY" in settings:
        value, source = settings["NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY"]
        if value.strip() and value.strip() not in _FAMILIES:
            raise SettingError(f"{_origin(value, source, 'NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY')} must "
                               "be AF_INET (IPv4) or AF_INET6 (IPv6), or unset (either)")
        family = _FAMILIES.get(value.strip())
    session = environ.get("NVSHMEM_BOOTSTRAP_UID_SESSION_ID")
    if session is not None:
        match = re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+):([0-9]+)", session)
        if not match or not 1 <= int(match.group(2)) <= 65535:
            raise SettingError(f"NVSHMEM_BOOTSTRAP_UID_SESSION_ID={session!r} must be the address "
                               "rank 0 listens on, HOST:PORT (<ipv4>:<port>, [<ipv6>]:<port> or "
                               "<hostname>:<port>, port 1-65535); or unset it")
    if "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" not in settings:
        return []
    value, source = settings["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"]
    if addresses is None:
        addresses = _probes.interface_addresses()
    chosen = select_interfaces(value, addresses, family)
    if not chosen:
        present = sorted({name for name, fam in addresses if family is None or fam == family})
        kind = {None: "an IPv4 or IPv6", socket.AF_INET: "an IPv4", socket.AF_INET6: "an IPv6"}[family]
        raise SettingError(
            f"{_origin(value, source, 'NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME')} selects no network "
            f"interface with {kind} address on this machine (it has: {', '.join(present) or 'none'}). "
            "Set it to one of those (a name prefix, '=name' for an exact name, '^name' to exclude), "
            "or unset it and let NVSHMEM choose")
    return chosen


# ---- the bootstrap plugin ------------------------------------------------------------------

def check_bootstrap_plugin(environ: Mapping[str, str] = os.environ) -> None:
    """NVSHMEM_BOOTSTRAP_UID_PLUGIN names the library NVSHMEM's unique-ID bootstrap loads; a name
    it cannot load makes NVSHMEM abort the process (seen: "dlopen failed", then a double free)."""
    name = environ.get("NVSHMEM_BOOTSTRAP_UID_PLUGIN")
    if name is None:
        return
    found = os.path.isfile(name) if "/" in name else any(
        os.path.isfile(os.path.join(d, name)) for d in _probes.library_dirs())
    if not found:
        raise SettingError(
            f"NVSHMEM_BOOTSTRAP_UID_PLUGIN={name!r} names no library NVSHMEM could load (not a file"
            + ("" if "/" in name else ", and not in NVSHMEM's lib directory, LD_LIBRARY_PATH or the "
               "system's library directories")
            + "), and NVSHMEM would abort the process. Unset it (NVSHMEM then uses its own "
            "nvshmem_bootstrap_uid.so.3) or give the path of the plugin")


# ---- all of them ---------------------------------------------------------------------------

def nvshmem_problems(environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(variable, what is wrong and what to set) for every NVSHMEM-side setting NVSHMEM would
    crash, exit or fail on: its size variables, the bootstrap's interface, family and session ID
    (reported as "the bootstrap settings"), and the unique-ID bootstrap plugin."""
    problems = []
    for name in NVSHMEM_SIZE_VARIABLES:
        if name in environ:
            try:
                parse_nvshmem_size(environ[name], name,
                                   allow_zero=name != "NVSHMEM_SYMMETRIC_SIZE")
            except SettingError as error:
                problems.append((name, str(error)))
    try:
        check_interfaces(environ)
    except SettingError as error:
        problems.append(("the bootstrap settings", str(error)))  # interface, family, session ID
    try:
        check_bootstrap_plugin(environ)
    except SettingError as error:
        problems.append(("NVSHMEM_BOOTSTRAP_UID_PLUGIN", str(error)))
    return problems


def pydatacopy_problems(environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """Like nvshmem_problems, for PYDATACOPY_* and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (which
    init() sums over the ranks sharing a GPU)."""
    checks = [
        ("PYDATACOPY_TIMEOUT_S", lambda t: parse_seconds(t, "PYDATACOPY_TIMEOUT_S", 60)),
        ("PYDATACOPY_INIT_TIMEOUT_S", lambda t: parse_seconds(t, "PYDATACOPY_INIT_TIMEOUT_S", 300)),
        ("PYDATACOPY_FORCE_RMA", lambda t: parse_switch(
            t, "PYDATACOPY_FORCE_RMA", "every transfer takes NVSHMEM's RMA path, a test switch")),
        ("PYDATACOPY_IBGDA", lambda t: parse_switch(
            t, "PYDATACOPY_IBGDA", "turn on NVSHMEM's GPU-initiated InfiniBand transport")),
        ("PYDATACOPY_CHECK_RMA", lambda t: parse_switch(
            t, "PYDATACOPY_CHECK_RMA", "verify every local address handed to an NVSHMEM RMA call")),
        ("PYDATACOPY_AUTO_REGISTER", lambda t: parse_switch(
            t, "PYDATACOPY_AUTO_REGISTER", "register local buffers with NVSHMEM on first use")),
        ("PYDATACOPY_RANKS_PER_GPU", lambda t: ranks_per_gpu({"PYDATACOPY_RANKS_PER_GPU": t})),
        ("PYDATACOPY_ZERO_COPY_MIN_BYTES", lambda t: parse_int(
            t, "PYDATACOPY_ZERO_COPY_MIN_BYTES", 0, 2**63 - 1, 1 << 20,
            "the smallest send/recv message that moves zero-copy between load/store peers, 0: off")),
        ("PYDATACOPY_PROGRAMMATIC_LAUNCH", lambda t: parse_switch(
            t, "PYDATACOPY_PROGRAMMATIC_LAUNCH",
            "send/recv kernels start while the previous kernel on the stream ends, sm_90+, the default")),
        # Not ours, but init() sums it over the ranks of a GPU (see agreement.shared_gpu_verdict).
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
         lambda t: mps_thread_percentage({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": t})),
    ]
    problems = []
    for name, check in checks:
        if name in environ:
            try:
                check(environ[name])
            except SettingError as error:
                problems.append((name, str(error)))
    for name in SEND_RECV_DEFAULTS:
        if name in environ:
            try:
                send_recv_settings({name: environ[name]})
            except SettingError as error:
                problems.append((name, str(error)))
    return problems


def _raise(call: str, problems: list[tuple[str, str]]) -> None:
    if problems:
        more = len(problems) - 1
        raise Error(f"{call}: {problems[0][1]}"
                    + (f" (and {more} more: python -m pydatacopy.doctor lists them)" if more else ""))


def check_nvshmem_environment(call: str, environ: Mapping[str, str] = os.environ) -> None:
    """Raise pydatacopy.Error, naming `call`, when an NVSHMEM setting would crash NVSHMEM."""
    _raise(call, nvshmem_problems(environ))


def check_environment(call: str, environ: Mapping[str, str] = os.environ) -> None:
    """check_nvshmem_environment, and pydatacopy's own PYDATACOPY_* settings."""
    _raise(call, nvshmem_problems(environ) + pydatacopy_problems(environ))


def rma_options(environ: Mapping[str, str] = os.environ) -> tuple[bool, bool]:
    """(check, auto_register) from PYDATACOPY_CHECK_RMA (default 0) and PYDATACOPY_AUTO_REGISTER
    (default 1); check_environment has validated them."""
    check = environ.get("PYDATACOPY_CHECK_RMA", "") == "1"
    auto_register = environ.get("PYDATACOPY_AUTO_REGISTER", "1") != "0"
    return check, auto_register
