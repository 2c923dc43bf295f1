"""The backend's native part (src/torch_backend/backend.cpp): a c10d::Backend, so that dist.send,
dist.recv, isend, irecv and batch_isend_irecv on CUDA tensors run from torch's C++ dispatcher to
the core without entering Python (issue 38: a Python process group costs torch's trampolines and a
Python Work per call).

A c10d::Backend is torch's C++ ABI, which changes with every torch release; pip builds pydatacopy
in an isolated environment without the torch it will run with. So the backend ships as source and
is built against the installed torch when a group is first made on the backend, once per torch
and pydatacopy version (torch.utils.cpp_extension; about 20 s with g++; cached in torch's
extensions directory, TORCH_EXTENSIONS_DIR). It needs a C++ compiler and ninja (a dependency).

The default (PYDATACOPY_DISTRIBUTED_NATIVE unset or 1) since its GPU tests passed with 2 and 4 PEs
(2026-12-07, one H100). =0 asks for the Python process group instead (backend.py, work.py: the
same semantics, about 5 us more host time a call), which is also what a group gets wherever the
native backend cannot be built (said once, with why).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from .. import _C
from ..runtime import settings as _settings
from ..send_recv import send_recv as _send_recv
from . import work as _work

#: Unset or 1: groups made on the backend use the native backend where it builds; 0: the Python group.
NATIVE_VARIABLE = "PYDATACOPY_DISTRIBUTED_NATIVE"

_PACKAGE = Path(_C.__file__).resolve().parent
_SOURCE = _PACKAGE / "torch_backend" / "backend.cpp"
_INCLUDE = _PACKAGE / "include"
_HEADER = _INCLUDE / "pydatacopy" / "torch_backend_api.h"

#: The longest a process waits for another's build of the backend (about 20 s with g++).
BUILD_LOCK_WAIT_S = 300.0

_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None  # why it could not be built (said once, kept for doctor)


def requested(environ=os.environ) -> bool:
    """Whether groups made now use the native backend (PYDATACOPY_DISTRIBUTED_NATIVE unset or 1;
    0: the Python group)."""
    text = environ.get(NATIVE_VARIABLE, "")
    if text in ("", "1"):
        return True
    if text == "0":
        return False
    # Not the core's parse_switch: that one reads unset as off, and here unset is on.
    raise _settings.SettingError(f"{NATIVE_VARIABLE}={text!r} must be 1 or unset (the native backend, the "
                                 f"default) or 0 (the Python process group)")


@contextlib.contextmanager
def requested_as(native: bool):
    """Groups made inside use the native backend (True) or the Python group (False) - the bench
    and the GPU tests make one of each."""
    before = os.environ.get(NATIVE_VARIABLE)
    os.environ[NATIVE_VARIABLE] = "1" if native else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[NATIVE_VARIABLE]
        else:
            os.environ[NATIVE_VARIABLE] = before


def _name() -> str:
    """The extension's name: one per source, torch and Python build (torch's ABI changes with each)."""
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in sorted(_SOURCE.parent.iterdir()) if path.is_file()]
    for part in (*sources, _HEADER.read_bytes(), torch.__version__.encode(),
                 str(torch.version.git_version).encode(), sys.version.encode(), _C.__version__.encode(),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()):
        key.update(part)
    return f"pydatacopy_torch_backend_{key.hexdigest()[:16]}"


def cache_dir() -> Path:
    """Where the backend is built: under torch's extensions directory (TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions), one folder per build."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    return Path(root) / "pydatacopy" / _name()


