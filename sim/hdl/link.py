"""One simulated network link as hardware: a beat stream in, the same frames out, with
seeded, reproducible impairments set by run-time registers (no Python per cycle).

Frames are kept in a ring buffer and forwarded cut-through: a frame may start leaving
``latency`` cycles after its first beat arrived, and each beat leaves only once it has
been written, so a link with every impairment off adds a few cycles and never throttles.
Per frame, four seeded LFSRs decide (each with probability ``register / 65536``):

* ``loss``: the frame is read out of the ring and thrown away;
* ``reorder``: the frame is held back and the next frame overtakes it (a frame held for
  ``hold`` cycles with no successor in sight leaves alone);
* ``dup``: the frame is sent twice (it is replayed from the ring);
* ``corrupt``: byte 0 of the frame's last beat is flipped. The last beat of every RoCEv2
  frame lies inside the ICRC's coverage (past the 42 bytes of L2-L4 headers), so the
  receiver drops it as BAD_ICRC and the transport retransmits; the Ethernet and IP
  headers are never touched, so the switch still routes the frame.

``rate`` paces the output with a token bucket: ``rate / 65536`` beats per cycle (0: line
rate, one beat per cycle). The ring holds ``depth`` beats, so latency x bandwidth beyond
``depth`` beats throttles the sender instead of losing frames.

The registers sit behind a small bus (:data:`LINK_CFG`): word addresses in
:data:`LINK_REGS` (read/write; writing ``seed`` reseeds the LFSRs) and
:data:`LINK_COUNTERS` (read-only counts of what the link did: frames, and the beats the
sender put in and the cycles it was held back).
"""

from __future__ import annotations

from amaranth.hdl import Cat, Module, Mux, Signal
from amaranth.lib import data, fifo, memory, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_layout, beat_stream

LINK_REGS = {"latency": 0, "rate": 1, "loss": 2, "dup": 3, "reorder": 4, "corrupt": 5,
             "seed": 6}
LINK_COUNTERS = {"frames": 8, "dropped": 9, "duplicated": 10, "reordered": 11,
                 "corrupted": 12, "beats": 13, "stalled": 14}
ONE = 1 << 16
"""Probabilities and the rate are fractions of this."""

LINK_CFG = wiring.Signature({
    "addr": Out(4),
    "w_data": Out(32),
    "w_stb": Out(1),
    "r_data": In(32),
})
"""Register bus of a link (controller's view): ``r_data`` shows register ``addr`` in the
same cycle."""


def lfsr_seed(seed: int, k: int) -> int:
    """Start state of LFSR ``k`` for a seed (never zero: a zero LFSR stays zero)."""
    return ((seed * 40503 + (k + 1) * 7919) & 0xFFFF) or 1


def _step(s):
    # Galois LFSR, taps 16,14,13,11 (maximal length).
    return s.shift_right(1) ^ (s[0].replicate(16) & 0xB400)


