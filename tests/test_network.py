"""The remote-transport preflight and the doctor's report on it, without GPU or NVSHMEM: a fake
/sys/class/infiniband under tmp_path and a fake dlopen stand in for the machine.

What each refusal stands for was seen on the 2-GPU H200 machine (no NIC, no GDRCopy): with
NVSHMEM_DISABLE_P2P=1, ibrc prints "Unable to initialize any transports" and UCX aborts on its
first atomic ("AMO not supported ... (GDRCopy Disabled)"); either way NVSHMEM ends the process.
"""

from __future__ import annotations

import os

import pytest

import pydatacopy
from pydatacopy.runtime import network as _network

ALL_LIBRARIES = {_network.UCX_LIBRARY, _network.LIBFABRIC_LIBRARY, _network.GDRCOPY_LIBRARY}


def loader(*present: str):
    """A dlopen that finds only `present` (and records what was asked)."""
    def load(name: str):
        load.asked.append(name)
        if name not in present:
            raise OSError(f"{name}: cannot open shared object file")
        return object()
    load.asked = []
    return load


def sysfs(tmp_path, *ports: tuple[str, int, str, str]):
    """A /sys/class/infiniband with (device, port, state, link layer) ports."""
    root = tmp_path / "infiniband"
    root.mkdir()
    for device, port, state, link_layer in ports:
        directory = root / device / "ports" / str(port)
        directory.mkdir(parents=True)
        (directory / "state").write_text(f"{ {'ACTIVE': 4, 'DOWN': 1}[state]}: {state}\n")
        (directory / "link_layer").write_text(link_layer + "\n")
    return str(root)


@pytest.fixture
def machine(tmp_path):
    """Keyword arguments for a machine with no NIC, no library and no /dev/gdrdrv; a test
    overrides what it gives that machine."""
    def make(*ports, libraries=(), gdrdrv=False):
        device = tmp_path / "gdrdrv"
        if gdrdrv:
            device.write_text("")
        return {"sysfs_root": sysfs(tmp_path, *ports), "load": loader(*libraries),
                "gdrdrv_path": str(device)}
    return make


P2P_OFF = {"NVSHMEM_DISABLE_P2P": "1"}
IB_ACTIVE = ("mlx5_0", 1, "ACTIVE", "InfiniBand")


def refusal(world_size, environ, kwargs) -> str:
    with pytest.raises(pydatacopy.Error) as info:
        _network.check_transport_preconditions(world_size, environ, **kwargs)
    return str(info.value)


# ---- sysfs --------------------------------------------------------------------------------------

def test_rdma_ports_read_state_and_link_layer(tmp_path):
    root = sysfs(tmp_path, ("mlx5_1", 2, "DOWN", "Ethernet"), ("mlx5_1", 1, "ACTIVE", "Ethernet"),
                 IB_ACTIVE)
    ports = _network.rdma_ports(root)
    assert ports == [("mlx5_0", "1", "ACTIVE", "InfiniBand"), ("mlx5_1", "1", "ACTIVE", "Ethernet"),
                     ("mlx5_1", "2", "DOWN", "Ethernet")]
    assert [p.kind for p in ports] == ["InfiniBand", "RoCE", "RoCE"]
    assert [p.active for p in ports] == [True, True, False]
    assert _network.rdma_ports(str(tmp_path / "absent")) == []


# ---- the preflight: cases that must go through --------------------------------------------------

@pytest.mark.parametrize("world_size, environ", [
    (2, {}),                                              # one node, P2P on
    (8, {"LOCAL_WORLD_SIZE": "8"}),                       # torchrun, one node
    (1, {**P2P_OFF, "LOCAL_WORLD_SIZE": "1"}),            # nobody to reach
    (2, {"NVSHMEM_DISABLE_P2P": "0"}),                    # NVSHMEM reads 0 as off
    (2, {"NVSHMEM_DISABLE_P2P": "false"}),
    (2, {"NVSHMEM_REMOTE_TRANSPORT": "none"}),            # one node: P2P is enough
    (8, {"LOCAL_WORLD_SIZE": "x", "NVSHMEM_IB_ENABLE_IBGDA": "1"}),  # not torchrun's: one node
])
def test_no_remote_peer_needs_no_remote_transport(machine, world_size, environ):
    kwargs = machine()
    _network.check_transport_preconditions(world_size, environ, **kwargs)
    assert kwargs["load"].asked == [], "the check must cost nothing when no peer is remote"


@pytest.mark.parametrize("environ", [P2P_OFF, {"LOCAL_WORLD_SIZE": "4"},
                                     {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "IBDEVX"},
                                     {"LOCAL_WORLD_SIZE": "4", "NVSHMEM_IB_ENABLE_IBGDA": "1"},
                                     {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "ucx"}])
