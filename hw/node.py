"""The node: one network port, one CSR port and one memory port around the whole engine.

    rx -> parser -> transport (responder) -> memory writes ---------------+
                      |  ACK/NAK, received messages -> router -> sequencer |
    tx <- builder <- transport (requester) <- memory reads <- router <-----+
                                   copy/reduce engines <-> memory
    csr -> register bank: QP contexts, memory regions, collective context, peers,
           program memory, doorbell, drop counters

The memory port is the simple in-order request/answer pair of
:mod:`fpgaccl.hw.datapath.memport`; :mod:`fpgaccl.hw.dma` puts the bus, address spaces
and GPU-peer window behind it. Every register comes from :mod:`fpgaccl.proto.regmap`.

With ``split_memory`` each datapath master gets its own channel instead
(:data:`READ_CHANNELS`, :data:`WRITE_CHANNELS`: ``rd_req``/``rd_resp``/``wr`` then
``rd_req1``..., ``wr1``...), for memories with several independent channels (HBM
pseudo-channels, on-chip banks). A ring allreduce step moves three read and two write
beats per link beat (send, land, reduce ``a`` and ``b``, write back), so on one shared
port the node cannot keep its link busy; on split channels each master runs at one beat
per cycle and the reduction reads ``a`` and ``b`` side by side.

The node's bank holds the map without the DMA blocks (no flops for registers nothing
reads); :class:`fpgaccl.hw.dma_node.DmaNode` serves those from a bank of its own and
builds its node with ``dma=True``, which only sets ``ctrl.features.dma``. ``dtypes`` /
``ops`` restrict the reduction unit to a subset (board builds); ``ctrl.features`` and
``ctrl.config`` tell the host what was built.
"""

from __future__ import annotations

from pathlib import Path

from amaranth.hdl import Cat, Module, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bank import CSRBank
from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.datapath.engines import CopyEngine, ReduceEngine
from fpgaccl.hw.datapath.memport import ReadMux, WriteMux, channel_names, memory_ports
from fpgaccl.hw.datapath.router import N_BUFS, Router
from fpgaccl.hw.eth.resolver import PeerResolver
from fpgaccl.hw.net.builder import RoceBuilder
from fpgaccl.hw.net.parser import RoceParser
from fpgaccl.hw.sequencer.engine import Sequencer
from fpgaccl.hw.stream.beat import beat_layout, beat_stream
from fpgaccl.hw.stream.skid import SkidBuffer
from fpgaccl.hw.transport.transport import Transport
from fpgaccl.proto.drops import DROP_COUNTER_BITS, ETH_DROPS, DropReason
from fpgaccl.proto.headers import IPV4
from fpgaccl.proto.opcodes import ETHERTYPE_IPV4, IP_PROTO_UDP, ROCEV2_UDP_PORT
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import (
    ENGINE_ID,
    REGMAP_VERSION,
    config_word,
    default_map,
    features_word,
)

BUFS = ("in", "out", "tmp", "tmp2")
READ_CHANNELS = ("transport", "copy", "reduce_a", "reduce_b")
WRITE_CHANNELS = ("transport", "copy", "reduce")


