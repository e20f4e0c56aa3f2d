"""A store-and-forward Ethernet switch for simulated clusters, in hardware.

Port ``i`` serves the node whose MAC is :func:`node_mac` ``(i)``; frames are routed by
the last byte of the destination MAC. Each input buffers frames in a FIFO; each output
takes whole frames round-robin from the inputs whose head frame is for it. A seeded
LFSR per output drops whole frames with probability ``loss / 65536`` (a register), so
lossy runs are reproducible and cost no Python per cycle.
"""

from __future__ import annotations

from amaranth.hdl import Module, Signal
from amaranth.lib import data, fifo, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_layout, beat_stream


def node_mac(i: int) -> int:
    return 0x02_00_00_00_00_01 + i


def node_ip(i: int) -> int:
    return 0x0A_00_00_01 + i


class Switch(wiring.Component):
    def __init__(self, width: int, ports: int, *, depth: int = 1024, seed: int = 1) -> None:
        self.width, self.ports, self.depth, self.seed = width, ports, depth, seed
        members = {"loss": In(16)}
        for i in range(ports):
            members[f"i{i}"] = In(beat_stream(width))
            members[f"o{i}"] = Out(beat_stream(width))
        members["dropped"] = Out(32)
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        n, w = self.ports, self.width
        layout = beat_layout(w)
        heads = []
        for i in range(n):
            q = fifo.SyncFIFOBuffered(width=layout.size, depth=self.depth)
            m.submodules[f"q{i}"] = q
            src = getattr(self, f"i{i}")
            m.d.comb += [q.w_data.eq(src.payload), q.w_en.eq(src.valid), src.ready.eq(q.w_rdy)]
            beat = data.View(layout, q.r_data)
            # A frame's first beat carries the destination MAC's last byte (wire byte 5).
            heads.append((q, beat, beat.data[40:48] - 1))

        per_port = []
        for j in range(n):
            out = getattr(self, f"o{j}")
            owner = Signal(range(n), name=f"owner{j}")
            busy = Signal(name=f"busy{j}")
            drop = Signal(name=f"drop{j}")
            dropped = Signal(32, name=f"dropped{j}")
            per_port.append(dropped)
            lfsr = Signal(16, init=(self.seed * 40503 + j * 7919) & 0xFFFF or 1,
                          name=f"lfsr{j}")
            # Galois LFSR, taps 16,14,13,11: advances once per frame decision.
            step = lfsr.shift_right(1) ^ (lfsr[0].replicate(16) & 0xB400)
            with m.If(~busy):
                for k in reversed(range(n)):
                    i = (k + j) % n  # rotate the start with the port for fairness
                    q, beat, dst = heads[i]
                    with m.If(q.r_rdy & beat.first & (dst == j)):
                        m.d.sync += [owner.eq(i), busy.eq(1), lfsr.eq(step),
                                     drop.eq(step < self.loss)]
            for i in range(n):
                q, beat, _ = heads[i]
                with m.If(busy & (owner == i)):
                    m.d.comb += [out.valid.eq(q.r_rdy & ~drop), out.payload.eq(q.r_data),
                                 q.r_en.eq(drop | out.ready)]
                    with m.If(q.r_rdy & (drop | out.ready) & beat.last):
                        m.d.sync += busy.eq(0)
                        with m.If(drop):
                            m.d.sync += dropped.eq(dropped + 1)
        m.d.comb += self.dropped.eq(sum(per_port[1:], per_port[0]))
        return m
