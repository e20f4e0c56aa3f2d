"""One simulated node on a Linux TAP interface: what ``fpgaccl node --tap IF --ip ADDR``
runs.

The node is :class:`fpgaccl.hw.eth_node.EthNode` (ARP, ICMP echo and the control port in
front of the whole engine) with a small memory, built in Verilator
(:func:`build_node`, cached). Frames cross at the MAC's beat side: the bridge
(:class:`fpgaccl.sim.servers.tap_node.TapNodeServer`) writes each frame the kernel sends
on the TAP into the node's ``rx`` (padded to the 60-byte minimum a MAC would deliver)
and each frame from ``tx`` back to the TAP; preamble and FCS are the MAC's job, tested
on its own (``tests/hw/test_eth_mac*``), not here.

The simulator opens the TAP (non-persistent: it disappears with the process); the
parent (:func:`run_node`) then moves it into the network namespace, gives the kernel's
side an address in the node's /24 and brings it up. IPv6 stays off on it: its
multicast chatter would count as frames not for us.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from amaranth.hdl import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.errors import BackendUnavailableError, ToolchainError
from fpgaccl.hw.eth_node import EthNode
from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.hw.stream.fifo import BeatFIFO
from fpgaccl.proto.reduce import DType, ReduceOp

from .bridge import TapMirror
from .hdl.memory import SimMemory
from .servers.child import SocketServerProcess

SERVER_MODULE = "fpgaccl.sim.servers.entry"
WIDTH = 64
MEM_LOG2 = 16
"""The node's memory: 64 KiB, all the control port can reach (beyond: OUT_OF_RANGE)."""
NODE = {"qps": 4, "regions": 2, "imem_words": 64, "mtu": 1024,
        "dtypes": (DType.INT32, DType.FLOAT32), "ops": (ReduceOp.SUM,)}
"""A small whole engine: peers for a world of 4 (a QP per rank), the library programs of
such a world (40 words at most), int32 and float32 sums; every dtype/op more is minutes
more of Verilator build on a small machine. MTU 1024: a RoCE packet then fits a standard
1500-byte Ethernet link (the TAP's, a board's)."""
DEFAULT_MAC = "02:fc:cc:00:00:01"


def mac_int(mac: str) -> int:
    return int(mac.replace(":", "").replace("-", ""), 16)


def mac_str(mac: int) -> str:
    return ":".join(f"{b:02x}" for b in mac.to_bytes(6, "big"))


def kernel_address(node_ip: str) -> str:
    """The kernel side's address: the node's /24, host 1 (host 2 if the node is 1)."""
    ip = ipaddress.IPv4Address(node_ip)
    net = ipaddress.IPv4Network(f"{ip}/24", strict=False)
    host = 2 if int(ip) - int(net.network_address) == 1 else 1
    return str(net.network_address + host)


class Tap(TapMirror):
    """The node's TAP: read as well as written, and waited on by the server loop."""

    def fileno(self) -> int:
        return self.fd

    def read(self, limit: int = 64) -> list[bytes]:
        frames = []
        while len(frames) < limit:
            try:
                frames.append(os.read(self.fd, 65536))
            except (BlockingIOError, InterruptedError):
                break
        return frames


class EthNodeTop(wiring.Component):
    """The Verilator top: an :class:`EthNode`, its memory and a FIFO on each frame
    stream, so the ports' ``valid``/``ready`` never depend on each other (what
    :class:`fpgaccl.sim.tb.cluster_tb.ExternalPort`, which drives them, assumes; the
    ports carry its names)."""

    def __init__(self, width: int = WIDTH) -> None:
        self.width = width
        super().__init__({
            "xrx0": In(beat_stream(width)),
            "xtx0": Out(beat_stream(width)),
            "mac": In(48),
            "ip": In(32),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        m.submodules.node = node = EthNode(w, mem_log2=MEM_LOG2, **NODE)
        m.submodules.mem = mem = SimMemory(w, 1 << MEM_LOG2)
        m.submodules.rxq = rxq = BeatFIFO(w, 16)
        m.submodules.txq = txq = BeatFIFO(w, 16)
        wiring.connect(m, wiring.flipped(self.xrx0), rxq.i)
        wiring.connect(m, rxq.o, node.rx)
        wiring.connect(m, node.tx, txq.i)
        wiring.connect(m, txq.o, wiring.flipped(self.xtx0))
        wiring.connect(m, node.rd_req, mem.rd_req)
        wiring.connect(m, mem.rd_resp, node.rd_resp)
        wiring.connect(m, node.wr, mem.wr)
        m.d.comb += [node.mac.eq(self.mac), node.ip.eq(self.ip), mem.bd_we.eq(0)]
        return m


def build_node():
    """The top's Verilator build (cached by content; minutes the first time)."""
    from .runner import CLUSTER_CXX_OPT, PORTS_ONLY_ARGS, build
    return build(EthNodeTop(WIDTH), f"eth_node_w{WIDTH}", build_args=PORTS_ONLY_ARGS,
                 cxx_opt=CLUSTER_CXX_OPT)


def serve(socket_path: str, *, tap: str, ip: str, mac: str, run_dir: str | None = None,
          idle_timeout_s: float = 1e9) -> dict[str, Any]:
    from .runner import run
    sim = build_node()
    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="fpgaccl-node-"))
    summary = run_dir / "summary.json"
    run(sim, SERVER_MODULE, test_dir=run_dir,
        params={"server": "tap_node", "width": WIDTH, "socket": socket_path, "tap": tap,
                "ip": int(ipaddress.IPv4Address(ip)), "mac": mac_int(mac),
                "summary": str(summary), "idle_timeout_s": idle_timeout_s})
    return json.loads(summary.read_text())


