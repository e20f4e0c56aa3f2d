"""Board-side adapters between a core's ports and pins: the network stream pair on a
nibble-wide MII-shaped link, and the CSR bus behind a UART.

Neither is a MAC. :class:`NibbleLink` frames with a data-valid line the way MII/RGMII
do, but sends no preamble/SFD/FCS and runs in the core's clock domain: it is the place
an Ethernet MAC (RGMII on ECPIX-5, CMAC on the Alveo) plugs in, and it makes the core's
stream ports real pins so a build cannot optimise the datapath away.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import memory, stream, wiring
from amaranth.lib.cdc import FFSynchronizer
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.stream.beat import beat_layout, beat_stream
from fpgaccl.hw.stream.skid import SkidBuffer

NIBBLE = 4


class NibbleLink(wiring.Component):
    """Beats to/from 4-bit nibbles, low nibble first (MII order), framed by
    ``rx_dv``/``tx_en``; no back-pressure on the pin side, as on a PHY.

    Receive: a beat is emitted when full -- held until the next nibble (or the end of
    the frame) says whether it is the last. A beat the core does not take before the
    next one is ready is dropped and ``overrun`` latches. A trailing odd nibble is
    dropped (a PHY delivers whole bytes). Transmit: bytes whose ``keep`` bit is set,
    then one idle cycle after ``last`` so back-to-back frames stay apart.
    """

    def __init__(self, width: int) -> None:
        self.width = width
        super().__init__({
            "rxd": In(NIBBLE),
            "rx_dv": In(1),
            "txd": Out(NIBBLE),
            "tx_en": Out(1),
            "rx": Out(beat_stream(width)),
            "tx": In(beat_stream(width)),
            "overrun": Out(1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        self._receive(m)
        self._transmit(m)
        return m

    def _receive(self, m: Module) -> None:
        w = self.width
        per_beat = w // NIBBLE
        kw = w // 8
        rxd = Signal(NIBBLE)
        dv = Signal()
        dv_prev = Signal()
        m.d.sync += [rxd.eq(self.rxd), dv.eq(self.rx_dv), dv_prev.eq(dv)]

        sr = Signal(w)
        n = Signal(range(per_beat))
        pending = Signal()
        pend_data = Signal(w)
        at_start = Signal(init=1)
        out = self.rx

        emit = Signal()
        e_data = Signal(w)
        e_keep = Signal(kw)
        e_last = Signal()
        with m.If(out.valid & out.ready):
            m.d.sync += out.valid.eq(0)
        with m.If(emit):
            with m.If(out.valid & ~out.ready):
                m.d.sync += self.overrun.eq(1)
            with m.Else():
                m.d.sync += [out.valid.eq(1), out.payload.data.eq(e_data),
                             out.payload.keep.eq(e_keep), out.payload.first.eq(at_start),
                             out.payload.last.eq(e_last)]
            m.d.sync += at_start.eq(e_last)

        with m.If(dv):
            with m.If(pending):
                m.d.comb += [emit.eq(1), e_data.eq(pend_data), e_keep.eq(-1), e_last.eq(0)]
                m.d.sync += pending.eq(0)
            m.d.sync += sr.word_select(n, NIBBLE).eq(rxd)
            with m.If(n == per_beat - 1):
                full = Cat(sr[:w - NIBBLE], rxd)
                m.d.sync += [pend_data.eq(full), pending.eq(1), n.eq(0)]
            with m.Else():
                m.d.sync += n.eq(n + 1)
        with m.Elif(dv_prev):
            # End of frame: the held beat, or the partial one, is the last.
            with m.If(pending):
                m.d.comb += [emit.eq(1), e_data.eq(pend_data), e_keep.eq(-1), e_last.eq(1)]
            with m.Elif(n >= 2):
                keep = (Const(1, kw + 1) << (n >> 1)) - 1
                m.d.comb += [emit.eq(1), e_data.eq(sr), e_keep.eq(keep[:kw]), e_last.eq(1)]
            m.d.sync += [pending.eq(0), n.eq(0), at_start.eq(1)]

    def _transmit(self, m: Module) -> None:
        w = self.width
        per_beat = w // NIBBLE
        data = Signal(w)
        keep = Signal(w // 8)
        last = Signal()
        n = Signal(range(per_beat + 1))
        busy = Signal()
        gap = Signal()
        inp = self.tx

        load = Signal()
        more = (n + 1 < per_beat) & keep.bit_select((n + 1) >> 1, 1)
        m.d.comb += inp.ready.eq(load)
        m.d.sync += [self.tx_en.eq(0), gap.eq(0)]
        with m.If(busy):
            m.d.sync += [self.txd.eq(data.word_select(n, NIBBLE)), self.tx_en.eq(1)]
            with m.If(more):
                m.d.sync += n.eq(n + 1)
            with m.Else():
                m.d.sync += busy.eq(0)
                with m.If(last):
                    m.d.sync += gap.eq(1)
                with m.Else():
                    # Next beat of the same frame straight away, or the frame underruns.
                    m.d.comb += load.eq(inp.valid)
        with m.Elif(~gap):
            m.d.comb += load.eq(inp.valid)
        # After the busy logic: a load in the cycle a beat ends must win.
        with m.If(load):
            m.d.sync += [data.eq(inp.payload.data), keep.eq(inp.payload.keep),
                         last.eq(inp.payload.last), n.eq(0), busy.eq(inp.payload.keep[0])]


class UARTBridge(wiring.Component):
    """The CSR bus from a serial port (8N1): ``'W' a1 a0 d3 d2 d1 d0`` writes and
    answers ``'K'``; ``'R' a1 a0`` reads and answers ``d3 d2 d1 d0``; big-endian.
    Anything else is ignored, so a host resynchronises by sending idle bytes."""

    def __init__(self, clk_freq: float, baud: int = 115200, addr_width: int = 16) -> None:
        self.divisor = round(clk_freq / baud)
        if self.divisor < 4:
            raise ValueError(f"clock {clk_freq} Hz too slow for {baud} baud")
        super().__init__({
            "rx": In(1),
            "tx": Out(1, init=1),
            "bus": Out(CSRBusSignature(addr_width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        rx_byte, rx_valid = self._uart_rx(m)
        tx_byte = Signal(8)
        tx_start = Signal()
        tx_busy = self._uart_tx(m, tx_byte, tx_start)

        bus = self.bus
        cmd = Signal(8)
        shift = Signal(48)
        got = Signal(range(7))
        reply = Signal(32)
        left = Signal(range(5))
        m.d.sync += [bus.w_stb.eq(0), bus.r_stb.eq(0)]
        with m.FSM():
            with m.State("CMD"), m.If(
                    rx_valid & ((rx_byte == ord("W")) | (rx_byte == ord("R")))):
                m.d.sync += [cmd.eq(rx_byte), got.eq(0)]
                m.next = "ARGS"
            with m.State("ARGS"):
                need = Mux(cmd == ord("W"), 6, 2)
                with m.If(rx_valid):
                    m.d.sync += [shift.eq(Cat(rx_byte, shift[:40])), got.eq(got + 1)]
                with m.If(got == need):
                    with m.If(cmd == ord("W")):
                        m.d.sync += [bus.addr.eq(shift[32:48]), bus.w_data.eq(shift[:32]),
                                     bus.w_stb.eq(1), reply.eq(ord("K") << 24), left.eq(1)]
                        m.next = "REPLY"
                    with m.Else():
                        m.d.sync += [bus.addr.eq(shift[:16]), bus.r_stb.eq(1)]
                        m.next = "READ"
            with m.State("READ"):
                m.next = "LATCH"
            with m.State("LATCH"):
                # Read data is valid the cycle after the strobe.
                m.d.sync += [reply.eq(bus.r_data), left.eq(4)]
                m.next = "REPLY"
            with m.State("REPLY"):
                with m.If(left == 0):
                    m.next = "CMD"
                with m.Elif(~tx_busy):
                    m.d.comb += [tx_byte.eq(reply[24:]), tx_start.eq(1)]
                    m.d.sync += [reply.eq(reply << 8), left.eq(left - 1)]
        return m

    def _uart_rx(self, m: Module):
        div = self.divisor
        rx = Signal(init=1)
        m.submodules.rx_sync = FFSynchronizer(self.rx, rx, init=1)
        timer = Signal(range(div + div // 2 + 1))
        bit = Signal(range(10))
        sr = Signal(8)
        byte = Signal(8)
        valid = Signal()
        m.d.sync += valid.eq(0)
        with m.FSM(name="uart_rx"):
            with m.State("IDLE"), m.If(~rx):
                # First sample in the middle of data bit 0.
                m.d.sync += [timer.eq(div + div // 2 - 1), bit.eq(0)]
                m.next = "BITS"
            with m.State("BITS"):
                with m.If(timer != 0):
                    m.d.sync += timer.eq(timer - 1)
                with m.Elif(bit == 8):
                    with m.If(rx):        # stop bit; a framing error drops the byte
                        m.d.sync += [byte.eq(sr), valid.eq(1)]
                    m.next = "IDLE"
                with m.Else():
                    m.d.sync += [sr.eq(Cat(sr[1:], rx)), bit.eq(bit + 1), timer.eq(div - 1)]
        return byte, valid

    def _uart_tx(self, m: Module, byte: Signal, start: Signal) -> Signal:
        div = self.divisor
        timer = Signal(range(div))
        sr = Signal(10)
        left = Signal(range(11))
        busy = Signal()
        # Busy until the stop bit has been on the line for a whole bit time.
        m.d.comb += busy.eq((left != 0) | (timer != 0))
        with m.If(start & ~busy):
            m.d.sync += [sr.eq(Cat(Const(0, 1), byte, Const(1, 1))), left.eq(10)]
        with m.Elif(timer != 0):
            m.d.sync += timer.eq(timer - 1)
        with m.Elif(left != 0):
            m.d.sync += [self.tx.eq(sr[0]), sr.eq(sr >> 1), left.eq(left - 1),
                         timer.eq(div - 1)]
        return busy


class OnChipMemory(wiring.Component):
    """Block RAM behind a core's memory ports (``wr``, ``rd_req``/``rd_resp`` as
    :class:`fpgaccl.hw.node.Node` has them) until a board's DRAM/HBM controller is
    wired: ``depth`` beats, addresses taken modulo its size, with the ports' semantics
    (:class:`fpgaccl.sim.hdl.memory.SimMemory`'s): a write beat's byte 0 goes to its
    address, a read's first beat starts at the requested byte -- any byte, since a
    collective's chunks start wherever ``ceil(n / chunks)`` elements put them.

    An unaligned beat touches two neighbouring words, one even and one odd, so the
    words live in two banks by parity, each one write and one read port (a simple
    dual-port block RAM each)."""

    def __init__(self, width: int, depth: int, write_layout, read_req_layout) -> None:
        if depth < 2 or depth & (depth - 1):
            raise ValueError(f"depth must be a power of two >= 2, not {depth}")
        self.width, self.depth = width, depth
        super().__init__({
            "wr": In(stream.Signature(write_layout)),
            "rd_req": In(stream.Signature(read_req_layout)),
            "rd_resp": Out(beat_stream(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w, nb = self.width, self.width // 8
        lg = nb.bit_length() - 1
        half = self.depth // 2
        banks = []
        for name in ("even", "odd"):
            m.submodules[name] = mem = memory.Memory(shape=w, depth=half, init=[])
            banks.append((mem.write_port(granularity=8), mem.read_port()))
        (we, re_), (wo, ro) = banks

        # Write: the beat shifted to its byte offset, split over word k and k+1.
        p = self.wr.payload
        off, word = p.addr[:lg], p.addr[lg:lg + (self.depth - 1).bit_length()]
        shifted = Signal(2 * w)
        mask = Signal(2 * nb)
        m.d.comb += [shifted.eq(p.data << (off * 8)),
                     mask.eq(Mux(self.wr.valid, p.keep, 0) << off), self.wr.ready.eq(1)]
        odd = word[0]
        # word k is in bank k % 2 at k // 2; word k+1 in the other, at (k + 1) // 2.
        lo_row, hi_row = word[1:], (word + 1)[1:]
        m.d.comb += [
            we.addr.eq(Mux(odd, hi_row, lo_row)), wo.addr.eq(lo_row),
            we.data.eq(Mux(odd, shifted[w:], shifted[:w])),
            wo.data.eq(Mux(odd, shifted[:w], shifted[w:])),
            we.en.eq(Mux(odd, mask[nb:], mask[:nb])),
            wo.en.eq(Mux(odd, mask[:nb], mask[nb:])),
        ]

        # Read: a request is walked a beat per cycle; each beat reads words k and k+1
        # (issue), then picks and shifts the RAMs' outputs into a register, then a skid
        # buffer: the block RAM's 4 ns clock-to-out sees one mux level and the shift,
        # and the ready chain back starts at a register.
        m.submodules.skid = skid = SkidBuffer(beat_layout(w))
        wiring.connect(m, skid.o, wiring.flipped(self.rd_resp))
        addr = Signal(lg + (self.depth - 1).bit_length())
        left = Signal(len(self.rd_req.payload.len))
        first = Signal()
        active = Signal()
        advance = Signal()
        rword = addr[lg:]
        m.d.comb += self.rd_req.ready.eq(~active)
        with m.If(self.rd_req.valid & ~active):
            m.d.sync += [addr.eq(self.rd_req.payload.addr), left.eq(self.rd_req.payload.len),
                         first.eq(1), active.eq(self.rd_req.payload.len != 0)]
        r_lo, r_hi = rword[1:], (rword + 1)[1:]
        m.d.comb += [re_.addr.eq(Mux(rword[0], r_hi, r_lo)), ro.addr.eq(r_lo),
                     re_.en.eq(advance), ro.en.eq(advance)]
        s_valid, s_first, s_last, s_odd = Signal(), Signal(), Signal(), Signal()
        s_off = Signal(lg)
        s_keep = Signal(nb)
        is_last = left <= nb
        with m.If(advance):
            m.d.sync += [s_valid.eq(active), s_off.eq(addr[:lg]), s_odd.eq(rword[0]),
                         s_first.eq(first), s_last.eq(is_last),
                         s_keep.eq(Mux(left >= nb, (1 << nb) - 1,
                                       (Const(1, nb + 1) << left[:lg + 1]) - 1))]
            with m.If(active):
                m.d.sync += [addr.eq(addr + nb), left.eq(left - nb), first.eq(0)]
                with m.If(is_last):
                    m.d.sync += [active.eq(0), left.eq(0)]
        lo = Mux(s_odd, ro.data, re_.data)
        hi = Mux(s_odd, re_.data, ro.data)
        out = skid.i
        with m.If(advance):
            m.d.sync += [out.valid.eq(s_valid), out.payload.data.eq(Cat(lo, hi) >> (s_off * 8)),
                         out.payload.keep.eq(s_keep), out.payload.first.eq(s_first),
                         out.payload.last.eq(s_last)]
        m.d.comb += advance.eq(~out.valid | out.ready)
        return m
