"""The bridge between the simulated wire and real UDP sockets, without a simulation:
datagrams from a socket come out as frames the node's parser accepts (IPv4 checksum and
ICRC checked by proto's reference parser) on the sender's switch port; frames a node
sends leave as datagrams from the node's address and source port, with an ICRC the
software engine accepts; every bridged frame lands in a pcap tshark decodes as RoCEv2,
and (as root) on a TAP interface that tshark captures live."""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import time

import pytest

from fpgaccl.host import wire
from fpgaccl.host.tshark import decode
from fpgaccl.proto import build_frame, parse_frame
from fpgaccl.proto.opcodes import ROCEV2_UDP_PORT, Opcode
from fpgaccl.sim.bridge import TapMirror, UdpBridge, ip_int, split
from fpgaccl.sim.hdl.switch import node_mac

SW_IP, NODE_IP = "127.77.0.1", "127.77.0.2"   # rank 0 (software), rank 1 (simulated)


def write_frame(src: str, dst: str, sport: int, psn: int, payload: bytes) -> bytes:
    return build_frame(
        eth={"dst": node_mac(0), "src": node_mac(1)},
        ip={"src": ip_int(src), "dst": ip_int(dst)}, udp={"sport": sport},
        bth={"opcode": Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, "dqpn": 0x100, "psn": psn,
             "ackreq": 1},
        reth={"va": 0x1000, "rkey": 0x1001, "dlen": len(payload)}, immdt={"imm": 7},
        payload=payload)


@pytest.fixture
def bridge(tmp_path):
    b = UdpBridge(pcap=tmp_path / "bridge.pcap")
    b.host(1, NODE_IP)
    b.route(0, SW_IP)
    yield b
    b.close()


@pytest.fixture
def rank0():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, 10, 2)  # DF, as the software engine sends
    s.bind((SW_IP, ROCEV2_UDP_PORT))
    s.settimeout(5)
    yield s
    s.close()


def poll(bridge, want=1, timeout=5.0):
    got, end = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        got += bridge.poll()
        time.sleep(0.001)
    return got


def test_both_directions_keep_the_icrc_valid(bridge, rank0, tmp_path):
    # Software rank -> simulated node: the datagram the kernel carries, as a frame.
    sent = write_frame(SW_IP, NODE_IP, ROCEV2_UDP_PORT, 5, bytes(range(200)))
    rank0.sendto(split(sent)[4], (NODE_IP, ROCEV2_UDP_PORT))
    [(port, frame)] = poll(bridge)
    assert port == 0                         # enters the switch where rank 0's node would
    f = parse_frame(frame)                   # raises on a bad IPv4 checksum or ICRC
    assert f.eth["dst"] == node_mac(1) and f.eth["src"] == node_mac(0)
    assert frame[14:] == sent[14:]           # IPv4/UDP exactly as the kernel sent them
    assert f.payload == bytes(range(200)) and f.bth["psn"] == 5

    # Simulated node -> software rank: sent from the node's address and QP source port.
    out = write_frame(NODE_IP, SW_IP, 0xC000, 9, b"\x5a" * 64) + bytes(6)  # + padding
    bridge.from_sim(out)
    dg, (src, sport) = rank0.recvfrom(65536)
    assert (src, sport) == (NODE_IP, 0xC000)
    # The software engine's own ICRC check (Receiver.packet).
    n = len(dg)
    opcode, b1, _, dqpn, w2 = wire.BTH_FMT.unpack_from(dg)
    seed = wire.icrc_seed(ip_int(src), ip_int(SW_IP), sport, ROCEV2_UDP_PORT, 8 + n)
    want = wire.datagram_icrc(seed, wire.bth_masked(opcode, (b1 >> 4) & 3, dqpn & 0xFFFFFF,
                                                    bool(w2 >> 31), w2 & wire.PSN_MASK),
                              dg[wire.BTH_LEN:n - wire.ICRC_LEN])
    assert want == dg[-wire.ICRC_LEN:]
    assert bridge.stats["to_sockets"] == 1 and bridge.stats["from_sockets"] == 1

    bridge.close()
    rows = decode(tmp_path / "bridge.pcap")
    assert len(rows) == 2
    assert all(r.is_rocev2 and not r.malformed for r in rows), rows
    assert [r.psn for r in rows] == [5, 9]


def test_unknown_senders_and_loss_are_counted(tmp_path, rank0):
    b = UdpBridge(loss=0.5, seed=3)
    try:
        b.host(1, NODE_IP)
        stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        stranger.bind(("127.77.0.9", 0))
        dg = split(write_frame(SW_IP, NODE_IP, ROCEV2_UDP_PORT, 1, b"x"))[4]
        stranger.sendto(dg, (NODE_IP, ROCEV2_UDP_PORT))
        stranger.close()
        b.route(0, SW_IP)
        for _ in range(40):
            rank0.sendto(dg, (NODE_IP, ROCEV2_UDP_PORT))
        end = time.monotonic() + 5
        while b.stats["lost"] + b.stats["from_sockets"] < 40 and time.monotonic() < end:
            b.poll()
        assert b.stats["unroutable"] == 1
        assert b.stats["lost"] + b.stats["from_sockets"] == 40
        assert 0 < b.stats["lost"] < 40
    finally:
        b.close()


def test_tap_shows_the_simulated_wire_to_tshark(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a TAP interface needs root")
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("no /dev/net/tun on this machine")
    name = "fpgacclt0"
    tap = TapMirror(name)
    cap = tmp_path / "live.pcap"
    try:
        proc = subprocess.Popen([shutil.which("tshark") or "tshark", "-i", name, "-f",
                                 "udp port 4791", "-a", "duration:6", "-w", str(cap)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # tshark prints "Capturing on ..." a little before its capture runs; this version
        # also says "Capture started", and a second covers those that do not.
        end = time.monotonic() + 10
        seen = ""
        while "Capture started" not in seen and time.monotonic() < end:
            if not select.select([proc.stderr], [], [], 0.1)[0]:
                continue
            line = proc.stderr.readline()
            seen += line
            if "Capturing on" in line:
                end = min(end, time.monotonic() + 1.0)
        assert "Capturing on" in seen, seen
        frames = [write_frame(NODE_IP, SW_IP, 0xC000 + i, i, bytes([i]) * 100) for i in range(5)]
        for f in frames:
            tap.write(f)
        proc.wait(20)
    finally:
        tap.close()
    rows = decode(cap)
    assert [r.psn for r in rows] == list(range(5)), rows
    assert all(r.is_rocev2 and not r.malformed for r in rows)
