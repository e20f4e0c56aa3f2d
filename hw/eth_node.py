"""The node behind its network boundary: :class:`~fpgaccl.hw.eth.l2.EthServices` in
front of :class:`~fpgaccl.hw.node.Node`.

    rx -> EthServices -> roce_rx -> node.rx      (ARP, ICMP echo, control answered aside)
    tx <- EthServices <- roce_tx <- node.tx
          control endpoint -> CSR (straps, counters) -> node.csr
          control endpoint + node memory masters -> ReadMux/WriteMux -> memory port

``rx``/``tx`` are the MAC's beat side (frames without preamble or FCS): a simulation
drives them directly, a board puts :class:`~fpgaccl.hw.eth.gmii.Gmii` in front.

The control endpoint is the node's only CSR master: a network-attached node has no other
host (no PCIe BAR), and the CSR bus has no stall, so a second master would need an
arbiter that loses strobes or a bus change. The node's own bank does not see the
boundary's drop counters (it reads :data:`~fpgaccl.proto.drops.ETH_DROPS` as zero), so
reads of ``drops.not_for_us``, ``drops.control_key`` and ``drops.control_malformed`` are
answered here from :class:`EthServices`, clear-on-write as the bank's counters are.

Addresses: ``mac``/``ip`` are straps, loaded at reset into the node's ``port`` registers
(so RoCE frames leave with them) and into the services' copy; later writes of those
registers through the control port move both.
"""

from __future__ import annotations

from amaranth.hdl import Module, Mux, Signal
from amaranth.lib import data, wiring
from amaranth.lib.wiring import In, Out

from fpgaccl.proto.drops import DROP_COUNTER_BITS

from .datapath.memport import ReadMux, WriteMux, memory_ports
from .eth.l2 import EthServices
from .eth.symbols import RxDrop
from .node import Node
from .stream.beat import beat_layout, beat_stream
from .stream.skid import SkidBuffer
from .transport.layouts import mem_write_layout

COUNTERS = ("not_for_us", "control_key", "control_malformed", "service_busy")
"""The drop registers this top answers (EthServices' outputs of the same names)."""

MAC_COUNTERS = {RxDrop.BAD_FCS: "bad_fcs", RxDrop.RUNT: "runt", RxDrop.PHY_ERROR: "phy_error",
                RxDrop.OVERFLOW: "rx_overflow"}
"""The drop registers answered from the MAC's verdict counters (``mac_frames``) when the
node sits behind a MAC in the same design (a board); RxDrop.OVERSIZE is left to the
parser's counter of the same reason."""


