"""Bootstrap across a real network hop: python tests/stress/netns_check.py [--timeout 60]

Needs root (network namespaces) and a GPU (two PEs share it with PYDATACOPY_RANKS_PER_GPU=2,
under CUDA MPS: scripts/gpu-check.sh); needs no `ip` tool (the GPU machine has none): the
veth pair is made over rtnetlink from Python. Rank 0 stays in this namespace on `pdc0`
(10.231.0.1), rank 1 runs in a fresh namespace (`unshare -n`, entered with `nsenter`) on `pdc1`
(10.231.0.2), so every byte of torch.distributed's rendezvous and of NVSHMEM's unique-ID
bootstrap crosses the veth link. Each rank names its interface only through NCCL_SOCKET_IFNAME
and GLOO_SOCKET_IFNAME; pydatacopy must carry it to NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME before
rank 0 makes the ID. After init both ranks exchange 64 MiB + 3 both ways and check it.

Scenarios: the default NVSHMEM set-up, then NVSHMEM_DISABLE_CUDA_VMM=1 (legacy CUDA IPC instead
of file-descriptor passing, which may not cross namespaces), then NVSHMEM_DISABLE_P2P=1 (a
remote transport only: pydatacopy must refuse it with a clear error, as the machine has none).
Prints one line per scenario: PASS, FAIL, or UNAVAILABLE (with the reason) when the machine
cannot make the namespaces.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import time

# rtnetlink constants (linux/netlink.h, linux/rtnetlink.h, linux/if_link.h, linux/veth.h)
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLMSG_ERROR, RTM_NEWLINK, RTM_NEWADDR = 2, 16, 20
IFLA_IFNAME, IFLA_LINKINFO, IFLA_NET_NS_PID = 3, 18, 19
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
IFF_UP = 0x1


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, flags, change)


def _request(kind: int, flags: int, body: bytes) -> None:
    """Send one rtnetlink request and raise OSError with the kernel's answer if it fails."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.bind((0, 0))
        sock.send(struct.pack("=IHHII", 16 + len(body), kind, NLM_F_REQUEST | NLM_F_ACK | flags, 1, 0) + body)
        reply = sock.recv(65536)
        _, reply_kind = struct.unpack_from("=IH", reply)
        if reply_kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", reply, 16)
            if code != 0:
                raise OSError(-code, f"rtnetlink request {kind}: {os.strerror(-code)}")


def make_veth(name: str, peer_name: str, peer_pid: int) -> None:
    """A veth pair `name` <-> `peer_name`, the peer end inside the network namespace of peer_pid."""
    peer = _ifinfo() + _attr(IFLA_IFNAME, peer_name.encode() + b"\0") + \
        _attr(IFLA_NET_NS_PID, struct.pack("=I", peer_pid))
    info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer))
    _request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL,
             _ifinfo() + _attr(IFLA_IFNAME, name.encode() + b"\0") + _attr(IFLA_LINKINFO, info))


def configure(name: str, address: str | None, prefix: int = 24) -> None:
    """Give interface `name` (of the current namespace) an IPv4 address and bring it up."""
    index = socket.if_nametoindex(name)
    if address is not None:
        packed = socket.inet_aton(address)
        _request(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL,
                 struct.pack("=BBBBI", socket.AF_INET, prefix, 0, 0, index) +
                 _attr(IFA_LOCAL, packed) + _attr(IFA_ADDRESS, packed))
    _request(RTM_NEWLINK, 0, _ifinfo(index, IFF_UP, IFF_UP))