class Node(wiring.Component):
    def __init__(self, width: int = 64, *, qps: int = 8, regions: int = 8,
                 imem_words: int = 512, mtu: int = 4096, seg_bytes: int = 4096,
                 timeout: int = 1 << 14, dtypes=None, ops=None, dma: bool = False,
                 split_memory: bool = False, arp: bool = False) -> None:
        if qps < 2:
            # The bank gives a block with one copy a plain struct, not an array, and the
            # node indexes the QP contexts by the transmitting QP's number. (One region
            # is fine: nothing indexes the region block by a signal.)
            raise ValueError(f"qps: a node needs at least 2 queue pairs, not {qps}")
        self.width, self.qps, self.regions = width, qps, regions
        self.imem_words, self.mtu, self.seg_bytes, self.timeout = (
            imem_words, mtu, seg_bytes, timeout)
        self.dtypes = tuple(DType) if dtypes is None else tuple(dtypes)
        self.ops = tuple(ReduceOp) if ops is None else tuple(ops)
        self.dma = dma
        self.split_memory = split_memory
        self.arp = arp
        self.regmap = default_map(qps=qps, regions=regions, imem_words=imem_words, dma=False)
        nr, nw = (len(READ_CHANNELS), len(WRITE_CHANNELS)) if split_memory else (1, 1)
        memory = memory_ports(width, nr, nw)
        super().__init__({
            "rx": In(beat_stream(width)),
            "tx": Out(beat_stream(width)),
            "csr": In(CSRBusSignature(16)),
            **memory,
            "done": Out(1),       # a collective program reached DONE (interrupt)
            "busy": Out(1),
            # With ``arp``: a QP whose peer MAC register is zero sends to the MAC the
            # network boundary's ARP table holds for its peer (PeerResolver).
            **({"arp_lookup_ip": Out(32), "arp_lookup_hit": In(1), "arp_lookup_mac": In(48),
                "arp_ask": Out(1), "arp_ask_ip": Out(32), "arp_ask_taken": In(1)}
               if arp else {}),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        # The read-back tree cut into 16 registered parts (see CSRBank): the bank's
        # read-back was among the node's deepest paths on the ECP5.
        m.submodules.bank = bank = CSRBank(self.regmap, read_parts=16)
        m.submodules.parser = parser = RoceParser(w, max_payload=self.mtu)
        m.submodules.builder = builder = RoceBuilder(w)
        m.submodules.transport = tp = Transport(w, nqp=self.qps, nmr=self.regions,
                                                mtu=self.mtu, timeout=self.timeout)
        m.submodules.seq = seq = Sequencer(imem_words=self.imem_words, peers=self.qps)
        m.submodules.router = router = Router(self.qps)
        m.submodules.copy = copy = CopyEngine(w, self.seg_bytes)
        m.submodules.reduce = red = ReduceEngine(w, self.seg_bytes, dtypes=self.dtypes,
                                                 ops=self.ops,
                                                 read_ports=2 if self.split_memory else 1)

        wiring.connect(m, wiring.flipped(self.csr), bank.bus)

        # Network receive: parser -> transport (of L2-L4 it needs only the IPv4 source).
        wiring.connect(m, wiring.flipped(self.rx), parser.i)
        rec = parser.hdr.payload
        for f in ("bth", "reth", "aeth", "immdt", "has_reth", "has_aeth", "has_immdt",
                  "payload_len"):
            m.d.comb += getattr(tp.rx_hdr.payload, f).eq(getattr(rec, f))
        m.d.comb += tp.rx_hdr.payload.src_ip.eq(rec.ip.src)
        m.d.comb += [tp.rx_hdr.valid.eq(parser.hdr.valid), parser.hdr.ready.eq(tp.rx_hdr.ready)]
        # The payload FIFO's block-RAM output through a register slice: its clock-to-out
        # started the node's deepest path (payload `last` -> the header FIFO's pop ->
        # the requester's ACK decode).
        m.submodules.rx_skid = rx_skid = SkidBuffer(beat_layout(w))
        wiring.connect(m, parser.o, rx_skid.i)
        wiring.connect(m, rx_skid.o, tp.rx_data)

        # Network transmit: the QP context supplies the peer's addresses.
        th = tp.tx_hdr.payload
        out = builder.hdr.payload
        qp = bank.qp_ctl[th.qp]
        port = bank.port_ctl
        for f in ("bth", "reth", "aeth", "immdt", "has_reth", "has_aeth", "has_immdt",
                  "payload_len"):
            m.d.comb += getattr(out, f).eq(getattr(th, f))
        if self.arp:
            m.submodules.resolver = res = PeerResolver(self.qps)
            for i, q in enumerate(bank.qp_ctl):
                m.d.comb += [res.peer_ip[i].eq(q.peer_ip.value),
                             res.static_mac[i].eq(Cat(q.peer_mac_lo.value, q.peer_mac_hi.mac_hi))]
            m.d.comb += [self.arp_lookup_ip.eq(res.lookup_ip),
                         res.lookup_hit.eq(self.arp_lookup_hit),
                         res.lookup_mac.eq(self.arp_lookup_mac),
                         self.arp_ask.eq(res.ask), self.arp_ask_ip.eq(res.ask_ip),
                         res.ask_taken.eq(self.arp_ask_taken),
                         out.eth.dst.eq(res.dst[th.qp])]
        else:
            m.d.comb += out.eth.dst.eq(Cat(qp.peer_mac_lo.value, qp.peer_mac_hi.mac_hi))
        m.d.comb += [
            out.eth.src.eq(Cat(port.mac_lo.value, port.mac_hi.mac_hi)),
            out.eth.type.eq(ETHERTYPE_IPV4),
            *(getattr(out.ip, f).eq(IPV4[f].default) for f in ("version", "ihl", "flags", "ttl")),
            out.ip.proto.eq(IP_PROTO_UDP), out.ip.src.eq(port.ip.value),
            out.ip.dst.eq(qp.peer_ip.value),
            out.udp.sport.eq(port.udp_sport.sport + th.qp),
            out.udp.dport.eq(ROCEV2_UDP_PORT),
            builder.hdr.valid.eq(tp.tx_hdr.valid), tp.tx_hdr.ready.eq(builder.hdr.ready),
        ]
        wiring.connect(m, tp.tx_data, builder.i)
        wiring.connect(m, builder.o, wiring.flipped(self.tx))

        # Control: CSR bank <-> transport, sequencer, router.
        m.d.comb += [tp.qp_ctl.eq(bank.qp_ctl), tp.mr_ctl.eq(bank.mr_ctl),
                     bank.qp_sts.eq(tp.qp_sts)]
        coll = bank.coll_ctl
        m.d.comb += [
            bank.imem_raddr.eq(seq.imem_raddr), seq.imem_rdata.eq(bank.imem_rdata),
            seq.start.eq(bank.ctrl_wstb.doorbell & bank.ctrl_ctl.control.enable),
            seq.entry.eq(bank.ctrl_ctl.doorbell.entry),
            seq.coll_id.eq(bank.ctrl_ctl.doorbell.coll_id),
            seq.count.eq(coll.count.value),
            router.coll_id.eq(bank.ctrl_ctl.doorbell.coll_id),
            router.ctx.dtype.eq(bank.ctrl_ctl.reduce.dtype),
            router.ctx.op.eq(bank.ctrl_ctl.reduce.op),
            router.ctx.sig.eq(Cat(coll.sig_lo.value, coll.sig_hi.value)),
            router.start.eq(seq.start),
            seq.abort.eq(router.mismatch),
            seq.keep_grants.eq(router.ahead),
            seq.abort_peer.eq(router.mismatch_peer),
            bank.coll_sts.mismatch_peer.peer.eq(router.mismatch_peer),
            bank.coll_sts.peer_sig_lo.value.eq(router.mismatch_sig[:32]),
            bank.coll_sts.peer_sig_hi.value.eq(router.mismatch_sig[32:]),
            bank.ctrl_sts.id.value.eq(ENGINE_ID),
            bank.ctrl_sts.version.value.eq(REGMAP_VERSION),
            bank.ctrl_sts.status.busy.eq(seq.busy),
            bank.ctrl_sts.status.error.eq(seq.error | router.error),
            bank.ctrl_sts.status.cause.eq(seq.error_code),
            bank.ctrl_sts.status.datapath.eq(router.error),
            bank.ctrl_sts.features.as_value().eq(
                features_word(dma=self.dma, dtypes=self.dtypes, ops=self.ops)),
            bank.ctrl_sts.config.as_value().eq(
                config_word(qps=self.qps, regions=self.regions, imem_words=self.imem_words,
                            width=self.width, mtu=self.mtu)),
            self.done.eq(seq.done), self.busy.eq(seq.busy),
        ]
        for i, b in enumerate(BUFS):
            m.d.comb += router.ctx.base[i].eq(Cat(getattr(coll, f"{b}_lo").value,
                                                  getattr(coll, f"{b}_hi").value))
            for p in range(self.qps):
                peer = bank.peer_ctl[p]
                m.d.comb += [
                    router.ctx.rbase[p][i].eq(Cat(getattr(peer, f"{b}_lo").value,
                                                  getattr(peer, f"{b}_hi").value)),
                    router.ctx.rkey[p][i].eq(getattr(peer, f"{b}_key").value),
                ]
        assert len(BUFS) == N_BUFS
        completions = Signal(32)
        with m.If(bank.ctrl_clr.completions):
            m.d.sync += completions.eq(0)
        with m.Elif(seq.done):
            m.d.sync += completions.eq(completions + 1)
        m.d.comb += bank.ctrl_sts.completions.value.eq(completions)

        # Drop counters: the parser counts the frame-level reasons, the transport the
        # rest; each reason has exactly one owner. The network boundary's reasons
        # (hw/eth) read zero: this node has no MAC yet, its frames arrive checked.
        for reason in DropReason:
            if reason is DropReason.OVERSIZE:
                m.d.comb += bank.drops_sts.oversize.value.eq(parser.oversize)
                continue
            if reason in ETH_DROPS:
                m.d.comb += getattr(bank.drops_sts, reason.name.lower()).value.eq(0)
                continue
            src = []
            if reason < len(parser.drops):
                src.append(parser.drops[reason])
            if reason < len(tp.drops):
                src.append(tp.drops[reason])
            total = sum(src[1:], src[0]) if src else 0
            m.d.comb += getattr(bank.drops_sts, reason.name.lower()).value.eq(
                total[:DROP_COUNTER_BITS] if src else 0)

        # Sequencer <-> router <-> engines and transport.
        wiring.connect(m, seq.cmd, router.cmd)
        m.d.comb += [seq.cmd_done.eq(router.cmd_done), seq.drained.eq(router.idle)]
        wiring.connect(m, router.grant, seq.grant)
        wiring.connect(m, router.landed, seq.landed)
        wiring.connect(m, router.copy_job, copy.job)
        wiring.connect(m, router.reduce_job, red.job)
        m.d.comb += [router.copy_done.eq(copy.done), router.reduce_done.eq(red.done)]
        wiring.connect(m, router.desc, tp.desc)
        wiring.connect(m, tp.cmpl, router.cmpl)
        wiring.connect(m, tp.recv, router.recv)

        readers = [(tp.rd_req, tp.rd_resp), (copy.rd_req, copy.rd_resp),
                   (red.rd_req, red.rd_resp)]
        writers = [tp.wr, copy.wr, red.wr]
        if self.split_memory:
            readers.append((red.rd_req_b, red.rd_resp_b))
            for (rq, rs), req, resp in zip(readers, channel_names("rd_req", len(readers)),
                                           channel_names("rd_resp", len(readers)), strict=True):
                wiring.connect(m, rq, wiring.flipped(getattr(self, req)))
                wiring.connect(m, wiring.flipped(getattr(self, resp)), rs)
            for wr, name in zip(writers, channel_names("wr", len(writers)), strict=True):
                wiring.connect(m, wr, wiring.flipped(getattr(self, name)))
            return m

        # Memory: three readers and three writers share the node's memory port.
        m.submodules.rmux = rmux = ReadMux(w, len(readers))
        m.submodules.wmux = wmux = WriteMux(w, len(writers))
        for i, (rq, rs) in enumerate(readers):
            wiring.connect(m, rq, getattr(rmux, f"req{i}"))
            wiring.connect(m, getattr(rmux, f"resp{i}"), rs)
        for i, wr in enumerate(writers):
            wiring.connect(m, wr, getattr(wmux, f"wr{i}"))
        wiring.connect(m, rmux.req, wiring.flipped(self.rd_req))
        wiring.connect(m, wiring.flipped(self.rd_resp), rmux.resp)
        wiring.connect(m, wmux.wr, wiring.flipped(self.wr))
        return m


LINT_WAIVERS = Path(__file__).resolve().parent / "lint" / "verilator.vlt"


def export_verilog(width: int = 64, *, name: str = "fpgaccl_node", **params) -> str:
    """The whole node as Verilog: module ``name`` and its submodules (``name.bank``, ...)
    in one text, as Amaranth exports it through yosys; for vendor flows and for
    Verilator lint (``python -m fpgaccl.hw.node``). ``params`` are :class:`Node`'s."""
    from amaranth.back import verilog
    return verilog.convert(Node(width, **params), name=name, emit_src=False)


def lint_command(path: Path, *, top: str = "fpgaccl_node") -> list[str]:
    """``verilator --lint-only -Wall`` of an export at ``path`` (a file named
    ``fpgaccl_*node*.v``, e.g. ``fpgaccl_node.v`` or ``fpgaccl_dma_node.v``: the waivers
    in :data:`LINT_WAIVERS` are scoped to that name); ``top`` is the exported module."""
    return ["verilator", "--lint-only", "-Wall", "--top-module", top, str(LINT_WAIVERS),
            str(path)]


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import subprocess
    ap = argparse.ArgumentParser(description="Export the node as Verilog (and lint it)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--qps", type=int, default=8)
    ap.add_argument("-o", "--output", type=Path, default=Path("fpgaccl_node.v"))
    ap.add_argument("--lint", action="store_true",
                    help="run Verilator --lint-only -Wall with the project's waivers")
    args = ap.parse_args(argv)
    args.output.write_text(export_verilog(args.width, qps=args.qps))
    if not args.lint:
        return 0
    from fpgaccl.hw.toolchain import verilator_env
    return subprocess.run(lint_command(args.output), env=verilator_env()).returncode


if __name__ == "__main__":
    raise SystemExit(_main())
