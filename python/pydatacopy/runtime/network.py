"""Network settings for NVSHMEM's bootstrap and transports, following NCCL's where NVSHMEM's are
unset, and checks that keep NVSHMEM from ending the process on a setup it cannot run."""

from __future__ import annotations

import ctypes
import os
import socket
from typing import Callable, Mapping, NamedTuple

from .. import _C
from .settings import NCCL_TO_NVSHMEM, nvshmem_bool  # NCCL_TO_NVSHMEM: NCCL name -> NVSHMEM name

Error = _C.Error

SYSFS_INFINIBAND = "/sys/class/infiniband"
GDRDRV_DEVICE = "/dev/gdrdrv"  # made by GDRCopy's gdrdrv kernel module
# What NVSHMEM's plugins dlopen: the UCX and libfabric transports, and GDRCopy.
UCX_LIBRARY, LIBFABRIC_LIBRARY, GDRCOPY_LIBRARY = "libucp.so.0", "libfabric.so.1", "libgdrapi.so.2"
# NVSHMEM_REMOTE_TRANSPORT values NVSHMEM 3.4.5 has a transport for; unset means ibrc.
REMOTE_TRANSPORTS = ("ibrc", "ucx", "ibdevx", "libfabric")
LIBUCX_LIB_DIR = ("python -c \"import libucx, os; "
                  "print(os.path.join(os.path.dirname(libucx.__file__), 'lib'))\"")
_NIC_FIX = "use nodes with an InfiniBand/RoCE port that is up (ibstat shows State: Active)"

Loader = Callable[[str], object]


class RdmaPort(NamedTuple):
    device: str
    port: str
    state: str       # ACTIVE, DOWN, INIT...
    link_layer: str  # InfiniBand, or Ethernet for RoCE

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def kind(self) -> str:
        return "RoCE" if self.link_layer == "Ethernet" else self.link_layer or "link layer unknown"


def _read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return ""


def rdma_ports(sysfs_root: str = SYSFS_INFINIBAND) -> list[RdmaPort]:
    """Every port of every RDMA device, from sysfs (<dev>/ports/<n>/state reads "4: ACTIVE")."""
    ports = []
    for device in sorted(os.listdir(sysfs_root)) if os.path.isdir(sysfs_root) else []:
        base = os.path.join(sysfs_root, device, "ports")
        try:
            numbers = sorted(os.listdir(base), key=lambda n: (len(n), n))
        except OSError:
            continue
        for number in numbers:
            state = _read(os.path.join(base, number, "state")).rpartition(":")[2].strip()
            ports.append(RdmaPort(device, number, state or "state unknown",
                                  _read(os.path.join(base, number, "link_layer"))))
    return ports


def library_loads(name: str, load: Loader = ctypes.CDLL) -> bool:
    """Whether dlopen finds `name` as NVSHMEM's plugins will (this process's LD_LIBRARY_PATH,
    as it was at start-up, then the system's directories)."""
    try:
        load(name)
        return True
    except OSError:
        return False


def gdrcopy_problem(environ: Mapping[str, str] = os.environ, *, load: Loader = ctypes.CDLL,
                    gdrdrv_path: str = GDRDRV_DEVICE) -> str | None:
    """Why NVSHMEM could not use GDRCopy here, or None when it can: it needs the user library
    and the gdrdrv kernel module's device, and NVSHMEM_DISABLE_GDRCOPY unset or off."""
    if "NVSHMEM_DISABLE_GDRCOPY" in environ and nvshmem_bool(environ["NVSHMEM_DISABLE_GDRCOPY"]):
        return f"NVSHMEM_DISABLE_GDRCOPY={environ['NVSHMEM_DISABLE_GDRCOPY']} turns it off"
    missing = []
    if not library_loads(GDRCOPY_LIBRARY, load):
        missing.append(f"{GDRCOPY_LIBRARY} does not load")
    if not os.path.exists(gdrdrv_path):
        missing.append(f"no {gdrdrv_path}, the gdrdrv kernel module is not loaded")
    return "; ".join(missing) or None


