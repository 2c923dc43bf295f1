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

import os
import re
import socket
from typing import Mapping

from .. import _C
from .._limits import INT32_MAX
from . import probes as _probes

Error = _C.Error

# The core's settings table (include/pydatacopy/settings.hpp): a row per variable, with its kind,
# default, range, meaning and example; the core's parsers read every value (_C.parse_*).
_ROWS = {row["name"]: row for row in _C.settings_table()}

# NVSHMEM 3.4.5's variables of kind "size" (env_defs.h), all parsed when an ID is created; each
# was checked against libnvshmem_host.so.3: a bad value prints "Invalid size in environment
# variable" (and SYMMETRIC_SIZE's then crashes the process).
NVSHMEM_SIZE_VARIABLES = tuple(name for name, row in _ROWS.items() if row["kind"] == "nvshmem_size")
NVSHMEM_DEFAULT_SYMMETRIC_SIZE = _C.NVSHMEM_DEFAULT_SYMMETRIC_SIZE

# NCCL variable -> the NVSHMEM variable that means the same thing (init() copies NCCL's over
# where NVSHMEM's is unset; see _network.apply_network_settings).
NCCL_TO_NVSHMEM = {
    "NCCL_SOCKET_IFNAME": "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME",
    "NCCL_SOCKET_FAMILY": "NVSHMEM_BOOTSTRAP_UID_SOCK_FAMILY",
    "NCCL_IB_HCA": "NVSHMEM_HCA_LIST",
}


class SettingError(ValueError):
    """One environment variable's value is wrong; str() says why and what to set."""


def _core(parse, text: str, *args):
    """A core parser's answer for `text`; its _C.SettingError raised as this module's SettingError.
    The text crosses as UTF-8 bytes, lone surrogates (undecodable bytes of os.environ) included."""
    try:
        return parse(text.encode("utf-8", "surrogatepass"), *args)
    except _C.SettingError as error:
        raise SettingError(str(error)) from None


def _value(name: str, environ: Mapping[str, str]):
    """`name` from `environ` as the core's table reads it, else its row's default (None: none)."""
    text = environ.get(name, _ROWS[name]["default"])
    return None if text is None else _core(lambda t: _C.parse_setting(name, t), text)


def parse_nvshmem_size(text: str, name: str = "NVSHMEM_SYMMETRIC_SIZE", *,
                       allow_zero: bool = False) -> int:
    """Bytes that NVSHMEM will read from `text`, with NVSHMEM's grammar (see the module's
    docstring). Raises SettingError, saying what to write instead, for anything else."""
    return _core(_C.parse_nvshmem_size, text, name, allow_zero)


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

def parse_seconds(text: str, name: str, default: float) -> float:
    """A positive, finite number of seconds, as the core reads PYDATACOPY_TIMEOUT_S (strtod over
    the whole value), at most _C.MAX_TIMEOUT_S."""
    return _core(_C.parse_seconds, text, name, float(default))


def parse_int(text: str, name: str, minimum: int, maximum: int, example: int | str,
              meaning: str) -> int:
    """A whole number in [minimum, maximum], written in decimal digits."""
    return _core(_C.parse_int, text, name, minimum, maximum, str(example), meaning)


def parse_switch(text: str, name: str, meaning: str) -> bool:
    """0/1 switches: 1 is on, 0 and empty (and unset) off; anything else (a 'false', a ' 0') is
    refused."""
    return _core(_C.parse_switch, text, name, meaning)


# (variable, default) of send/recv's staging, and their ranges (the core's table's).
SEND_RECV_DEFAULTS = {"PYDATACOPY_CHUNK_BYTES": _C.DEFAULT_CHUNK_BYTES,
                      "PYDATACOPY_NUM_CHUNKS": _C.DEFAULT_NUM_CHUNKS,
                      "PYDATACOPY_SEND_BLOCKS": _C.DEFAULT_SEND_BLOCKS}
_SEND_RECV_ARGUMENT = {"PYDATACOPY_CHUNK_BYTES": "chunk_bytes", "PYDATACOPY_NUM_CHUNKS": "num_chunks",
                       "PYDATACOPY_SEND_BLOCKS": "blocks"}
SEND_RECV_RANGES = {argument: (_ROWS[name]["minimum"], _ROWS[name]["maximum"])
                    for name, argument in _SEND_RECV_ARGUMENT.items()}


def send_recv_settings(environ: Mapping[str, str] = os.environ) -> tuple[int, int, int]:
    """(chunk_bytes, num_chunks, blocks) from PYDATACOPY_CHUNK_BYTES, PYDATACOPY_NUM_CHUNKS and
    PYDATACOPY_SEND_BLOCKS, else 8 MiB, 4 and 128. Raises SettingError for a bad value."""
    values = [_value(name, environ) for name in SEND_RECV_DEFAULTS]
    return values[0], values[1], values[2]


def world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """WORLD_SIZE (torchrun sets it), or None when unset."""
    return _torchrun_int(environ, "WORLD_SIZE", 1, 2, "the number of processes in the job")


def local_rank(environ: Mapping[str, str] = os.environ) -> int | None:
    """LOCAL_RANK (torchrun sets it: this process's index on its node), or None when unset."""
    return _torchrun_int(environ, "LOCAL_RANK", 0, 0, "this process's index on its node")


def _torchrun_int(environ: Mapping[str, str], name: str, minimum: int, example: int,
                  meaning: str) -> int | None:
    text = environ.get(name)
    if text is None:
        return None
    return parse_int(text, name, minimum, INT32_MAX, example, f"{meaning}, which torchrun sets")


def local_world_size(environ: Mapping[str, str] = os.environ) -> int | None:
    """LOCAL_WORLD_SIZE (torchrun sets it: the number of processes on this node), or None when
    unset or not a positive whole number (then not torchrun's, as network.py reads it too)."""
    text = environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(text) if text.isdigit() and text.isascii() and int(text) > 0 else None


#: The most ranks pydatacopy lets share one GPU (the core's limit: MPS serves at most 48 clients
#: per GPU on Volta and up to 60 on later GPUs; without MPS every one more rank is one more time
#: slice).
MAX_RANKS_PER_GPU = _C.MAX_RANKS_PER_GPU


def ranks_per_gpu(environ: Mapping[str, str] = os.environ) -> int:
    """PYDATACOPY_RANKS_PER_GPU (default 1): how many ranks of a node share one CUDA device.
    choose_device gives local rank r the device r // ranks_per_gpu."""
    return _value("PYDATACOPY_RANKS_PER_GPU", environ)


def mps_thread_percentage(environ: Mapping[str, str] = os.environ) -> float | None:
    """CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (the share of a GPU's threads, so of its SMs, an MPS
    client may use), or None when unset. NVSHMEM reads it with atof and sums it over the PEs of
    one GPU; pydatacopy refuses what is not a number in (0, 100]."""
    return _value("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", environ)


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
    init() sums over the ranks sharing a GPU): every row of the core's table but NVSHMEM's."""
    problems = []
    for name, row in _ROWS.items():
        if row["kind"] != "nvshmem_size" and name in environ:
            try:
                _core(lambda t: _C.parse_setting(name, t), environ[name])
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
    (default 1), an empty value reading as the default; check_environment has validated them."""
    def switch(name: str) -> bool:
        return _value(name, environ if environ.get(name) else {})
    return switch("PYDATACOPY_CHECK_RMA"), switch("PYDATACOPY_AUTO_REGISTER")
