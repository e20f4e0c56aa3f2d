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
    wired: ``depth`` beats, addresses taken modulo its size, and -- a simplification a
    real controller will not have -- beat-aligned: the low address bits are ignored."""

    def __init__(self, width: int, depth: int, write_layout, read_req_layout) -> None:
        self.width, self.depth = width, depth
        super().__init__({
            "wr": In(stream.Signature(write_layout)),
            "rd_req": In(stream.Signature(read_req_layout)),
            "rd_resp": Out(beat_stream(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w, nbytes = self.width, self.width // 8
        shift = nbytes.bit_length() - 1
        m.submodules.mem = mem = memory.Memory(shape=w, depth=self.depth, init=[])
        wp = mem.write_port(granularity=8)
        rp = mem.read_port()
        m.d.comb += [self.wr.ready.eq(1), wp.addr.eq(self.wr.payload.addr >> shift),
                     wp.data.eq(self.wr.payload.data),
                     wp.en.eq(Mux(self.wr.valid, self.wr.payload.keep, 0))]

        # The block RAM's read data (4 ns clock-to-out on an ECP5) goes straight into a
        # skid buffer: what reads the answer, and the ready chain back from it, starts
        # at a register rather than at the RAM.
        m.submodules.skid = skid = SkidBuffer(beat_layout(w))
        wiring.connect(m, skid.o, wiring.flipped(self.rd_resp))
        out = skid.i
        cur = Signal(range(self.depth))
        left = Signal(len(self.rd_req.payload.len))
        tail = Signal(range(nbytes + 1))       # valid bytes in the last beat
        first = Signal()
        advance = ~out.valid | out.ready
        issue = Signal()        # left != 0, kept as a flag: it is the request's ready
        m.d.comb += [self.rd_req.ready.eq(~issue), rp.addr.eq(cur), rp.en.eq(advance),
                     out.payload.data.eq(rp.data)]
        with m.If(advance):
            last = left == 1
            m.d.sync += [out.valid.eq(issue), out.payload.first.eq(first),
                         out.payload.last.eq(last),
                         out.payload.keep.eq(Mux(last, (Const(1, nbytes + 1) << tail) - 1,
                                                 -1))]
            with m.If(issue):
                m.d.sync += [cur.eq(cur + 1), left.eq(left - 1), first.eq(0),
                             issue.eq(~last)]
        with m.If(self.rd_req.valid & self.rd_req.ready):
            n = self.rd_req.payload.len
            beats = (n + nbytes - 1) >> shift
            m.d.sync += [cur.eq(self.rd_req.payload.addr >> shift), left.eq(beats),
                         issue.eq(beats != 0), first.eq(1),
                         tail.eq(Mux(n[:shift] == 0, nbytes, n[:shift]))]
        return m