class EthNode(wiring.Component):
    """``node`` keyword arguments are :class:`Node`'s; ``key`` and ``mem_log2`` the
    control endpoint's (``mem_log2`` should be the memory behind ``rd_req``/``wr``).
    ``mac_counters``: a ``mac_frames`` input takes the MAC's per-verdict frame counts
    (:attr:`~fpgaccl.hw.eth.mac.Mac.rx_frames`, in ``sync``), read as the drop
    registers of :data:`MAC_COUNTERS`. ``info``: HELLO fields to override
    (:data:`~fpgaccl.proto.control.INFO`, e.g. a board's ``clock_ps``)."""

    def __init__(self, width: int = 64, *, key: int = 0, mem_log2: int = 32,
                 mac_counters: bool = False, info: dict[str, int] | None = None,
                 **node) -> None:
        self.width, self.key, self.mem_log2 = width, key, mem_log2
        self.info = dict(info or {})
        self.mac_counters = mac_counters
        self.node = Node(width, arp=True, **node)
        extra = ({"mac_frames": In(data.ArrayLayout(DROP_COUNTER_BITS, len(RxDrop)))}
                 if mac_counters else {})
        super().__init__({
            **extra,
            "rx": In(beat_stream(width)),
            "tx": Out(beat_stream(width)),
            "mac": In(48),
            "ip": In(32),
            **memory_ports(width, 1, 1),
            "done": Out(1),
            "busy": Out(1),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        w = self.width
        m.submodules.node = node = self.node
        m.submodules.svc = svc = EthServices(
            w, control={"key": self.key, "mem_log2": self.mem_log2, "mtu": self.node.mtu,
                        **self.info})
        wiring.connect(m, wiring.flipped(self.rx), svc.rx)
        wiring.connect(m, svc.tx, wiring.flipped(self.tx))
        wiring.connect(m, svc.roce_rx, node.rx)
        wiring.connect(m, node.tx, svc.roce_tx)
        m.d.comb += [self.done.eq(node.done), self.busy.eq(node.busy),
                     svc.lookup_ip.eq(node.arp_lookup_ip),
                     node.arp_lookup_hit.eq(svc.lookup_hit),
                     node.arp_lookup_mac.eq(svc.lookup_mac),
                     svc.ask.eq(node.arp_ask), svc.ask_ip.eq(node.arp_ask_ip),
                     node.arp_ask_taken.eq(svc.ask_taken)]

        self._csr(m, node, svc)

        m.submodules.rmux = rmux = ReadMux(w, 2)
        m.submodules.wmux = wmux = WriteMux(w, 2)
        for i, (rq, rs, wr) in enumerate(((node.rd_req, node.rd_resp, node.wr),
                                          (svc.rd_req, svc.rd_resp, svc.wr))):
            wiring.connect(m, rq, getattr(rmux, f"req{i}"))
            wiring.connect(m, getattr(rmux, f"resp{i}"), rs)
            wiring.connect(m, wr, getattr(wmux, f"wr{i}"))
        wiring.connect(m, rmux.req, wiring.flipped(self.rd_req))
        # Register slices between the muxes and the memory: the muxes' picks and the
        # readers' ready chains stay out of the block RAM's address, enable and data
        # paths. A write lands a cycle later; a read of it cannot be asked sooner (the
        # read mux registers its requests).
        m.submodules.rd_slice = rd_slice = SkidBuffer(beat_layout(w))
        m.submodules.wr_slice = wr_slice = SkidBuffer(mem_write_layout(w))
        wiring.connect(m, wiring.flipped(self.rd_resp), rd_slice.i)
        wiring.connect(m, rd_slice.o, rmux.resp)
        wiring.connect(m, wmux.wr, wr_slice.i)
        wiring.connect(m, wr_slice.o, wiring.flipped(self.wr))
        return m

    def _csr(self, m: Module, node: Node, svc: EthServices) -> None:
        rmap = node.regmap
        a_lo, a_hi, a_ip = (rmap.address(f"port.{r}") for r in ("mac_lo", "mac_hi", "ip"))
        bus = svc.csr
        mac, ip = Signal(48), Signal(32)
        m.d.comb += [svc.mac.eq(mac), svc.ip.eq(ip)]

        # After reset, three cycles write the straps into the bank; the endpoint cannot
        # strobe that early (a request takes longer than that to arrive).
        step = Signal(range(4))
        with m.If(step < 3):
            m.d.sync += step.eq(step + 1)
            m.d.comb += node.csr.w_stb.eq(1)
            with m.Switch(step):
                with m.Case(0):
                    m.d.comb += [node.csr.addr.eq(a_lo), node.csr.w_data.eq(self.mac[:32])]
                    m.d.sync += [mac.eq(self.mac), ip.eq(self.ip)]
                with m.Case(1):
                    m.d.comb += [node.csr.addr.eq(a_hi), node.csr.w_data.eq(self.mac[32:])]
                with m.Case(2):
                    m.d.comb += [node.csr.addr.eq(a_ip), node.csr.w_data.eq(self.ip)]
        with m.Else():
            m.d.comb += [node.csr.addr.eq(bus.addr), node.csr.w_stb.eq(bus.w_stb),
                         node.csr.w_data.eq(bus.w_data), node.csr.r_stb.eq(bus.r_stb)]
            with m.If(bus.w_stb), m.Switch(bus.addr):
                with m.Case(a_lo):
                    m.d.sync += mac[:32].eq(bus.w_data)
                with m.Case(a_hi):
                    m.d.sync += mac[32:].eq(bus.w_data[:16])
                with m.Case(a_ip):
                    m.d.sync += ip.eq(bus.w_data)

        # The boundary's counters: the count since the last write (clear-on-write).
        r_data = node.csr.r_data
        counts = {name: getattr(svc, name) for name in COUNTERS}
        if self.mac_counters:
            counts.update({name: self.mac_frames[v.value] for v, name in MAC_COUNTERS.items()})
        for name, count in counts.items():
            addr = rmap.address(f"drops.{name}")
            base = Signal(DROP_COUNTER_BITS, name=f"{name}_base")
            picked = Signal(name=f"{name}_read")   # answered the cycle after the strobe
            m.d.sync += picked.eq(bus.r_stb & (bus.addr == addr))
            with m.If(bus.w_stb & (bus.addr == addr)):
                m.d.sync += base.eq(count)
            r_data = Mux(picked, (count - base)[:32], r_data)
        m.d.comb += bus.r_data.eq(r_data)
