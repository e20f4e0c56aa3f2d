"""The reliable transport of one node: requester + responder between the RoCEv2
parser/builder and the DMA.

Receive: ``rx_hdr`` (header record, transport half) and ``rx_data`` (payload beats,
realigned to byte 0, present only when ``payload_len`` is not zero) from the parser.
ACK/NAK headers go to the requester, everything else to the responder.

Transmit: ``tx_hdr`` carries the requester's data-packet headers and the responder's
ACK/NAKs (ACKs first when both wait, since they carry no payload and unblock the peer);
``tx_data`` carries the payload of data packets, in header order. The builder takes the
peer's MAC/IP from QP context ``tx_hdr.qp``.

Memory: ``wr`` (responder writes), ``rd_req``/``rd_resp`` (requester reads). Both are
simple request/response streams that the DMA issue puts AXI behind.

CSR: ``qp_ctl``/``mr_ctl`` are exactly the CSR bank's ports of the same names (wire
``bank.qp_ctl`` to ``transport.qp_ctl``), ``qp_sts`` its ``qp_sts``; ``drops`` is
indexed by :class:`~fpgaccl.proto.drops.DropReason` (only the transport's reasons count
here: BAD_QPN, WRONG_SOURCE, UNKNOWN_OPCODE, PSN_DUPLICATE, PSN_OUT_OF_ORDER, BAD_RKEY,
OUT_OF_BOUNDS, ACCESS_DENIED, ACK_PSN_INVALID).
"""

from __future__ import annotations

from amaranth.hdl import Module
from amaranth.lib import data, stream, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.stream.beat import beat_stream
from fpgaccl.proto.drops import DROP_COUNTER_BITS, DropReason
from fpgaccl.proto.opcodes import Opcode

from .layouts import (
    HDR,
    MEM_READ_REQ,
    RECV_CMPL,
    WRITE_CMPL,
    WRITE_DESC,
    mem_write_layout,
    mr_ctl_layout,
    qp_ctl_layout,
    qp_sts_layout,
)
from .requester import Requester
from .responder import N_DROPS, Responder

STATS = ("tx_packets", "retransmits", "timeouts", "naks_rx", "accepted", "acks_tx", "naks_tx")


class Transport(wiring.Component):
    def __init__(self, width: int, *, nqp: int = 8, nmr: int = 8, mtu: int = 4096,
                 window: int = 64, ackreq_every: int = 16, ack_every: int = 16,
                 timeout: int = 1 << 14, max_retries: int = 7) -> None:
        self.width = width
        self.nqp = nqp
        self.nmr = nmr
        self.mtu = mtu
        self.requester = Requester(width, nqp=nqp, mtu=mtu, window=window,
                                   ackreq_every=ackreq_every, timeout=timeout,
                                   max_retries=max_retries)
        self.responder = Responder(width, nqp=nqp, nmr=nmr, ack_every=ack_every)
        members = {
            "rx_hdr": In(stream.Signature(HDR)),
            "rx_data": In(beat_stream(width)),
            "tx_hdr": Out(stream.Signature(HDR)),
            "tx_data": Out(beat_stream(width)),
            "desc": In(stream.Signature(WRITE_DESC)),
            "cmpl": Out(stream.Signature(WRITE_CMPL)),
            "recv": Out(stream.Signature(RECV_CMPL)),
            "wr": Out(stream.Signature(mem_write_layout(width))),
            "rd_req": Out(stream.Signature(MEM_READ_REQ)),
            "rd_resp": In(beat_stream(width)),
            "qp_ctl": In(qp_ctl_layout(nqp)),
            "mr_ctl": In(mr_ctl_layout(nmr)),
            "qp_sts": Out(qp_sts_layout(nqp)),
            "qp_error": Out(nqp),
            "drops": Out(data.ArrayLayout(DROP_COUNTER_BITS, N_DROPS)),
        }
        members.update({name: Out(32) for name in STATS})
        super().__init__(members)

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.requester = req = self.requester
        m.submodules.responder = rsp = self.responder

        m.d.comb += [req.qp_ctl.eq(self.qp_ctl), rsp.qp_ctl.eq(self.qp_ctl),
                     rsp.mr_ctl.eq(self.mr_ctl), self.qp_sts.eq(req.qp_sts),
                     self.qp_error.eq(req.qp_error)]
        wiring.connect(m, wiring.flipped(self.desc), req.desc)
        wiring.connect(m, wiring.flipped(self.cmpl), req.cmpl)
        wiring.connect(m, wiring.flipped(self.recv), rsp.cmpl)
        wiring.connect(m, wiring.flipped(self.wr), rsp.wr)
        wiring.connect(m, wiring.flipped(self.rd_req), req.rd_req)
        wiring.connect(m, wiring.flipped(self.rd_resp), req.rd_resp)
        wiring.connect(m, wiring.flipped(self.tx_data), req.data)
        wiring.connect(m, wiring.flipped(self.rx_data), rsp.data)
        for name in ("tx_packets", "retransmits", "timeouts", "naks_rx"):
            m.d.comb += getattr(self, name).eq(getattr(req, name))
        for name in ("accepted", "acks_tx", "naks_tx"):
            m.d.comb += getattr(self, name).eq(getattr(rsp, name))
        m.d.comb += self.drops.eq(rsp.drops)
        # ACKs to an unknown QPN are counted with the data packets' BAD_QPN drops.
        m.d.comb += self.drops[DropReason.BAD_QPN].eq(
            rsp.drops[DropReason.BAD_QPN] + req.bad_qpn)
        m.d.comb += self.drops[DropReason.ACK_PSN_INVALID].eq(req.ack_psn_invalid)
        m.d.comb += self.drops[DropReason.WRONG_SOURCE].eq(
            rsp.drops[DropReason.WRONG_SOURCE] + req.wrong_source)

        # Receive router: ACKs carry no payload, so the split needs no payload steering.
        is_ack = self.rx_hdr.payload.bth.opcode == Opcode.ACKNOWLEDGE
        m.d.comb += [
            req.ack.payload.eq(self.rx_hdr.payload),
            rsp.hdr.payload.eq(self.rx_hdr.payload),
            req.ack.valid.eq(self.rx_hdr.valid & is_ack),
            rsp.hdr.valid.eq(self.rx_hdr.valid & ~is_ack),
            self.rx_hdr.ready.eq(is_ack & req.ack.ready | ~is_ack & rsp.hdr.ready),
        ]

        # Transmit header merge, registered; ACKs win.
        free = ~self.tx_hdr.valid | self.tx_hdr.ready
        with m.If(self.tx_hdr.ready):
            m.d.sync += self.tx_hdr.valid.eq(0)
        with m.If(free):
            with m.If(rsp.ack.valid):
                m.d.comb += rsp.ack.ready.eq(1)
                m.d.sync += [self.tx_hdr.valid.eq(1), self.tx_hdr.payload.eq(rsp.ack.payload)]
            with m.Elif(req.hdr.valid):
                m.d.comb += req.hdr.ready.eq(1)
                m.d.sync += [self.tx_hdr.valid.eq(1), self.tx_hdr.payload.eq(req.hdr.payload)]
        return m
