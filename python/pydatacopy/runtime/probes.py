"""Probes of this machine that the settings' checks, init(), the doctor and the network set-up
read: an MPS control daemon (its control socket or pipe, /proc/net/unix, /proc/*/comm), the
network interfaces (getifaddrs) and where NVSHMEM's loader looks for libraries. Standard library
only, and no side effects on what they look at."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
from typing import Mapping

#: Where MPS clients look for the control daemon when CUDA_MPS_PIPE_DIRECTORY is unset.
MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_control_pipe(environ: Mapping[str, str] = os.environ,
                     unix_sockets: str = "/proc/net/unix") -> str | None:
    """The control endpoint (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps, then 'control') of
    an MPS control daemon that is running, or None when none serves it: then CUDA contexts made
    here are not MPS clients.

    The file alone proves nothing: CUDA 13's daemon listens on a UNIX socket named 'control'
    (not a named pipe, as older ones did: a probe for a pipe missed every running daemon), and a
    daemon killed hard leaves the file behind. A socket counts when a process listens on it:
    listed as listening in `unix_sockets` (read only: the daemon sees nothing), else (another
    network namespace lists other sockets) a connect() that succeeds, closed at once. A named
    pipe (older MPS) counts while an nvidia-cuda-mps process runs (the pipe is not opened: that
    could disturb a live daemon)."""
    import stat

    path = os.path.join(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_DEFAULT_PIPE_DIRECTORY,
                        "control")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return path if _unix_socket_listening(path, unix_sockets) else None
    if stat.S_ISFIFO(mode):
        return path if _mps_process_running() else None
    return None


_SO_ACCEPTCON = 0x10000  # /proc/net/unix's Flags of a listening socket


def _unix_socket_listening(path: str, unix_sockets: str) -> bool:
    wanted = os.path.normpath(path)
    try:
        with open(unix_sockets, encoding="ascii", errors="replace") as table:
            next(table, None)  # the header
            for line in table:
                fields = line.split()
                if (len(fields) >= 8 and os.path.normpath(fields[7]) == wanted
                        and int(fields[3], 16) & _SO_ACCEPTCON):
                    return True
    except (OSError, ValueError):
        pass
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
        return True
    except OSError:  # refused: nobody listens (a stale file); or not allowed to connect
        return False
    finally:
        probe.close()


def _mps_process_running(proc: str = "/proc") -> bool:
    """An nvidia-cuda-mps-control or -server process runs (the kernel keeps 15 characters of a
    process name: both read 'nvidia-cuda-mps')."""
    try:
        entries = [e for e in os.listdir(proc) if e.isdigit()]
    except OSError:
        return False
    for pid in entries:
        try:
            with open(os.path.join(proc, pid, "comm"), encoding="ascii", errors="replace") as comm:
                if comm.read().strip().startswith("nvidia-cuda-mps"):
                    return True
        except OSError:
            continue
    return False


# ---- network interfaces --------------------------------------------------------------------

class _SockAddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort)]


class _SockAddrIn6(ctypes.Structure):
    _fields_ = [("sin6_family", ctypes.c_ushort), ("sin6_port", ctypes.c_ushort),
                ("sin6_flowinfo", ctypes.c_uint32), ("sin6_addr", ctypes.c_ubyte * 16),
                ("sin6_scope_id", ctypes.c_uint32)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("ifa_next", ctypes.POINTER(_IfAddrs)), ("ifa_name", ctypes.c_char_p),
                     ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.POINTER(_SockAddr)),
                     ("ifa_netmask", ctypes.POINTER(_SockAddr)),
                     ("ifa_ifu", ctypes.POINTER(_SockAddr)), ("ifa_data", ctypes.c_void_p)]

_IPV6_LOOPBACK = bytes(15) + b"\x01"


def interface_addresses() -> list[tuple[str, int]]:
    """(interface name, address family) for every IPv4/IPv6 address of this machine, as
    NVSHMEM's bootstrap (NCCL's socket code) sees them through getifaddrs(): IPv6 loopback left
    out. Falls back to every interface name, both families, where getifaddrs is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        head = ctypes.POINTER(_IfAddrs)()
        if libc.getifaddrs(ctypes.byref(head)) != 0:
            raise OSError(ctypes.get_errno(), "getifaddrs failed")
    except (OSError, AttributeError):
        return [(name, family) for _, name in socket.if_nameindex()
                for family in (socket.AF_INET, socket.AF_INET6)]
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr:
                family = entry.ifa_addr.contents.sa_family
                if family == socket.AF_INET6:
                    address = ctypes.cast(entry.ifa_addr, ctypes.POINTER(_SockAddrIn6)).contents
                    if bytes(address.sin6_addr) == _IPV6_LOOPBACK:
                        family = None
                if family in (socket.AF_INET, socket.AF_INET6):
                    found.append((entry.ifa_name.decode(errors="replace"), family))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return found


# ---- libraries -------------------------------------------------------------------------------

def library_dirs() -> list[str]:
    """Where dlopen would look for a bare library name NVSHMEM loads: beside libnvshmem_host (its
    RUNPATH), LD_LIBRARY_PATH, then the system's directories."""
    dirs = []
    try:
        import nvidia.nvshmem as wheel  # the NVSHMEM pydatacopy loads
        dirs += [os.path.join(base, "lib") for base in wheel.__path__]
    except ImportError:
        pass
    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/lib", "/usr/lib", "/lib64", "/usr/lib64", "/usr/local/lib",
             "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"]
    return dirs

