"""The probes of this machine (the package's runtime/probes.py): whether an MPS control daemon runs."""

from __future__ import annotations

import os

from pydatacopy.runtime import probes as _probes


def test_mps_control_endpoint_counts_only_a_running_daemon(monkeypatch):
    """CUDA 13's MPS daemon listens on a UNIX socket named 'control' (the old probe looked for
    a named pipe, missed it, and init() warned 'without CUDA MPS' under a running daemon); a file
    left by a daemon that ended is no daemon."""
    import socket
    import tempfile

    directory = tempfile.mkdtemp(prefix="pdc-mps-", dir="/tmp")  # AF_UNIX paths: 107 bytes at most
    control = os.path.join(directory, "control")
    environ = {"CUDA_MPS_PIPE_DIRECTORY": directory}
    try:
        assert _probes.mps_control_pipe(environ) is None
        with open(control, "w"):
            pass  # a plain file is no daemon's
        assert _probes.mps_control_pipe(environ) is None
        os.remove(control)

        daemon = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        daemon.bind(control)
        daemon.listen(4)
        assert _probes.mps_control_pipe(environ) == control  # seen in /proc/net/unix
        # ... and from /proc/net/unix alone: with connect() failing, the table must find it.
        def refuse_connect(self, address):
            raise OSError("connect refused in this test")
        monkeypatch.setattr(socket.socket, "connect", refuse_connect)
        assert _probes.mps_control_pipe(environ) == control
        monkeypatch.undo()
        # Another network namespace lists other sockets: the connect() fallback.
        assert _probes.mps_control_pipe(environ, unix_sockets=os.devnull) == control
        daemon.close()  # the daemon ends; its socket file stays
        assert os.path.exists(control)
        assert _probes.mps_control_pipe(environ) is None
        assert _probes.mps_control_pipe(environ, unix_sockets=os.devnull) is None
        os.remove(control)

        os.mkfifo(control)  # an older daemon's named pipe: counts while an MPS process runs
        monkeypatch.setattr(_probes, "_mps_process_running", lambda: False)
        assert _probes.mps_control_pipe(environ) is None
        monkeypatch.setattr(_probes, "_mps_process_running", lambda: True)
        assert _probes.mps_control_pipe(environ) == control
    finally:
        if os.path.lexists(control):
            os.remove(control)
        os.rmdir(directory)


def test_mps_process_scan_reads_process_names(tmp_path):
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "comm").write_text("python3\n")
    (tmp_path / "self").mkdir()
    assert not _probes._mps_process_running(str(tmp_path))
    (tmp_path / "34").mkdir()
    (tmp_path / "34" / "comm").write_text("nvidia-cuda-mps\n")
    assert _probes._mps_process_running(str(tmp_path))
