"""The Ethernet MAC: the node's beat streams on one side, a GMII-shaped byte
interface on the other."""

from __future__ import annotations

from amaranth.hdl import DomainRenamer, Module
from amaranth.lib import data, fifo, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.drops import DROP_COUNTER_BITS

from ..stream.beat import beat_layout, beat_stream
from .gate import FrameGate, frame_depth
from .mac_rx import MAX_FRAME, MacRx
from .mac_tx import IFG, MacTx
from .symbols import RxDrop, rx_beat_layout
from .width import BeatsToBytes, BytesToBeats

CDC_DEPTH = 16
"""Beats in each clock-crossing FIFO: it only has to cover the synchroniser delay."""


def _stream_link(m: Module, name: str, src: stream.Interface, dst: stream.Interface,
                 shape, w_domain: str, r_domain: str) -> None:
    """``src`` -> ``dst``, through an AsyncFIFO when the two run on different clocks."""
    if w_domain == r_domain:
        m.d.comb += [dst.payload.eq(src.payload), dst.valid.eq(src.valid),
                     src.ready.eq(dst.ready)]
        return
    width = data.Layout.cast(shape).size
    cdc = fifo.AsyncFIFO(width=width, depth=CDC_DEPTH, w_domain=w_domain, r_domain=r_domain)
    m.submodules[name] = cdc
    m.d.comb += [cdc.w_data.eq(src.payload), cdc.w_en.eq(src.valid), src.ready.eq(cdc.w_rdy),
                 dst.payload.eq(cdc.r_data), dst.valid.eq(cdc.r_rdy), cdc.r_en.eq(dst.ready)]


def mac_signature(width: int) -> wiring.Signature:
    """Beats on the node side, a GMII-shaped byte interface on the other."""
    return wiring.Signature({
        "tx": In(beat_stream(width)),
        "rx": Out(beat_stream(width)),
        "rx_frames": Out(data.ArrayLayout(DROP_COUNTER_BITS, len(RxDrop))),
        "txd": Out(8),
        "tx_en": Out(1),
        "tx_er": Out(1),
        "rxd": In(8),
        "rx_dv": In(1),
        "rx_er": In(1),
    })


class Mac(wiring.Component):
    """``tx`` frames -> ``txd``/``tx_en``/``tx_er``; ``rxd``/``rx_dv``/``rx_er`` ->
    ``rx`` frames, only good ones, FCS stripped.

    The byte side runs in ``tx_domain``/``rx_domain`` (one byte per cycle of the PHY's
    clock: preamble, padding and the gap are counted in its cycles); the beat side in
    ``sync``. Different domains cross on beats, through an AsyncFIFO each way, so
    the node clock needs only ``width/8`` times less than the byte rate.

    Both directions store and forward a whole frame in a
    :class:`~fpgaccl.hw.eth.gate.FrameGate` in ``sync``: transmit so that a frame,
    once started, never waits on its source (a PHY cannot), receive so that a frame
    is released only after its FCS was checked. ``rx_frames[v]`` counts received
    frames by verdict (:class:`~fpgaccl.hw.eth.symbols.RxDrop`), in ``sync``."""

    def __init__(self, width: int, *, max_frame: int = MAX_FRAME, ifg: int = IFG,
                 tx_domain: str = "sync", rx_domain: str = "sync") -> None:
        self.width = width
        self.max_frame = max_frame
        self.ifg = ifg
        self.tx_domain = tx_domain
        self.rx_domain = rx_domain
        super().__init__(mac_signature(width))

    def elaborate(self, platform) -> Module:
        m = Module()
        depth = frame_depth(self.width, self.max_frame)
        on_tx = DomainRenamer({"sync": self.tx_domain})
        on_rx = DomainRenamer({"sync": self.rx_domain})

        # Transmit: gate (whole frames) -> [clock crossing] -> bytes -> framing.
        m.submodules.tx_gate = tx_gate = FrameGate(self.width, depth)
        m.submodules.tx_bytes = tx_bytes = on_tx(BeatsToBytes(self.width))
        m.submodules.tx_mac = tx_mac = on_tx(MacTx(ifg=self.ifg))
        m.d.comb += [tx_gate.i.payload.beat.eq(self.tx.payload),
                     tx_gate.i.valid.eq(self.tx.valid), self.tx.ready.eq(tx_gate.i.ready)]
        _stream_link(m, "tx_cdc", tx_gate.o, tx_bytes.i, beat_layout(self.width),
                     "sync", self.tx_domain)
        wiring.connect(m, tx_bytes.o, tx_mac.i)
        m.d.comb += [self.txd.eq(tx_mac.txd), self.tx_en.eq(tx_mac.tx_en),
                     self.tx_er.eq(tx_mac.tx_er)]

        # Receive: framing -> beats -> [clock crossing] -> gate (good frames only).
        m.submodules.rx_mac = rx_mac = on_rx(MacRx(max_frame=self.max_frame))
        m.submodules.rx_beats = rx_beats = on_rx(BytesToBeats(self.width))
        m.submodules.rx_gate = rx_gate = FrameGate(self.width, depth)
        m.d.comb += [rx_mac.rxd.eq(self.rxd), rx_mac.rx_dv.eq(self.rx_dv),
                     rx_mac.rx_er.eq(self.rx_er)]
        wiring.connect(m, rx_mac.o, rx_beats.i)
        _stream_link(m, "rx_cdc", rx_beats.o, rx_gate.i, rx_beat_layout(self.width),
                     self.rx_domain, "sync")
        wiring.connect(m, rx_gate.o, wiring.flipped(self.rx))
        m.d.comb += self.rx_frames.eq(rx_gate.frames)
        return m
