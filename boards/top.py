"""What a board build puts on the chip: the node configuration, and the core a board
builds from it -- :class:`fpgaccl.hw.node.Node` (:func:`node_factory`) on the ECP5 and
Xilinx boards, the reduced :class:`EngineCore` on the iCE40.

A board top never names the core class: each board carries a *core factory*
(``NodeConfig -> Component``) whose product has Node's ports -- ``rx``
(``In(beat_stream(width))``), ``tx`` (``Out(beat_stream(width))``) and ``csr``
(``In(CSRBusSignature(16))``), the memory ports ``wr``/``rd_req``/``rd_resp`` when it has
them, and ``busy``/``done`` or ``activity`` (``Out(8)``) for the LEDs.

Why the iCE40 keeps a reduced top: the smallest Node (64-bit: the parser, builder and
transport need whole 64-bit words; int32 sum only; 1 QP, 1 region, 64 program words)
synthesises to far more than the UP5K's 5280 logic cells -- see :data:`SMALL` for the
measured figure. :class:`EngineCore` is what fits:

* the CSR bank generated from ``proto.regmap.default_map(qps, regions, imem_words)``,
  less what only the missing transport and router read (:func:`core_regmap`), with the
  sequencer's program memory;
* the sequencer, fetching from that program memory, started by the doorbell;
* a reduction datapath built from the committed lanes (:mod:`fpgaccl.hw.reduce`) for the
  configured dtype/op subset, reducing every received beat with a beat of a local
  buffer and sending the result (the local buffer stands in for the memory port);
* stand-ins for what is missing, each small and named: the transport's receive events
  come from the first bytes of each received packet, and the sequencer's commands are
  acknowledged at once and folded into a parity byte on ``activity`` -- so the logic that
  computes them is kept by synthesis, instead of a consumer that does not exist.

Not in it: parser/builder, transport, router, copy/reduce engines.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from amaranth.hdl import Cat, Const, EnableInserter, Module, Mux, Signal, Value
from amaranth.lib import memory, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.hw.csr.bank import CSRBank
from fpgaccl.hw.csr.bus import CSRBusSignature
from fpgaccl.hw.reduce.common import FloatFormat
from fpgaccl.hw.reduce.float_add import FloatAdd
from fpgaccl.hw.reduce.float_minmax import FloatMinMax
from fpgaccl.hw.reduce.float_mul import FloatMul
from fpgaccl.hw.reduce.int_lane import IntLane
from fpgaccl.hw.sequencer.command import PEER_BITS, STEP_BITS
from fpgaccl.hw.sequencer.engine import Sequencer
from fpgaccl.hw.stream.beat import SUPPORTED_WIDTHS, beat_stream
from fpgaccl.proto.reduce import DTYPE_BITS, OP_BITS, DType, ReduceOp
from fpgaccl.proto.regmap import ENGINE_ID, REGMAP_VERSION, RegisterMap, default_map

CSR_ADDR_WIDTH = 16
# The lanes the datapath can be built from; bitwise ops need no lane and are not offered.
LANE_OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)


@dataclass(frozen=True)
class NodeConfig:
    """Build-time parameters of a node. Every one changes the hardware, so every one is
    part of the build plan (and so of the bitstream cache key).

    width       beat width in bits (``hw.stream.beat.SUPPORTED_WIDTHS``); network,
                reduction and local-buffer datapath all run at it, one beat per cycle.
    qps         queue pairs: copies of the QP context registers, and the sequencer's
                peer count (one peer per QP).
    regions     memory regions (copies of the MR registers).
    imem_words  sequencer program memory, 32-bit words (two per instruction).
    dtypes      element types the reduction datapath has lanes for.
    ops         operators it has lanes for; with a single op the op register is
                ignored and synthesis drops the others' logic.
    local_beats depth of the on-chip RAM that stands in for the memory port (Node) or
                of EngineCore's local buffer.
    dma         whether the build has the DMA engine; without it the register map
                leaves out the ``dma*`` blocks (they read as zero). No board build has
                it yet (the memory port is on-chip RAM), so every preset says False.
    ip, mac     the node's addresses after reset, on boards where the node is on
                Ethernet (:func:`eth_node_factory`); ``mac`` None: 02:fc:cc and the
                IP's low three bytes, so two boards differ by ``--ip`` alone.
    """

    width: int = 64
    qps: int = 8
    regions: int = 8
    imem_words: int = 256
    dtypes: tuple[DType, ...] = (DType.INT32, DType.FLOAT32)
    ops: tuple[ReduceOp, ...] = LANE_OPS
    local_beats: int = 256
    dma: bool = True
    ip: str = "192.168.10.50"
    mac: str | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        if self.width not in SUPPORTED_WIDTHS:
            raise ValueError(f"width {self.width} not in {SUPPORTED_WIDTHS}")
        if not 1 <= self.qps <= (1 << PEER_BITS):
            raise ValueError(f"qps must be 1..{1 << PEER_BITS}, not {self.qps}")
        if not self.dtypes or not self.ops:
            raise ValueError("a node needs at least one dtype and one op")
        for d in self.dtypes:
            if d.bits > self.width:
                raise ValueError(f"{d.name} ({d.bits} bits) does not fit a {self.width}-bit beat")
        for op in self.ops:
            if op not in LANE_OPS:
                raise ValueError(f"op {op.name} has no lane (supported: "
                                 f"{', '.join(o.name.lower() for o in LANE_OPS)})")
        if self.imem_words < 2 or self.imem_words & (self.imem_words - 1):
            raise ValueError("imem_words must be a power of two >= 2")
        if self.local_beats < 2 or self.local_beats & (self.local_beats - 1):
            raise ValueError("local_beats must be a power of two >= 2")
        try:
            ipaddress.IPv4Address(self.ip)
        except ValueError:
            raise ValueError(f"ip: not an IPv4 address: {self.ip!r}") from None
        if self.mac is not None and not re.fullmatch(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}",
                                                     self.mac):
            raise ValueError(f"mac: not a MAC address (aa:bb:cc:dd:ee:ff): {self.mac!r}")

    @property
    def ip_int(self) -> int:
        return int(ipaddress.IPv4Address(self.ip))

    @property
    def mac_int(self) -> int:
        if self.mac is None:
            return 0x02FCCC << 24 | (self.ip_int & 0xFFFFFF)
        return int(self.mac.replace(":", ""), 16)

    @property
    def memory_bytes(self) -> int:
        return self.local_beats * self.width // 8

    def regmap(self) -> RegisterMap:
        full = default_map(qps=self.qps, regions=self.regions, imem_words=self.imem_words)
        if self.dma:
            return full
        return RegisterMap(tuple(b for b in full if not b.name.startswith("dma")))

    def replace(self, **changes) -> NodeConfig:
        from dataclasses import replace
        return replace(self, **changes)

    def describe(self) -> str:
        return (f"{self.width}-bit, {self.qps} QPs, {self.regions} MRs, imem "
                f"{self.imem_words} words, dtypes {'+'.join(d.name.lower() for d in self.dtypes)},"
                f" ops {'+'.join(o.name.lower() for o in self.ops)}, local buffer "
                f"{self.local_beats} beats{'' if self.dma else ', no DMA registers'}")


# The iCE40 UP5K has 5280 logic cells, and the register file is most of EngineCore's
# flip-flops (each QP adds its qp + peer blocks, ~600 FFs): one QP, one region, no DMA
# engine, one 32-bit int lane. Two QPs need ~6000 cells (measured: 7023 with DMA).
# The full Node does not fit at any setting (see boards/README.md for the numbers).
SMALL = NodeConfig(width=32, qps=1, regions=1, imem_words=64, dtypes=(DType.INT32,),
                   ops=(ReduceOp.SUM,), local_beats=64, dma=False, name="small")
# The ECP5 target: 64-bit, int32 + float32 with every lane op.
FULL = NodeConfig(width=64, qps=8, regions=8, imem_words=256,
                  dtypes=(DType.INT32, DType.FLOAT32), ops=LANE_OPS, local_beats=256,
                  dma=False, name="full")
# The ECPIX-5 node on Ethernet: FULL with 256 KiB of node memory (32,768 64-bit beats:
# 128 of the 85F's 208 DP16KD; the node itself uses ~20).
ETH = FULL.replace(local_beats=1 << 15, name="full-eth")
# A 100G MAC delivers 512-bit beats.
WIDE = FULL.replace(width=512, name="wide")


def _delay(m: Module, v: Value, cycles: int, name: str) -> Value:
    for i in range(cycles):
        r = Signal(len(v), name=f"{name}_d{i}")
        m.d.sync += r.eq(v)
        v = r
    return v


class ReduceLanes(wiring.Component):
    """``o = a op b`` element-wise for the configured dtypes/ops, :attr:`latency` cycles
    later, every register advancing every cycle (stall it with an EnableInserter).

    The committed ``hw.reduce.unit`` is not used because it is not committed yet and
    always builds every dtype (and needs 64-bit multiples); once it takes a dtype/op
    subset, :meth:`EngineCore._reduce` becomes a one-line switch to it.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        lat = []
        for d in config.dtypes:
            if d.is_float:
                lat += [{ReduceOp.SUM: FloatAdd.latency, ReduceOp.PROD: FloatMul.latency}
                        .get(op, FloatMinMax.latency) for op in config.ops]
            else:
                lat.append(IntLane.latency)
        self.lane_latency = max(lat)
        self.latency = self.lane_latency + 1
        super().__init__({
            "a": In(config.width),
            "b": In(config.width),
            "dtype": In(DTYPE_BITS),
            "op": In(OP_BITS),
            "o": Out(config.width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        cfg = self.config
        width = cfg.width
        # A single op is a build-time constant, so unused lanes (multipliers) vanish.
        op = Const(cfg.ops[0], OP_BITS) if len(cfg.ops) == 1 else self.op
        results: list[tuple[DType, ReduceOp | None, Value]] = []

        def lanes(tag, bits, make, latency, **ctl):
            out = Signal(width, name=tag)
            for i in range(width // bits):
                lane = make()
                m.submodules[f"{tag}_{i}"] = lane
                sl = slice(i * bits, (i + 1) * bits)
                m.d.comb += [lane.a.eq(self.a[sl]), lane.b.eq(self.b[sl]), out[sl].eq(lane.o)]
                for k, v in ctl.items():
                    m.d.comb += getattr(lane, k).eq(v)
            return _delay(m, out, self.lane_latency - latency, tag)

        for d in cfg.dtypes:
            name = d.name.lower()
            if not d.is_float:
                results.append((d, None, lanes(name, d.bits, lambda d=d: IntLane(d.bits),
                                               IntLane.latency, op=op, is_signed=d.is_signed)))
                continue
            fmt = FloatFormat(d.info.exp_bits, d.info.frac_bits)
            if ReduceOp.SUM in cfg.ops:
                results.append((d, ReduceOp.SUM, lanes(
                    f"{name}_add", d.bits, lambda fmt=fmt: FloatAdd(fmt), FloatAdd.latency)))
            if ReduceOp.PROD in cfg.ops:
                results.append((d, ReduceOp.PROD, lanes(
                    f"{name}_mul", d.bits, lambda fmt=fmt: FloatMul(fmt), FloatMul.latency)))
            if ReduceOp.MIN in cfg.ops or ReduceOp.MAX in cfg.ops:
                results.append((d, ReduceOp.MIN, lanes(
                    f"{name}_minmax", d.bits, lambda fmt=fmt: FloatMinMax(fmt),
                    FloatMinMax.latency, is_max=op == ReduceOp.MAX)))

        dtype_d = _delay(m, self.dtype, self.lane_latency, "dtype")
        op_d = _delay(m, op, self.lane_latency, "op")
        if len(results) == 1:
            m.d.sync += self.o.eq(results[0][2])
            return m
        # Codes outside the subset give the first result: cheaper than a zero case, and
        # the host only writes codes the build advertises.
        m.d.sync += self.o.eq(results[0][2])
        with m.Switch(dtype_d):
            for d in cfg.dtypes:
                mine = [(o, v) for dd, o, v in results if dd is d]
                with m.Case(d):
                    if len(mine) == 1:
                        m.d.sync += self.o.eq(mine[0][1])
                        continue
                    with m.Switch(op_d):
                        for o, v in mine:
                            cases = (ReduceOp.MIN, ReduceOp.MAX) if o is ReduceOp.MIN else (o,)
                            with m.Case(*cases):
                                m.d.sync += self.o.eq(v)
        return m


ROUTER_ONLY = frozenset({"sig_lo", "sig_hi", "mismatch_peer", "peer_sig_lo", "peer_sig_hi"})
"""``coll`` registers of the router's signature check, which :class:`EngineCore` has not."""
TRANSPORT_ONLY = frozenset({"qp", "mr"})
"""Blocks of the transport's context, which :class:`EngineCore` has not either."""


def core_regmap(config: NodeConfig) -> RegisterMap:
    """The register map :class:`EngineCore` serves: ``config``'s, less what only its
    missing router and transport read (:data:`ROUTER_ONLY`, :data:`TRANSPORT_ONLY`), as
    the DMA blocks are left out of a build without DMA: flops that no logic reads, and
    at 89 % of the UP5K's cells they made routing, and then 12 MHz, a matter of luck."""
    return RegisterMap(tuple(
        replace(b, registers=tuple(r for r in b.registers if r.name not in ROUTER_ONLY))
        if b.name == "coll" else b for b in config.regmap() if b.name not in TRANSPORT_ONLY))


class EngineCore(wiring.Component):
    """The interim node top (see the module docstring): Node's ports, committed blocks."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        super().__init__({
            "rx": In(beat_stream(config.width)),
            "tx": Out(beat_stream(config.width)),
            "csr": In(CSRBusSignature(CSR_ADDR_WIDTH)),
            "activity": Out(8),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        cfg = self.config
        m.submodules.bank = bank = CSRBank(core_regmap(cfg), CSR_ADDR_WIDTH)
        wiring.connect(m, wiring.flipped(self.csr), bank.bus)
        ctl = bank.ctrl_ctl
        sts = bank.ctrl_sts
        m.d.comb += [sts.id.value.eq(ENGINE_ID), sts.version.value.eq(REGMAP_VERSION)]

        m.submodules.seq = seq = Sequencer(imem_words=cfg.imem_words, peers=cfg.qps)
        m.d.comb += [
            bank.imem_raddr.eq(seq.imem_raddr),
            seq.imem_rdata.eq(bank.imem_rdata),
            seq.start.eq(bank.ctrl_wstb.doorbell & ctl.control.enable),
            seq.entry.eq(ctl.doorbell.entry),
            seq.coll_id.eq(ctl.doorbell.coll_id),
            seq.count.eq(bank.coll_ctl.count.value),
            sts.status.busy.eq(seq.busy),
            sts.status.error.eq(seq.error),
        ]
        completions = Signal(32)
        with m.If(bank.ctrl_clr.completions):
            m.d.sync += completions.eq(0)
        with m.Elif(seq.done):
            m.d.sync += completions.eq(completions + 1)
        m.d.comb += sts.completions.value.eq(completions)

        # Stand-in datapath: every command is done the cycle after it is taken, and its
        # fields are folded into a parity byte so synthesis keeps what computes them.
        cmd_done = Signal()
        parity = Signal(8)
        m.d.comb += [seq.cmd.ready.eq(1), seq.cmd_done.eq(cmd_done)]
        m.d.sync += cmd_done.eq(seq.cmd.valid)
        with m.If(seq.cmd.valid):
            bits = seq.cmd.payload.as_value()
            fold = Const(0, 8)
            for i in range(0, len(bits), 8):
                fold = fold ^ bits[i:i + 8]
            m.d.sync += parity.eq(Cat(parity[7], parity[:7]) ^ fold)
        m.d.comb += self.activity.eq(parity)

        self._datapath(m, bank, seq)
        return m

    def _reduce(self) -> ReduceLanes:
        return ReduceLanes(self.config)

    def _datapath(self, m: Module, bank: CSRBank, seq: Sequencer) -> None:
        cfg = self.config
        rx, tx = self.rx, self.tx
        advance = Signal()
        m.d.comb += [advance.eq(~tx.valid | tx.ready), rx.ready.eq(advance)]
        take = rx.valid & rx.ready

        # Receive events: the transport's stand-in. Byte 0 of a packet names the peer,
        # bytes 1-2 the step, bit 31 says grant (1) or landed message (0).
        head = rx.payload.data
        for port, is_grant in ((seq.grant, 1), (seq.landed, 0)):
            m.d.sync += [port.valid.eq(take & rx.payload.first & (head[31] == is_grant)),
                         port.payload.peer.eq(head[0:PEER_BITS]),
                         port.payload.step.eq(head[8:8 + STEP_BITS])]

        # Local buffer, indexed by beat number in the packet: b = local[i]; the result
        # goes out on tx and back into local[i] (an accumulator in place of memory).
        m.submodules.local = local = memory.Memory(shape=cfg.width, depth=cfg.local_beats,
                                                   init=[])
        rd = local.read_port()
        wr = local.write_port()
        idx = Signal(range(cfg.local_beats))
        with m.If(take):
            m.d.sync += idx.eq(Mux(rx.payload.last, 0, idx + 1))
        m.d.comb += [rd.addr.eq(idx), rd.en.eq(advance)]

        lanes = self._reduce()
        m.submodules.lanes = EnableInserter(advance)(lanes)
        a = Signal(cfg.width)
        with m.If(advance):
            m.d.sync += a.eq(head)
        reduce_ctl = bank.ctrl_ctl.reduce
        m.d.comb += [lanes.a.eq(a), lanes.b.eq(rd.data),
                     lanes.dtype.eq(reduce_ctl.dtype), lanes.op.eq(reduce_ctl.op)]

        # Valid, framing and the buffer index ride alongside, stalled by the same enable.
        prev = Cat(take, rx.payload.keep, rx.payload.first, rx.payload.last, idx)
        for i in range(1 + lanes.latency):
            r = Signal(len(prev), name=f"side_{i}")
            with m.If(advance):
                m.d.sync += r.eq(prev)
            prev = r
        kw = len(rx.payload.keep)
        m.d.comb += [
            tx.valid.eq(prev[0]),
            tx.payload.data.eq(lanes.o),
            tx.payload.keep.eq(prev[1:1 + kw]),
            tx.payload.first.eq(prev[1 + kw]),
            tx.payload.last.eq(prev[2 + kw]),
            wr.addr.eq(prev[3 + kw:]),
            wr.data.eq(lanes.o),
            wr.en.eq(tx.valid & tx.ready),
        ]


def node_factory(config: NodeConfig) -> wiring.Component:
    """:class:`fpgaccl.hw.node.Node` for ``config``: its reduction unit built for
    ``config.dtypes`` x ``config.ops``; no DMA engine (``ctrl.features.dma`` reads 0)."""
    from fpgaccl.hw.node import Node
    if config.dma:
        raise ValueError("config: board builds have no DMA engine yet (dma=False)")
    return Node(config.width, qps=config.qps, regions=config.regions,
                imem_words=config.imem_words, dtypes=config.dtypes, ops=config.ops)


ECP5_NODE_CLOCK_PS = 10_000
"""The ECP5 boards clock the node from their 100 MHz oscillator."""


def eth_node_factory(config: NodeConfig) -> wiring.Component:
    """:class:`fpgaccl.hw.eth_node.EthNode` for ``config``: the node behind ARP, ICMP
    echo and the control port (its only CSR master: no UART), reaching the whole
    ``config.memory_bytes`` of on-chip memory, counting the MAC's drops, its HELLO
    giving the node clock (:data:`ECP5_NODE_CLOCK_PS`); the key is set by the first
    HELLO that carries one (proto/control.py)."""
    from fpgaccl.hw.eth_node import EthNode
    if config.dma:
        raise ValueError("config: board builds have no DMA engine yet (dma=False)")
    return EthNode(config.width, mem_log2=config.memory_bytes.bit_length() - 1,
                   mac_counters=True, info={"clock_ps": ECP5_NODE_CLOCK_PS},
                   qps=config.qps, regions=config.regions,
                   imem_words=config.imem_words, dtypes=config.dtypes, ops=config.ops)


CoreFactory = Callable[[NodeConfig], wiring.Component]
