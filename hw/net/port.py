"""One network port's RoCEv2 framing: the receive parser and the transmit builder side
by side (what the node top instantiates per port; also the shared simulation build)."""

from __future__ import annotations

from amaranth.hdl import Module
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.drops import DROP_COUNTER_BITS

from ..stream.beat import beat_stream
from .builder import RoceBuilder
from .parser import N_DROP_COUNTERS, RoceParser
from .record import RECORD


class NetPort(wiring.Component):
    """``rx`` frames -> ``rx_hdr`` + ``rx_payload`` (with drop counters);
    ``tx_hdr`` + ``tx_payload`` -> ``tx`` frames."""

    def __init__(self, width: int, *, max_payload: int = 4096) -> None:
        self.width = width
        self.max_payload = max_payload
        super().__init__({
            "rx": In(beat_stream(width)),
            "rx_hdr": Out(stream.Signature(RECORD)),
            "rx_payload": Out(beat_stream(width)),
            "drops": Out(data.ArrayLayout(DROP_COUNTER_BITS, N_DROP_COUNTERS)),
            "oversize": Out(DROP_COUNTER_BITS),
            "accepted": Out(DROP_COUNTER_BITS),
            "tx_hdr": In(stream.Signature(RECORD)),
            "tx_payload": In(beat_stream(width)),
            "tx": Out(beat_stream(width)),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.parser = p = RoceParser(self.width, max_payload=self.max_payload)
        m.submodules.builder = b = RoceBuilder(self.width)
        wiring.connect(m, wiring.flipped(self.rx), p.i)
        wiring.connect(m, p.hdr, wiring.flipped(self.rx_hdr))
        wiring.connect(m, p.o, wiring.flipped(self.rx_payload))
        wiring.connect(m, wiring.flipped(self.tx_hdr), b.hdr)
        wiring.connect(m, wiring.flipped(self.tx_payload), b.i)
        wiring.connect(m, b.o, wiring.flipped(self.tx))
        m.d.comb += [self.drops.eq(p.drops), self.oversize.eq(p.oversize),
                     self.accepted.eq(p.accepted)]
        return m