def test_an_active_nic_carries_ib_and_ucx(machine, environ):
    _network.check_transport_preconditions(8, environ, **machine(IB_ACTIVE, libraries=ALL_LIBRARIES))


def test_roce_counts_as_a_nic(machine):
    kwargs = machine(("mlx5_0", 1, "ACTIVE", "Ethernet"), libraries=[_network.UCX_LIBRARY])
    _network.check_transport_preconditions(2, {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "ucx"}, **kwargs)
    assert _network.GDRCOPY_LIBRARY not in kwargs["load"].asked, "NIC atomics need no GDRCopy"


def test_ucx_without_nic_goes_through_with_gdrcopy(machine):
    kwargs = machine(libraries=[_network.UCX_LIBRARY, _network.GDRCOPY_LIBRARY], gdrdrv=True)
    _network.check_transport_preconditions(2, {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "Ucx"}, **kwargs)


def test_libfabric_goes_through_when_it_loads(machine):
    _network.check_transport_preconditions(
        2, {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "libfabric"},
        **machine(libraries=[_network.LIBFABRIC_LIBRARY]))


# ---- the preflight: refusals --------------------------------------------------------------------

def test_p2p_off_with_default_ibrc_and_no_nic(machine):
    message = refusal(2, P2P_OFF, machine())
    assert message.startswith("pydatacopy.init: NVSHMEM_DISABLE_P2P=1 leaves NVSHMEM no way to "
                              "reach the other PEs here: ibrc (NVSHMEM's default")
    for words in ("needs an ACTIVE InfiniBand/RoCE port", "there is no InfiniBand/RoCE device in",
                  "NVSHMEM would end the process", "Unset NVSHMEM_DISABLE_P2P",
                  "set PYDATACOPY_FORCE_RMA=1", "ibstat shows State: Active"):
        assert words in message, message


def test_a_nic_whose_ports_are_down_is_no_nic(machine):
    message = refusal(2, P2P_OFF, machine(("mlx5_0", 1, "DOWN", "InfiniBand")))
    assert "no port of mlx5_0 is ACTIVE" in message, message


def test_job_across_nodes_without_nic(machine):
    message = refusal(8, {"LOCAL_WORLD_SIZE": "4"}, machine(libraries=ALL_LIBRARIES, gdrdrv=True))
    assert message.startswith("pydatacopy.init: the job spans nodes (LOCAL_WORLD_SIZE=4 of 8 "
                              "PEs), and PEs on other nodes would be unreachable: ibrc"), message
    assert "NVSHMEM would end the process" in message and "ibstat" in message
    assert "NVSHMEM_DISABLE_P2P" not in message, "P2P is not what is wrong here"


def test_ibdevx_needs_a_nic_too(machine):
    message = refusal(8, {"LOCAL_WORLD_SIZE": "4", "NVSHMEM_REMOTE_TRANSPORT": "ibdevx"},
                      machine())
    assert "NVSHMEM_REMOTE_TRANSPORT=ibdevx needs an ACTIVE InfiniBand/RoCE port" in message


def test_ibgda_needs_a_nic_whatever_the_transport(machine):
    kwargs = machine(libraries=ALL_LIBRARIES, gdrdrv=True)  # UCX alone would do
    for environ in ({"NVSHMEM_IB_ENABLE_IBGDA": "1"}, {"PYDATACOPY_IBGDA": "1"}):
        message = refusal(2, {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "ucx", **environ}, kwargs)
        assert "with IBGDA" in message and "needs an ACTIVE InfiniBand/RoCE port" in message
        assert "unset NVSHMEM_IB_ENABLE_IBGDA and PYDATACOPY_IBGDA" in message, message


def test_ucx_that_does_not_load(machine):
    message = refusal(2, {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "ucx"},
                      machine(IB_ACTIVE, libraries=[_network.GDRCOPY_LIBRARY], gdrdrv=True))
    for words in ("NVSHMEM_REMOTE_TRANSPORT=ucx: NVSHMEM's UCX plugin needs libucp.so.0",
                  "pip install libucx-cu13", "LD_LIBRARY_PATH before Python starts",
                  "import libucx, os; print(os.path.join(os.path.dirname(libucx.__file__), 'lib'))"):
        assert words in message, message