class NodeProcess(SocketServerProcess):
    kind = "simulated node"

    def __init__(self, *, tap: str, ip: str, mac: str) -> None:
        super().__init__("fpgaccl.sim.tap", ["--tap", tap, "--ip", ip, "--mac", mac],
                         prefix="fpgaccl-node-", socket_name="node.sock")


def _ip(netns: str | None, *args: str) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise BackendUnavailableError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def netns_exists(name: str) -> bool:
    return Path("/var/run/netns", name).exists()


def _no_ipv6(netns: str | None, dev: str) -> None:
    subprocess.run([*(["ip", "netns", "exec", netns] if netns else []), "sysctl", "-qw",
                    f"net.ipv6.conf.{dev}.disable_ipv6=1"], capture_output=True, timeout=30)


def link_exists(netns: str | None, dev: str) -> bool:
    cmd = ["ip", *(["-n", netns] if netns else []), "link", "show", "dev", dev]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


def attach(tap: str, netns: str | None, kernel_ip: str, bridge: str | None = None) -> None:
    """Move the simulator's TAP into ``netns`` and give the kernel's side ``kernel_ip``:
    on the TAP itself, or -- with ``bridge`` -- on that bridge (created if missing), the
    TAP one of its ports."""
    if netns:
        _ip(None, "link", "set", "dev", tap, "netns", netns)
        _ip(netns, "link", "set", "dev", "lo", "up")
    # A moved device starts with the namespace's defaults again.
    _no_ipv6(netns, tap)
    if bridge:
        if not link_exists(netns, bridge):
            _ip(netns, "link", "add", "name", bridge, "type", "bridge")
            _no_ipv6(netns, bridge)
            _ip(netns, "addr", "add", f"{kernel_ip}/24", "dev", bridge)
            _ip(netns, "link", "set", "dev", bridge, "up")
        _ip(netns, "link", "set", "dev", tap, "master", bridge)
    else:
        _ip(netns, "addr", "add", f"{kernel_ip}/24", "dev", tap)
    _ip(netns, "link", "set", "dev", tap, "up")


def node_info(socket_path: str) -> dict[str, Any]:
    from fpgaccl.proto.framing import connect_unix, encode, recv_frame
    with contextlib.closing(connect_unix(socket_path, 30.0, "simulated node")) as s:
        s.sendall(encode({"op": "info"}))
        head, _ = recv_frame(s)
    return head


def run_node(tap: str, ip: str, *, netns: str | None = None, mac: str = DEFAULT_MAC,
             bridge: str | None = None, out=print) -> int:
    """``fpgaccl node``: serve the node on ``tap`` until SIGTERM/SIGINT; remove the TAP
    (it goes with the simulator) and a namespace this call created."""
    if os.geteuid() != 0:
        out("fpgaccl node: a TAP interface and network namespaces need root")
        return 2
    ipaddress.IPv4Address(ip)
    mac_int(mac)
    stop = []

    def on_signal(signum, _frame):
        stop.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    created = False
    proc = None
    try:
        if netns and not netns_exists(netns):
            _ip(None, "netns", "add", netns)
            created = True
        out(f"fpgaccl node: building (cached) and starting the simulated node on {tap}",
            flush=True)
        proc = NodeProcess(tap=tap, ip=ip, mac=mac)
        sock = proc.wait_ready()
        kip = kernel_address(ip)
        attach(tap, netns, kip, bridge)
        info = node_info(sock)
        where = (f" in netns {netns}" if netns else "") + (f" on bridge {bridge}"
                                                             if bridge else "")
        out(f"fpgaccl node: ready: MAC {mac_str(info['mac'])} IP {info['ip']} on {tap}{where} "
            f"(kernel side {kip}/24)", flush=True)
        while not stop and proc.proc.poll() is None:
            time.sleep(0.2)
        if proc.proc.poll() is not None and not stop:
            out(f"fpgaccl node: the simulation ended ({proc.proc.returncode}); log in "
                f"{proc.dir}", flush=True)
            return 1
        return 0
    except BackendUnavailableError as e:
        out(f"fpgaccl node: {e}", flush=True)
        return 1
    finally:
        if proc is not None:
            proc.stop(timeout_s=20)
        if created:
            with contextlib.suppress(BackendUnavailableError):
                _ip(None, "netns", "del", netns)
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fpgaccl.sim.tap", description=__doc__)
    ap.add_argument("--socket", required=True)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--tap", required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--mac", default=DEFAULT_MAC)
    a = ap.parse_args(argv)
    try:
        s = serve(a.socket, tap=a.tap, ip=a.ip, mac=a.mac, run_dir=a.run_dir)
    except (ToolchainError, AssertionError) as e:
        print(f"fpgaccl node: simulation failed: {e}", file=sys.stderr)
        return 1
    print(f"fpgaccl node: {s}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
