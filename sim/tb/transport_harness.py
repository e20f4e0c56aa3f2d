"""Bench harness for :class:`fpgaccl.hw.transport.Transport`: the DUT wrapper with one
or more nodes, a per-node port driver, and a seeded frame-level link model.

Speed: one coroutine drives every port of every node, once per cycle; each cycle it
samples at the falling edge (everything settled: the handshakes the next rising edge
will take are known) and drives new values after the rising edge. Frames cross the
link as bytes (:func:`fpgaccl.proto.build_frame`/``parse_frame`` stand in for the HDL
builder/parser), so the wire format is checked on every packet, ICRC included.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable

from amaranth.hdl import Module
from amaranth.lib import wiring
from amaranth.lib.wiring import Out

from fpgaccl.hw.transport import Transport
from fpgaccl.hw.transport.layouts import (
    WRITE_DESC,
    QPState,
    mr_ctl_layout,
    qp_ctl_layout,
)
from fpgaccl.proto import Dropped, DropReason
from fpgaccl.sim.models.memory import Memory, ReadServer

from .transport_model import from_frame, pack, to_frame, unpack


class Nodes(wiring.Component):
    """``n`` independent transports in one simulation: ports ``n<i>__<port>``."""

    def __init__(self, n: int, width: int, **kw) -> None:
        self.nodes = [Transport(width, **kw) for _ in range(n)]
        super().__init__({f"n{i}": Out(t.signature) for i, t in enumerate(self.nodes)})

    def elaborate(self, platform) -> Module:
        m = Module()
        for i, t in enumerate(self.nodes):
            m.submodules[f"t{i}"] = t
            wiring.connect(m, t, wiring.flipped(getattr(self, f"n{i}")))
        return m


def _u(handle) -> int:
    return handle.value.to_unsigned()


class Link:
    """One direction of a lossy, reordering, duplicating wire, seeded."""

    def __init__(self, rng: random.Random, *, latency: int = 20, loss: float = 0.0,
                 dup: float = 0.0, reorder: float = 0.0, reorder_delay: int = 300) -> None:
        self.rng = rng
        self.latency = latency
        self.loss, self.dup, self.reorder = loss, dup, reorder
        self.reorder_delay = reorder_delay
        self.heap: list[tuple[int, int, bytes]] = []
        self.seq = 0
        self.stats = {"sent": 0, "lost": 0, "duplicated": 0, "reordered": 0}

    def send(self, frame: bytes, cycle: int) -> None:
        self.stats["sent"] += 1
        if self.rng.random() < self.loss:
            self.stats["lost"] += 1
            return
        copies = 2 if self.rng.random() < self.dup else 1
        self.stats["duplicated"] += copies - 1
        for _ in range(copies):
            due = cycle + self.latency
            if self.rng.random() < self.reorder:
                self.stats["reordered"] += 1
                due += self.rng.randint(1, self.reorder_delay)
            self.seq += 1
            heapq.heappush(self.heap, (due, self.seq, frame))

    def due(self, cycle: int) -> list[bytes]:
        out = []
        while self.heap and self.heap[0][0] <= cycle:
            out.append(heapq.heappop(self.heap)[2])
        return out


class NodeIO:
    """Drives one transport's ports: memory, descriptors, and frames in and out."""

    def __init__(self, dut, index: int, *, width: int, nqp: int, nmr: int, ip: int,
                 read_latency: int = 8, rng: random.Random | None = None,
                 wr_stall: float = 0.0) -> None:
        p = f"n{index}__"
        self.sig = {name: getattr(dut, p + name) for name in (
            "rx_hdr__valid", "rx_hdr__ready", "rx_hdr__payload",
            "rx_data__valid", "rx_data__ready", "rx_data__payload",
            "tx_hdr__valid", "tx_hdr__ready", "tx_hdr__payload",
            "tx_data__valid", "tx_data__ready", "tx_data__payload",
            "desc__valid", "desc__ready", "desc__payload",
            "cmpl__valid", "cmpl__ready", "cmpl__payload",
            "recv__valid", "recv__ready", "recv__payload",
            "wr__valid", "wr__ready", "wr__payload",
            "rd_req__valid", "rd_req__ready", "rd_req__payload",
            "rd_resp__valid", "rd_resp__ready", "rd_resp__payload",
            "qp_ctl", "mr_ctl", "qp_error", "retransmits", "timeouts", "tx_packets",
            "naks_rx", "accepted", "acks_tx", "naks_tx", "drops")}
        self.width, self.nb = width, width // 8
        self.nqp, self.nmr = nqp, nmr
        self.ip = ip
        self.rng = rng or random.Random(index)
        self.wr_stall = wr_stall
        self.mem = Memory()
        self.reads = ReadServer(self.mem, width, latency=read_latency)
        self.desc: deque[dict] = deque()
        self.rx_hdr: deque[int] = deque()
        self.rx_beats: deque[int] = deque()
        self.tx_hdrs: deque[dict] = deque()
        self.tx_buf = bytearray()
        self.completions: list[tuple[int, int]] = []
        self.received: list[dict] = []
        self.data_cycles = 0
        self.rx_dropped: dict[str, int] = {}
        self.out: Callable[[bytes, int], None] = lambda frame, cycle: None
        self.peer_ip = {}  # qp index -> peer IPv4
        self.udp_sport: int | None = None  # None: the frame model's default
        self.qps = [dict(local_qpn=0, remote_qpn=0, next_psn=0, expected_psn=0,
                         state=QPState.RESET) for _ in range(nqp)]
        self.mrs = [dict(base=0, length=0, key=0, write=0) for _ in range(nmr)]
        self._driven = {}
        for name in ("tx_hdr__ready", "tx_data__ready", "cmpl__ready", "recv__ready",
                     "rd_req__ready"):
            self.sig[name].value = 1
        for name in ("rx_hdr__valid", "rx_data__valid", "desc__valid", "rd_resp__valid"):
            self.sig[name].value = 0
        self.sig["wr__ready"].value = 1
        self._wr_ready = 1
        self._rd_beat = None

    # ------------------------------------------------------------------ set-up
    def set_qp(self, i: int, **kw) -> None:
        self.qps[i].update(kw)
        self.sig["qp_ctl"].value = qp_ctl_layout(self.nqp).const([
            {"local_qpn": {"value": q["local_qpn"]}, "remote_qpn": {"value": q["remote_qpn"]},
             "next_psn": {"value": q["next_psn"]}, "expected_psn": {"value": q["expected_psn"]},
             "state": {"state": q["state"]},
             "peer_ip": {"value": self.peer_ip.get(i, 0)}}
            for i, q in enumerate(self.qps)]).as_value().value

    def set_mr(self, j: int, *, base: int, length: int, key: int, write: int = 1) -> None:
        self.mrs[j] = dict(base=base, length=length, key=key, write=write)
        self.sig["mr_ctl"].value = mr_ctl_layout(self.nmr).const([
            {"base_lo": {"value": r["base"] & 0xFFFFFFFF}, "base_hi": {"value": r["base"] >> 32},
             "length": {"value": r["length"]}, "key": {"value": r["key"]},
             "access": {"remote_write": r["write"]}} for r in self.mrs]).as_value().value

    def post(self, *, qp: int, laddr: int, raddr: int, rkey: int, length: int,
             imm: int | None = None) -> None:
        self.desc.append(WRITE_DESC.const({
            "qp": qp, "laddr": laddr, "raddr": raddr, "rkey": rkey, "len": length,
            "imm": imm or 0, "has_imm": int(imm is not None)}).as_value().value)

    def deliver(self, frame: bytes) -> None:
        """A frame from the wire, through the (Python) parser."""
        try:
            h, payload = from_frame(frame)
        except Dropped as e:
            self.rx_dropped[e.reason.name] = self.rx_dropped.get(e.reason.name, 0) + 1
            return
        self.rx_hdr.append(pack(h))
        for off in range(0, len(payload), self.nb):
            chunk = payload[off:off + self.nb]
            self.rx_beats.append(
                int.from_bytes(chunk, "little")
                | ((1 << len(chunk)) - 1) << self.width
                | int(off == 0) << (self.width + self.nb)
                | int(off + self.nb >= len(payload)) << (self.width + self.nb + 1))

    def counter(self, name: str) -> int:
        return _u(self.sig[name])

    def drops(self) -> dict[int, int]:
        word = _u(self.sig["drops"])
        counts = {r: (word >> 32 * r) & 0xFFFFFFFF for r in range(len(DropReason))}
        return {DropReason(r): n for r, n in counts.items() if n}

    @property
    def idle(self) -> bool:
        return not (self.desc or self.rx_hdr or self.rx_beats or self.reads.beats
                    or self.tx_hdrs)

    # ------------------------------------------------------------------ per cycle
    def sample(self, cycle: int) -> None:
        """At the falling edge: take note of what the next rising edge transfers."""
        s = self.sig
        # Only what was presented at the last drive can transfer (queues may have grown
        # since).
        d = self._driven
        if d.get("desc") is not None and s["desc__ready"].value:
            self.desc.popleft()
        if d.get("rx_hdr") is not None and s["rx_hdr__ready"].value:
            self.rx_hdr.popleft()
        if d.get("rx_data") is not None and s["rx_data__ready"].value:
            self.rx_beats.popleft()
        if self._rd_beat is not None and s["rd_resp__ready"].value:
            self.reads.pop()
        if s["rd_req__valid"].value:
            w = _u(s["rd_req__payload"])
            self.reads.request(w & (1 << 64) - 1, w >> 64, cycle)
        if self._wr_ready and s["wr__valid"].value:
            w = _u(s["wr__payload"])
            nb = self.nb
            self.mem.write_beat(w & (1 << 64) - 1, (w >> 64) & ((1 << self.width) - 1),
                                (w >> (64 + self.width)) & ((1 << nb) - 1), nb)
        if s["cmpl__valid"].value:
            w = _u(s["cmpl__payload"])
            self.completions.append((w & 0xFF, w >> 8))
        if s["recv__valid"].value:
            w = _u(s["recv__payload"])
            self.received.append({"qp": w & 0xFF, "va": (w >> 8) & (1 << 64) - 1,
                                  "len": (w >> 72) & 0xFFFFFFFF, "imm": (w >> 104) & 0xFFFFFFFF,
                                  "has_imm": w >> 136})
        if s["tx_hdr__valid"].value:
            h = unpack(_u(s["tx_hdr__payload"]))
            if h["payload_len"]:
                self.tx_hdrs.append(h)
            else:
                self._emit(h, b"", cycle)
        if s["tx_data__valid"].value:
            self.data_cycles += 1
            w = _u(s["tx_data__payload"])
            nb = self.nb
            keep = (w >> self.width) & ((1 << nb) - 1)
            self.tx_buf += (w & ((1 << self.width) - 1)).to_bytes(nb, "little")[
                :keep.bit_length()]
            if (w >> (self.width + nb + 1)) & 1:
                self._emit(self.tx_hdrs.popleft(), bytes(self.tx_buf), cycle)
                self.tx_buf = bytearray()

    def _emit(self, h: dict, payload: bytes, cycle: int) -> None:
        self.out(to_frame(h, payload, src_ip=self.ip, dst_ip=self.peer_ip.get(h["qp"], 0),
                          sport=self.udp_sport), cycle)

    def drive(self, cycle: int) -> None:
        """After the rising edge: present the next items."""
        s = self.sig
        self._set("desc", self.desc[0] if self.desc else None)
        self._set("rx_hdr", self.rx_hdr[0] if self.rx_hdr else None)
        self._set("rx_data", self.rx_beats[0] if self.rx_beats else None)
        beat = self.reads.peek(cycle)
        self._rd_beat = beat
        self._set("rd_resp", None if beat is None else (
            beat["data"] | beat["keep"] << self.width | beat["first"] << (self.width + self.nb)
            | beat["last"] << (self.width + self.nb + 1)))
        if self.wr_stall:
            self._wr_ready = int(self.rng.random() >= self.wr_stall)
            s["wr__ready"].value = self._wr_ready

    def _set(self, port: str, value: int | None) -> None:
        # Writing a wide handle costs; only touch what changed.
        if self._driven.get(port, -1) == value:
            return
        self._driven[port] = value
        self.sig[port + "__valid"].value = int(value is not None)
        if value is not None:
            self.sig[port + "__payload"].value = value