@pytest.mark.parametrize("libraries, gdrdrv, environ, reason", [
    ([], False, {}, "libgdrapi.so.2 does not load; no {gdrdrv}, the gdrdrv kernel module is not loaded"),
    ([_network.GDRCOPY_LIBRARY], False, {}, "(no {gdrdrv}, the gdrdrv kernel module is not loaded)"),
    ([], True, {}, "(libgdrapi.so.2 does not load)"),
    ([_network.GDRCOPY_LIBRARY], True, {"NVSHMEM_DISABLE_GDRCOPY": "1"},
     "(NVSHMEM_DISABLE_GDRCOPY=1 turns it off)"),
])
def test_ucx_without_nic_needs_gdrcopy(machine, libraries, gdrdrv, environ, reason):
    kwargs = machine(libraries=[_network.UCX_LIBRARY, *libraries], gdrdrv=gdrdrv)
    message = refusal(2, {**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "ucx", **environ}, kwargs)
    for words in ("does its atomics with the NIC or with GDRCopy",
                  "no ACTIVE InfiniBand/RoCE port and GDRCopy is unusable",
                  reason.format(gdrdrv=kwargs["gdrdrv_path"]),
                  "AMO not supported with the current configuration (GDRCopy Disabled)",
                  "install GDRCopy (libgdrapi.so.2) and load its gdrdrv kernel module",
                  "Unset NVSHMEM_DISABLE_P2P"):
        assert words in message, message


def test_libfabric_that_does_not_load(machine):
    message = refusal(8, {"LOCAL_WORLD_SIZE": "4", "NVSHMEM_REMOTE_TRANSPORT": "libfabric"},
                      machine(IB_ACTIVE))
    assert "NVSHMEM_REMOTE_TRANSPORT=libfabric needs libfabric.so.1, which does not load" in message
    assert "LD_LIBRARY_PATH" in message


@pytest.mark.parametrize("value, words", [
    ("none", "NVSHMEM_REMOTE_TRANSPORT=none turns NVSHMEM's remote transports off"),
    ("tcp", "NVSHMEM_REMOTE_TRANSPORT=tcp names no transport NVSHMEM has"),
    ("ibgda", "IBGDA is NVSHMEM_IB_ENABLE_IBGDA=1 (or PYDATACOPY_IBGDA=1)"),
])
def test_no_remote_transport_at_all(machine, value, words):
    message = refusal(8, {"LOCAL_WORLD_SIZE": "4", "NVSHMEM_REMOTE_TRANSPORT": value},
                      machine(IB_ACTIVE, libraries=ALL_LIBRARIES, gdrdrv=True))
    assert words in message and "unset NVSHMEM_REMOTE_TRANSPORT" in message, message


def test_the_call_is_named(machine):
    with pytest.raises(pydatacopy.Error, match=r"^python -m pydatacopy\.doctor: "):
        _network.check_transport_preconditions(2, P2P_OFF, call="python -m pydatacopy.doctor",
                                               **machine())


# ---- the doctor's report ------------------------------------------------------------------------

def verdict_line(lines) -> tuple[str, str]:
    [line] = [line for line in lines if line[1].startswith("remote transport: ")]
    return line


def test_report_on_a_machine_with_nothing(machine):
    lines = _network.remote_transport_report({}, **machine())
    texts = "\n".join(text for _, text in lines)
    assert {verdict for verdict, _ in lines} == {"INFO"}, "one node needs no NIC: nothing to fail"
    for words in ("RDMA devices: none in", "IBGDA (GPU-initiated InfiniBand): off",
                  "libucp.so.0 does not load", "libfabric.so.1 does not load",
                  "GDRCopy: not usable (libgdrapi.so.2 does not load; no "):
        assert words in texts, texts
    verdict, text = verdict_line(lines)
    assert text.startswith("remote transport: ibrc (NVSHMEM's default, NVSHMEM_REMOTE_TRANSPORT "
                           "unset) needs an ACTIVE InfiniBand/RoCE port"), text
    assert "PEs on other servers would be unreachable from this node" in text
    assert "PEs on this node use NVLink/PCIe P2P" in text


def test_report_on_a_machine_with_a_nic(machine):
    kwargs = machine(IB_ACTIVE, ("mlx5_1", 1, "DOWN", "Ethernet"), libraries=ALL_LIBRARIES, gdrdrv=True)
    lines = _network.remote_transport_report({"NVSHMEM_IB_ENABLE_IBGDA": "1"}, **kwargs)
    assert ("OK", "RDMA device mlx5_0: port 1 ACTIVE (InfiniBand)") in lines
    assert ("INFO", "RDMA device mlx5_1: port 1 DOWN (RoCE)") in lines
    assert ("OK", "libucp.so.0 loads (needed by NVSHMEM_REMOTE_TRANSPORT=ucx)") in lines
    assert ("OK", f"GDRCopy: usable (libgdrapi.so.2 loads, {kwargs['gdrdrv_path']} present)") in lines
    assert verdict_line(lines) == (
        "OK", "remote transport: ibrc (NVSHMEM's default, NVSHMEM_REMOTE_TRANSPORT unset), with "
              "IBGDA: can reach PEs on other servers over mlx5_0 (InfiniBand); PEs on this node "
              "use NVLink/PCIe P2P")