class Link(wiring.Component):
    def __init__(self, width: int, *, depth: int = 1024, seed: int = 1, hold: int = 256,
                 frames: int = 64) -> None:
        if depth & (depth - 1):
            raise ValueError("link depth must be a power of two")
        self.width, self.depth, self.seed, self.hold, self.frames = (
            width, depth, seed, hold, frames)
        super().__init__({
            "i": In(beat_stream(width)),
            "o": Out(beat_stream(width)),
            "cfg": In(LINK_CFG),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        layout = beat_layout(self.width)
        depth = self.depth
        aw = (depth - 1).bit_length()
        ptr = aw + 1   # one bit more than the address: full and empty differ

        regs = {name: Signal(16, name=name) for name in LINK_REGS if name != "seed"}
        counters = {name: Signal(32, name=f"n_{name}") for name in LINK_COUNTERS}
        lfsrs = [Signal(16, init=lfsr_seed(self.seed, k), name=f"lfsr{k}") for k in range(4)]
        cfg = self.cfg
        with m.If(cfg.w_stb):
            for name, reg in regs.items():
                with m.If(cfg.addr == LINK_REGS[name]):
                    m.d.sync += reg.eq(cfg.w_data)
        with m.Switch(cfg.addr):
            for name, addr in {**LINK_REGS, **LINK_COUNTERS}.items():
                if name in regs or name in counters:
                    with m.Case(addr):
                        m.d.comb += cfg.r_data.eq((regs | counters)[name])

        now = Signal(32)
        m.d.sync += now.eq(now + 1)

        m.submodules.ram = ram = memory.Memory(shape=layout, depth=depth, init=[])
        wp = ram.write_port()
        rp = ram.read_port()
        # The `last` flag of every slot, readable in the cycle a read is issued (the RAM
        # answers a cycle later): the reader must know where a frame ends as it goes.
        lastv = Signal(depth)

        # Write side: beats go into the ring; a frame's first beat queues a descriptor.
        desc = data.StructLayout({"start": ptr, "ts": 32})
        m.submodules.dq = dq = fifo.SyncFIFOBuffered(width=desc.size, depth=self.frames)
        wptr = Signal(ptr)
        commit = Signal(ptr)   # slots before this are free
        used = Signal(ptr)
        m.d.comb += used.eq(wptr - commit)
        beat = self.i.payload
        m.d.comb += [
            self.i.ready.eq((used != depth) & (dq.w_rdy | ~beat.first)),
            wp.addr.eq(wptr[:aw]), wp.data.eq(beat),
            dq.w_data.eq(Cat(wptr, now)),   # the descriptor layout: start, then ts
        ]
        # Utilisation as the sender sees it: beats taken, and cycles it offered one the
        # link (or the switch behind it) refused.
        with m.If(self.i.valid & self.i.ready):
            m.d.sync += counters["beats"].eq(counters["beats"] + 1)
        with m.If(self.i.valid & ~self.i.ready):
            m.d.sync += counters["stalled"].eq(counters["stalled"] + 1)
        with m.If(self.i.valid & self.i.ready):
            m.d.comb += [wp.en.eq(1), dq.w_en.eq(beat.first)]
            m.d.sync += [wptr.eq(wptr + 1), lastv.bit_select(wptr[:aw], 1).eq(beat.last)]

        # Output side: a small FIFO fed from the RAM, drained through the pacer.
        m.submodules.of = of = fifo.SyncFIFO(width=layout.size, depth=4)
        credit = Signal(18)
        rate = regs["rate"]
        paced_ok = (rate == 0) | (credit >= ONE)
        m.d.comb += [self.o.valid.eq(of.r_rdy & paced_ok), self.o.payload.eq(of.r_data),
                     of.r_en.eq(self.o.valid & self.o.ready)]
        cap = 2 * ONE - 1
        spent = Mux(self.o.valid & self.o.ready, ONE, 0)
        grown = credit + rate - spent
        m.d.sync += credit.eq(Mux(rate == 0, 0, Mux(grown > cap, cap, grown)))

        # Read side.
        head = data.View(desc, dq.r_data)
        head_ok = dq.r_rdy & ((now - head.ts)[:32] >= regs["latency"])
        pos = Signal(ptr)
        start = Signal(ptr)        # first slot of the frame being sent (for a replay)
        sending = Signal()
        discard = Signal()
        dup = Signal()
        corrupt = Signal()
        then_held = Signal()       # a held frame follows this one
        held = Signal()
        held_start = Signal(ptr)
        held_since = Signal(32)
        saved_end = Signal(ptr)    # where the overtaking frame ended
        use_saved = Signal()
        pattern = Signal(8)

        issued = Signal()
        issued_corrupt = Signal()
        can_read = pos != wptr
        room = of.level + issued < of.depth
        issue = sending & can_read & (discard | room)
        is_last = lastv.bit_select(pos[:aw], 1)
        m.d.comb += [rp.addr.eq(pos[:aw]), rp.en.eq(issue)]
        m.d.sync += [issued.eq(issue & ~discard), issued_corrupt.eq(corrupt)]
        out_beat = rp.data
        flipped = Signal(layout)
        m.d.comb += [flipped.eq(rp.data),
                     of.w_en.eq(issued), of.w_data.eq(flipped)]
        with m.If(issued_corrupt & out_beat.last):
            m.d.comb += flipped.data[:8].eq(out_beat.data[:8] ^ pattern)

        def begin(at, *, drop=0, twice=0, flip=0, before_held=0):
            m.d.sync += [sending.eq(1), pos.eq(at), start.eq(at), discard.eq(drop),
                         dup.eq(twice), corrupt.eq(flip), then_held.eq(before_held)]

        with m.If(issue):
            m.d.sync += pos.eq(pos + 1)
            with m.If(is_last):
                with m.If(dup):
                    m.d.sync += [pos.eq(start), dup.eq(0), corrupt.eq(0)]
                with m.Elif(then_held):
                    m.d.sync += [pos.eq(held_start), start.eq(held_start), held.eq(0),
                                 then_held.eq(0), corrupt.eq(0), saved_end.eq(pos + 1),
                                 use_saved.eq(1)]
                with m.Else():
                    m.d.sync += [sending.eq(0),
                                 commit.eq(Mux(use_saved, saved_end, pos + 1))]

        # The next frame is chosen in the cycle the last beat of this one is read, so
        # frames leave back to back.
        ending = issue & is_last & ~dup & ~then_held
        with m.If(~sending | ending):
            roll = [_step(s) for s in lfsrs]
            with m.If(head_ok):
                m.d.comb += dq.r_en.eq(1)
                m.d.sync += counters["frames"].eq(counters["frames"] + 1)
                with m.If(held):
                    # The held frame waited for this one: this one goes first.
                    begin(head.start, before_held=1)
                with m.Else():
                    m.d.sync += [s.eq(r) for s, r in zip(lfsrs, roll, strict=True)]
                    m.d.sync += [use_saved.eq(0), pattern.eq(roll[3][:8] | 1)]
                    with m.If(roll[0] < regs["loss"]):
                        m.d.sync += counters["dropped"].eq(counters["dropped"] + 1)
                        begin(head.start, drop=1)
                    with m.Elif(roll[1] < regs["reorder"]):
                        m.d.sync += [held.eq(1), held_start.eq(head.start),
                                     held_since.eq(now),
                                     counters["reordered"].eq(counters["reordered"] + 1)]
                    with m.Else():
                        twice = roll[2] < regs["dup"]
                        flip = roll[3] < regs["corrupt"]
                        with m.If(twice):
                            m.d.sync += counters["duplicated"].eq(
                                counters["duplicated"] + 1)
                        with m.If(flip):
                            m.d.sync += counters["corrupted"].eq(counters["corrupted"] + 1)
                        begin(head.start, twice=twice, flip=flip)
            with m.Elif(held & ((now - held_since)[:32] >= self.hold)):
                # Nothing came to overtake it: it leaves alone.
                m.d.sync += [held.eq(0), use_saved.eq(0)]
                begin(held_start)
        # A write of `seed` restarts the random sequences (last, so it wins).
        with m.If(cfg.w_stb & (cfg.addr == LINK_REGS["seed"])):
            v = cfg.w_data[:16]
            for k, s in enumerate(lfsrs):
                x = (v * 40503 + (k + 1) * 7919)[:16]
                m.d.sync += s.eq(Mux(x == 0, 1, x))
        return m