WORKER = r"""
import os, sys, time, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=os.environ["INIT_METHOD"], rank=rank, world_size=2)
print(f"rank {rank}: torch.distributed up over {os.environ['GLOO_SOCKET_IFNAME']}", flush=True)
if os.environ.get("NETNS_DRY") == "1":  # no GPU: check the rendezvous and the ID's travel only
    import pydatacopy
    uid = pydatacopy.share_unique_id()
    print(f"rank {rank}: ID shared, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="
          f"{os.environ.get('NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME')}", flush=True)
    print("RESULT ok", flush=True)
    sys.exit(0)
import pydatacopy
torch.cuda.set_device(rank // int(os.environ.get("PYDATACOPY_RANKS_PER_GPU") or 1))  # the device rule
begin = time.time()
try:
    pydatacopy.init(timeout=float(os.environ["NETNS_TIMEOUT"]))
except pydatacopy.Error as error:
    print(f"RESULT refused {type(error).__name__}: {error}", flush=True)
    os._exit(0)
print(f"rank {rank}: NVSHMEM up in {time.time() - begin:.1f} s through "
      f"{os.environ.get('NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME')}; peer reachable by load/store: "
      f"{pydatacopy.peer_view(pydatacopy.empty(1), 1 - rank) is not None}", flush=True)
nbytes = (64 << 20) + 3
g = torch.Generator(device="cuda"); g.manual_seed(7 + rank)
outgoing = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
incoming = torch.empty_like(outgoing)
pydatacopy.sendrecv(outgoing, 1 - rank, incoming, 1 - rank)
torch.cuda.synchronize(); pydatacopy.check_errors()
g.manual_seed(7 + 1 - rank)
expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
print(f"RESULT {'ok' if torch.equal(incoming, expected) else 'MISMATCH'}", flush=True)
pydatacopy.finalize()
os._exit(0)
"""


def run_scenario(holder_pid: int, extra_env: dict[str, str], timeout: float, port: int,
                 dry: bool) -> tuple[str, str]:
    base = dict(os.environ, INIT_METHOD=f"tcp://10.231.0.1:{port}", WORLD_SIZE="2",
                NETNS_TIMEOUT=str(timeout), PYTHONUNBUFFERED="1", **extra_env)
    for name in ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        base.pop(name, None)
    if dry:
        base["NETNS_DRY"] = "1"
    commands = [[sys.executable, "-c", WORKER],
                ["nsenter", "-t", str(holder_pid), "-n", sys.executable, "-c", WORKER]]
    procs = []
    for rank, (command, ifname) in enumerate(zip(commands, ("pdc0", "pdc1"))):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), NCCL_SOCKET_IFNAME=ifname,
                   GLOO_SOCKET_IFNAME=ifname)
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout + 90)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append((proc.communicate()[0] or "") + "\n[killed: no answer in time]")
    results = [next((l[7:] for l in out.splitlines() if l.startswith("RESULT ")), "no result")
               for out in outputs]
    notes = [l for out in outputs for l in out.splitlines()
             if l.startswith("rank ") or "WARN" in l or "ERROR" in l or "error" in l.lower()]
    verdict = "PASS" if all(r == "ok" for r in results) else "FAIL"
    if "NVSHMEM_DISABLE_P2P" in extra_env:  # pydatacopy must refuse, not let NVSHMEM exit()
        verdict = "PASS" if all(r.startswith("refused") and "PYDATACOPY_FORCE_RMA" in r
                                for r in results) else "FAIL"
    return verdict, " | ".join([f"rank {i}: {r}" for i, r in enumerate(results)] + notes)[:900]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--dry", action="store_true", help="no GPU: rendezvous and ID only")
    args = parser.parse_args()
    holder = None
    try:
        holder = subprocess.Popen(["unshare", "-n", "sleep", "900"])
        time.sleep(0.5)
        if holder.poll() is not None:
            raise OSError(f"unshare -n exited with {holder.returncode}")
        make_veth("pdc0", "pdc1", holder.pid)
        configure("pdc0", "10.231.0.1")
        subprocess.run(["nsenter", "-t", str(holder.pid), "-n", sys.executable, __file__,
                        "--configure-peer"], check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"netns-check: veth between namespaces  UNAVAILABLE  {type(error).__name__}: {error}")
        if holder is not None:
            holder.kill()
        return 0
    scenarios = [("default NVSHMEM", {}), ("NVSHMEM_DISABLE_CUDA_VMM=1", {"NVSHMEM_DISABLE_CUDA_VMM": "1"}),
                 ("NVSHMEM_DISABLE_P2P=1", {"NVSHMEM_DISABLE_P2P": "1"})]
    if args.dry:
        scenarios = scenarios[:1]
    failed = 0
    try:
        for number, (name, extra) in enumerate(scenarios):
            verdict, detail = run_scenario(holder.pid, extra, args.timeout, 29500 + number, args.dry)
            failed += verdict == "FAIL"
            print(f"netns-check: {name:<28} {verdict}  {detail}", flush=True)
    finally:
        holder.kill()  # its namespace, and pdc1 with it, goes; pdc0 goes with its peer
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--configure-peer"]:
        configure("lo", None)
        configure("pdc1", "10.231.0.2")
        sys.exit(0)
    sys.exit(main())