def test_report_warns_about_a_chosen_transport_that_cannot_work(machine):
    lines = _network.remote_transport_report({**P2P_OFF, "NVSHMEM_REMOTE_TRANSPORT": "ucx"},
                                             **machine(libraries=[_network.UCX_LIBRARY]))
    verdict, text = verdict_line(lines)
    assert verdict == "WARN", text
    for words in ("remote transport: NVSHMEM_REMOTE_TRANSPORT=ucx does its atomics with the NIC "
                  "or with GDRCopy", "so PEs on other servers would be unreachable",
                  "NVSHMEM_DISABLE_P2P is on, so PEs on this node go through it too",
                  "load its gdrdrv kernel module"):
        assert words in text, text


def test_report_with_ucx_over_gdrcopy(machine):
    lines = _network.remote_transport_report(
        {"NVSHMEM_REMOTE_TRANSPORT": "ucx"},
        **machine(libraries=[_network.UCX_LIBRARY, _network.GDRCOPY_LIBRARY], gdrdrv=True))
    assert verdict_line(lines) == ("OK", "remote transport: NVSHMEM_REMOTE_TRANSPORT=ucx: can "
                                         "reach PEs on other servers through UCX, with GDRCopy "
                                         "for its atomics; PEs on this node use NVLink/PCIe P2P")


# ---- spanning nodes, as pydatacopy.init sees it (no LOCAL_WORLD_SIZE: SLURM, mpirun, ...) --------

def test_ranks_on_two_hosts_need_a_remote_transport(machine):
    kwargs = machine()
    text = refusal(4, {}, {**kwargs, "nodes": 2})
    assert "its 4 PEs run on 2 hosts" in text and "NVSHMEM would end the process" in text


def test_ranks_on_two_hosts_go_through_an_active_nic(machine):
    _network.check_transport_preconditions(4, {}, nodes=2, **machine(IB_ACTIVE, libraries=ALL_LIBRARIES))


def test_ranks_on_one_host_need_none(machine):
    kwargs = machine()
    _network.check_transport_preconditions(4, {}, nodes=1, **kwargs)
    # Two torchrun "nodes" on one machine: the hosts init() saw overrule LOCAL_WORLD_SIZE.
    _network.check_transport_preconditions(4, {"LOCAL_WORLD_SIZE": "2"}, nodes=1, **kwargs)
    assert kwargs["load"].asked == []


def test_host_identity_is_the_hostname_with_the_boot_id(tmp_path):
    import socket

    boot_id = tmp_path / "boot_id"
    boot_id.write_text("0f3c-node-a\n")
    assert _network.host_identity(str(boot_id)) == f"{socket.gethostname()}/0f3c-node-a"
    assert _network.host_identity(str(tmp_path / "absent")) == f"{socket.gethostname()}/"


def test_nccl_settings_carry_over_to_nvshmem_when_unset():
    environ = {"NCCL_SOCKET_IFNAME": "eth1", "NCCL_IB_HCA": "mlx5_0,mlx5_1",
               "NVSHMEM_HCA_LIST": "mlx5_3", "PYDATACOPY_IBGDA": "1"}
    applied = _network.apply_network_settings(environ)
    assert environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "eth1"
    assert environ["NVSHMEM_HCA_LIST"] == "mlx5_3", "a user's NVSHMEM setting wins"
    assert environ["NVSHMEM_IB_ENABLE_IBGDA"] == "1"
    assert applied == {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth1", "NVSHMEM_IB_ENABLE_IBGDA": "1"}


def test_unique_id_is_made_after_the_interface_settings(monkeypatch):
    # The ID carries rank 0's bootstrap address: NCCL_SOCKET_IFNAME must reach NVSHMEM first.
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "unset-below")  # restored after the test
    monkeypatch.delenv("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME")
    assert len(pydatacopy.get_unique_id()) == 128
    assert os.environ["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo"


def test_p2p_disabled_without_a_remote_transport_is_refused(tmp_path):
    # (tests/test_network.py covers each transport; tmp_path stands for a machine with no NIC.)
    with pytest.raises(pydatacopy.Error, match="PYDATACOPY_FORCE_RMA"):
        _network.check_transport_preconditions(2, {"NVSHMEM_DISABLE_P2P": "1"}, sysfs_root=str(tmp_path))
    _network.check_transport_preconditions(1, {"NVSHMEM_DISABLE_P2P": "1"}, sysfs_root=str(tmp_path))