def ibgda_on(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether NVSHMEM will use IBGDA (GPU-initiated InfiniBand), counting PYDATACOPY_IBGDA=1,
    which init() turns into NVSHMEM_IB_ENABLE_IBGDA=1 (apply_network_settings)."""
    if "NVSHMEM_IB_ENABLE_IBGDA" in environ:
        return nvshmem_bool(environ["NVSHMEM_IB_ENABLE_IBGDA"])
    return environ.get("PYDATACOPY_IBGDA") == "1"


def remote_transport(environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(NVSHMEM's remote transport, lower case, as NVSHMEM compares it; how it was chosen)."""
    if "NVSHMEM_REMOTE_TRANSPORT" not in environ:
        return "ibrc", "ibrc (NVSHMEM's default, NVSHMEM_REMOTE_TRANSPORT unset)"
    value = environ["NVSHMEM_REMOTE_TRANSPORT"]
    return value.lower(), f"NVSHMEM_REMOTE_TRANSPORT={value}"


def remote_transport_problem(environ: Mapping[str, str] = os.environ, *,
                             sysfs_root: str = SYSFS_INFINIBAND, load: Loader = ctypes.CDLL,
                             gdrdrv_path: str = GDRDRV_DEVICE) -> tuple[str, str] | None:
    """(why, what to do) when NVSHMEM's remote transport cannot reach PEs on other nodes from
    here, else None; `why` starts with the transport as remote_transport() names it. Each case
    ends the process in NVSHMEM's init (seen on the 2-GPU machine)."""
    name, chosen = remote_transport(environ)
    if name not in REMOTE_TRANSPORTS:
        why = (f"{chosen} turns NVSHMEM's remote transports off" if name == "none" else
               f"{chosen} names no transport NVSHMEM has, so it uses none")
        hint = "; IBGDA is NVSHMEM_IB_ENABLE_IBGDA=1 (or PYDATACOPY_IBGDA=1)" if name == "ibgda" else ""
        return why, ("unset NVSHMEM_REMOTE_TRANSPORT (NVSHMEM then uses ibrc) or set it to "
                     f"{', '.join(REMOTE_TRANSPORTS)}{hint}")
    ports = rdma_ports(sysfs_root)
    if not any(p.active for p in ports):
        devices = sorted({p.device for p in ports})
        no_port = (f"no port of {', '.join(devices)} is ACTIVE" if devices else
                   f"there is no InfiniBand/RoCE device in {sysfs_root}")
        if ibgda_on(environ):
            return (f"{chosen} with IBGDA (GPU-initiated InfiniBand: NVSHMEM_IB_ENABLE_IBGDA or "
                    f"PYDATACOPY_IBGDA) needs an ACTIVE InfiniBand/RoCE port, and {no_port}",
                    f"{_NIC_FIX}, or unset NVSHMEM_IB_ENABLE_IBGDA and PYDATACOPY_IBGDA")
        if name in ("ibrc", "ibdevx"):
            return f"{chosen} needs an ACTIVE InfiniBand/RoCE port, and {no_port}", _NIC_FIX
    if name == "libfabric" and not library_loads(LIBFABRIC_LIBRARY, load):
        return (f"{chosen} needs {LIBFABRIC_LIBRARY}, which does not load here",
                "install libfabric (with your network's provider, e.g. efa or cxi) and put its "
                "lib directory on LD_LIBRARY_PATH before Python starts")
    if name == "ucx":
        if not library_loads(UCX_LIBRARY, load):
            return (f"{chosen}: NVSHMEM's UCX plugin needs {UCX_LIBRARY}, which does not load here",
                    "pip install libucx-cu13 and put its libucx/lib on LD_LIBRARY_PATH before "
                    f"Python starts: export LD_LIBRARY_PATH=$({LIBUCX_LIB_DIR}):$LD_LIBRARY_PATH")
        gdrcopy = None if any(p.active for p in ports) else gdrcopy_problem(
            environ, load=load, gdrdrv_path=gdrdrv_path)
        if gdrcopy:
            return (f"{chosen} does its atomics with the NIC or with GDRCopy, and here there is "
                    f"no ACTIVE InfiniBand/RoCE port and GDRCopy is unusable ({gdrcopy}); NVSHMEM "
                    "says 'AMO not supported with the current configuration (GDRCopy Disabled)'",
                    "install GDRCopy (libgdrapi.so.2) and load its gdrdrv kernel module "
                    f"(/dev/gdrdrv), or {_NIC_FIX}")
    return None


def _p2p_off(environ: Mapping[str, str]) -> bool:
    return "NVSHMEM_DISABLE_P2P" in environ and nvshmem_bool(environ["NVSHMEM_DISABLE_P2P"])


def _local_world_size(environ: Mapping[str, str]) -> int | None:
    text = environ.get("LOCAL_WORLD_SIZE", "").strip()  # torchrun's PEs per node
    return int(text) if text.isdigit() and int(text) > 0 else None


def apply_network_settings(environ=os.environ) -> dict[str, str]:
    """Copy NCCL's interface/HCA choices to NVSHMEM's variables where those are unset, and turn
    on IBGDA when PYDATACOPY_IBGDA=1. Returns what it set. init()/init_nvshmem() call it before
    NVSHMEM starts (NVSHMEM reads its environment once, at init)."""
    applied = {}
    for nccl_name, nvshmem_name in NCCL_TO_NVSHMEM.items():
        if nccl_name in environ and nvshmem_name not in environ:
            environ[nvshmem_name] = applied[nvshmem_name] = environ[nccl_name]
    if environ.get("PYDATACOPY_IBGDA") == "1" and "NVSHMEM_IB_ENABLE_IBGDA" not in environ:
        environ["NVSHMEM_IB_ENABLE_IBGDA"] = applied["NVSHMEM_IB_ENABLE_IBGDA"] = "1"
    return applied


def host_identity(boot_id_path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """What tells this node from others: the hostname with the kernel's boot ID (NCCL's host
    hash takes both). Containers of one machine with hostnames of their own count as hosts of
    their own, as NVSHMEM's P2P transport, which goes by a hash of the hostname, sees them."""
    boot_id = ""
    try:
        with open(boot_id_path) as f:
            boot_id = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot_id}"


def check_transport_preconditions(world_size: int, environ=os.environ, *,
                                  call: str = "pydatacopy.init", nodes: int | None = None,
                                  sysfs_root: str = SYSFS_INFINIBAND, load: Loader = ctypes.CDLL,
                                  gdrdrv_path: str = GDRDRV_DEVICE) -> None:
    """Refuse set-ups on which NVSHMEM would print an error and exit() the whole process.

    Peers need NVSHMEM's remote transport when the job spans nodes (`nodes`, the number of
    distinct hosts pydatacopy.init saw among the ranks, above 1; where it is not known,
    torchrun's LOCAL_WORLD_SIZE below world_size) or NVSHMEM_DISABLE_P2P is on; when that transport cannot work here
    (remote_transport_problem), NVSHMEM ends the process during init ("Unable to initialize any
    transports", or UCX's "AMO not supported" on its first atomic), as seen on the 2-GPU machine.
    """
    if world_size <= 1:
        return
    local = _local_world_size(environ)
    # The hosts init() saw are the truth (two torchrun "nodes" on one machine share its P2P);
    # without them, torchrun's count of PEs per node.
    spans_nodes = nodes > 1 if nodes is not None else local is not None and local < world_size
    p2p_off = _p2p_off(environ)
    if not (spans_nodes or p2p_off):
        return
    problem = remote_transport_problem(environ, sysfs_root=sysfs_root, load=load,
                                       gdrdrv_path=gdrdrv_path)
    if problem is None:
        return
    why, fix = problem
    if spans_nodes:
        where = (f"its {world_size} PEs run on {nodes} hosts" if nodes is not None and nodes > 1
                 else f"LOCAL_WORLD_SIZE={local} of {world_size} PEs")
        raise Error(f"{call}: the job spans nodes ({where}), "
                    f"and PEs on other nodes would be unreachable: {why}. NVSHMEM would end the "
                    f"process. To reach them, {fix}")
    raise Error(f"{call}: NVSHMEM_DISABLE_P2P={environ['NVSHMEM_DISABLE_P2P']} leaves NVSHMEM no "
                f"way to reach the other PEs here: {why}. NVSHMEM would end the process. "
                "Unset NVSHMEM_DISABLE_P2P; to exercise the path a remote peer takes on one "
                f"machine, set PYDATACOPY_FORCE_RMA=1. To keep NVSHMEM_DISABLE_P2P, {fix}")


def remote_transport_report(environ: Mapping[str, str] = os.environ, *,
                            sysfs_root: str = SYSFS_INFINIBAND, load: Loader = ctypes.CDLL,
                            gdrdrv_path: str = GDRDRV_DEVICE) -> list[tuple[str, str]]:
    """(verdict, text) lines for the doctor: which remote transport NVSHMEM would use for PEs on
    other servers, what it needs and whether this node has it. A transport that cannot work is
    INFO when it is NVSHMEM's default (a single-node machine needs none), WARN when chosen."""
    lines = []
    ports = rdma_ports(sysfs_root)
    for device in sorted({p.device for p in ports}):
        mine = [p for p in ports if p.device == device]
        lines.append(("OK" if any(p.active for p in mine) else "INFO", f"RDMA device {device}: "
                      + ", ".join(f"port {p.port} {p.state} ({p.kind})" for p in mine)))
    if not ports:
        lines.append(("INFO", f"RDMA devices: none in {sysfs_root} (no InfiniBand/RoCE NIC)"))
    ibgda = ibgda_on(environ)
    lines.append(("INFO", "IBGDA (GPU-initiated InfiniBand): " + (
        "on, it needs an ACTIVE InfiniBand/RoCE port" if ibgda else
        "off (NVSHMEM_IB_ENABLE_IBGDA=1 or PYDATACOPY_IBGDA=1 turns it on)")))
    for library, use in ((UCX_LIBRARY, "NVSHMEM_REMOTE_TRANSPORT=ucx"),
                         (LIBFABRIC_LIBRARY, "NVSHMEM_REMOTE_TRANSPORT=libfabric")):
        loads = library_loads(library, load)
        lines.append(("OK" if loads else "INFO",
                      f"{library} {'loads' if loads else 'does not load'} (needed by {use})"))
    gdrcopy = gdrcopy_problem(environ, load=load, gdrdrv_path=gdrdrv_path)
    lines.append(("OK" if gdrcopy is None else "INFO",
                  f"GDRCopy: usable ({GDRCOPY_LIBRARY} loads, {gdrdrv_path} present)"
                  if gdrcopy is None else f"GDRCopy: not usable ({gdrcopy})"))

    name, chosen = remote_transport(environ)
    p2p_off = _p2p_off(environ)
    local = ("NVSHMEM_DISABLE_P2P is on, so PEs on this node go through it too" if p2p_off
             else "PEs on this node use NVLink/PCIe P2P")
    problem = remote_transport_problem(environ, sysfs_root=sysfs_root, load=load,
                                       gdrdrv_path=gdrdrv_path)
    if problem is None:
        active = sorted({f"{p.device} ({p.kind})" for p in ports if p.active})
        over = (f" over {', '.join(active)}" if active else
                " through UCX, with GDRCopy for its atomics" if name == "ucx" else f" through {name}")
        lines.append(("OK", f"remote transport: {chosen}{', with IBGDA' if ibgda else ''}: can "
                            f"reach PEs on other servers{over}; {local}"))
    else:
        why, fix = problem
        chosen_by_user = "NVSHMEM_REMOTE_TRANSPORT" in environ or ibgda
        lines.append(("WARN" if chosen_by_user else "INFO",
                      f"remote transport: {why}, so PEs on other servers would be unreachable "
                      f"from this node; {local}. To reach them, {fix}"))
    return lines