@contextlib.contextmanager
def _build_lock(where: Path):
    """One builder at a time across processes (the ranks of a job start together). An fcntl lock
    goes with its process; torch < 2.14's own (a lock file that blocks while it exists) stays
    behind a builder that was killed, and would block every later start: a lock file found while
    this lock is held is such a leftover, and is removed. Waited for at most BUILD_LOCK_WAIT_S:
    a builder that hangs (a stalled filesystem) makes this process's groups Python ones, said."""
    path = where / "pydatacopy.lock"
    with open(path, "w") as handle:
        deadline = time.monotonic() + BUILD_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {path} (building the native backend) for more "
                                       f"than {BUILD_LOCK_WAIT_S:g} s; if no build runs, remove that file") from None
                time.sleep(0.05)
        try:
            (where / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path():
    """ninja from the environment's scripts folder, where pip put it, when it is not on PATH."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is not None or not scripts:
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = scripts + (os.pathsep + before if before else "")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def _build() -> ModuleType:
    # torch.utils.cpp_extension warns at import when it finds no CUDA runtime: none is needed here.
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        quiet.setLevel(level)

    name, where = _name(), cache_dir()
    built, failed, library = where / _BUILT, where / _FAILED, where / f"{name}.so"
    if _marked_built(built, library):
        # Finished (the mark names the very file the build left): imported without the lock or a
        # write, so that a build made ahead in a read-only place (an image) serves.
        return _import(name, where)
    where.mkdir(parents=True, exist_ok=True)
    with _build_lock(where), _ninja_on_path():
        if _marked_built(built, library):  # built by another process meanwhile
            return _import(name, where)
        _refuse_if_failed_lately(failed)
        # A build may rewrite the library in place: no mark may vouch for it meanwhile.
        built.unlink(missing_ok=True)
        if not any(where.glob(f"{name}*.so")):
            print(f"pydatacopy.distributed: building the torch.distributed backend against torch "
                  f"{torch.__version__} (once; about 20 s) in {where}", file=sys.stderr, flush=True)
        try:
            module = cpp_extension.load(name, [str(_SOURCE)], extra_include_paths=[str(_INCLUDE)],
                                        extra_cflags=["-O2"], build_directory=str(where), with_cuda=False,
                                        verbose=False)
        except Exception as error:
            # Said to the processes waiting for this lock (the other ranks of the node), which then
            # fall back at once instead of each failing the same build in turn.
            with contextlib.suppress(OSError):
                failed.write_text(f"{type(error).__name__}: {str(error).strip()[-2000:]}")
            raise
        with contextlib.suppress(OSError):  # the marks only spare later processes the lock
            failed.unlink(missing_ok=True)
            staged = where / f"{_BUILT}.{os.getpid()}"
            staged.write_text(_identity(library))
            os.replace(staged, built)  # whole or absent, never half written
        return module


#: Marks in the build folder: a finished build (naming its library file), and a build that failed
#: while this process waited.
_BUILT, _FAILED = "pydatacopy.built", "pydatacopy.failed"
#: When this process began: a failure marked before it is another job's, tried again here.
_STARTED = time.time()


def _identity(library: Path) -> str:
    """The library file as the mark names it: inode, size and modification time."""
    facts = library.stat()
    return f"{facts.st_ino} {facts.st_size} {facts.st_mtime_ns}"


def _marked_built(built: Path, library: Path) -> bool:
    """Whether `library` is the very file a finished build marked (not one rewritten since, or
    left half-linked by a build that was killed)."""
    try:
        return built.read_text() == _identity(library)
    except OSError:
        return False


def _import(name: str, where: Path) -> ModuleType:
    """The finished build in `where`, imported as torch's cpp_extension.load would."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, where / f"{name}.so")
    if spec is None or spec.loader is None:
        raise ImportError(f"no native backend at {where / f'{name}.so'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refuse_if_failed_lately(failed: Path) -> None:
    """A build of this version that failed since this process began (in another process of this
    job, which held the lock while this one waited) is not tried again; one from before (another
    job's: a compiler installed since, a transient failure) is."""
    try:
        marked = failed.stat().st_mtime
        text = failed.read_text()
    except OSError:
        return
    if marked >= _STARTED:
        raise RuntimeError(f"its build failed in another process while this one waited ({failed}): {text}")


def load() -> ModuleType | None:
    """The native backend module, built on first use; None where it cannot be built (the reason
    is warned once and kept in failure()) or not requested (PYDATACOPY_DISTRIBUTED_NATIVE)."""
    global _module, _failure
    if not requested():
        return None
    with _lock:
        if _module is None and _failure is None:
            try:
                module = _build()
                module.init(_C.Error, _C.TimeoutError, dict(_work.MESSAGES), _C.MAX_GROUP_OPS,
                            _C.torch_backend_api())
                atexit.register(module.Queue.discard)  # the main thread's queue, before Python goes
                _send_recv.group_hooks.append(module.Queue.set_group_open)
                _module = module
            except Exception as error:  # noqa: BLE001 - any build failure falls back, said once
                _failure = f"{type(error).__name__}: {str(error).strip()[-2000:]}"
                warnings.warn("pydatacopy.distributed: the native torch.distributed backend could not be "
                              "built, so its groups are Python process groups (about 5 us more host time a "
                              "call; a C++ compiler, ninja, Python's headers and a writable cache_dir() "
                              f"build it): {_failure}", stacklevel=3)
    return _module


def failure() -> str | None:
    """Why the native backend could not be built (None: it was, or it was not tried yet)."""
    return _failure
