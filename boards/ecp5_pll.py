"""An ECP5 PLL (EHXPLLL) giving one clock twice: ``clk`` and ``clk_shifted``, the same
frequency a fixed phase later -- what an RGMII transmitter needs (data launched on
``clk``, TX_CLK forwarded from ``clk_shifted``).

Dividers (ECP5 sysCLOCK guide, TN1263): the phase detector compares
``f_in / CLKI_DIV`` with the feedback ``f_out / CLKFB_DIV`` (feedback from CLKOP), so
``f_out = f_in * CLKFB_DIV / CLKI_DIV``; the VCO runs at ``f_out * CLKOP_DIV`` and must
stay within 400-800 MHz; an output's phase is set in whole VCO cycles (``CPHASE``) plus
eighths of one (``FPHASE``), counted from ``DIV - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from amaranth.hdl import Const, Instance, Module
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

VCO_MHZ = (400.0, 800.0)
PFD_MHZ = (3.125, 400.0)


@dataclass(frozen=True)
class PllParams:
    clki_div: int
    clkfb_div: int
    out_div: int          # CLKOP_DIV = CLKOS_DIV
    shift_cycles: int     # VCO cycles CLKOS lags CLKOP
    shift_eighths: int    # and eighths of one
    vco_mhz: float

    @property
    def phase_deg(self) -> float:
        return (self.shift_cycles + self.shift_eighths / 8) / self.out_div * 360.0


def pll_params(f_in_mhz: float, f_out_mhz: float, phase_deg: float) -> PllParams:
    """Exact dividers for ``f_out`` from ``f_in`` with CLKOS ``phase_deg`` behind
    CLKOP (to the nearest eighth of a VCO cycle); the highest VCO that works (finest
    phase steps). Raises ValueError naming what cannot be met."""
    if not 0 <= phase_deg < 360:
        raise ValueError(f"phase_deg must be in [0, 360), not {phase_deg}")
    best = None
    for clki_div in range(1, 129):
        pfd = f_in_mhz / clki_div
        if not PFD_MHZ[0] <= pfd <= PFD_MHZ[1]:
            continue
        fb = f_out_mhz / pfd
        clkfb_div = round(fb)
        if not 1 <= clkfb_div <= 128 or abs(clkfb_div - fb) > 1e-9:
            continue
        for out_div in range(1, 129):
            vco = f_out_mhz * out_div
            if VCO_MHZ[0] <= vco <= VCO_MHZ[1] and (best is None or vco > best.vco_mhz):
                steps = round(phase_deg / 360.0 * out_div * 8)
                best = PllParams(clki_div, clkfb_div, out_div, steps // 8, steps % 8, vco)
    if best is None:
        raise ValueError(f"f_out_mhz: no ECP5 PLL setting makes {f_out_mhz} MHz from "
                         f"{f_in_mhz} MHz exactly")
    return best


class Ecp5Pll(wiring.Component):
    """``clk``/``clk_shifted`` at ``f_out_mhz`` from ``clk_in`` at ``f_in_mhz``;
    ``lock`` high once both are stable."""

    def __init__(self, f_in_mhz: float, f_out_mhz: float, phase_deg: float) -> None:
        self.f_in_mhz, self.f_out_mhz = f_in_mhz, f_out_mhz
        self.params = pll_params(f_in_mhz, f_out_mhz, phase_deg)
        super().__init__({"clk_in": In(1), "clk": Out(1), "clk_shifted": Out(1),
                          "lock": Out(1)})

    def elaborate(self, platform) -> Module:
        m = Module()
        p = self.params
        base = p.out_div - 1
        f = f"{self.f_out_mhz:.6f}"
        m.submodules.pll = Instance(
            "EHXPLLL",
            p_PLLRST_ENA="DISABLED", p_INTFB_WAKE="DISABLED", p_STDBY_ENABLE="DISABLED",
            p_DPHASE_SOURCE="DISABLED", p_OUTDIVIDER_MUXA="DIVA", p_OUTDIVIDER_MUXB="DIVB",
            p_CLKI_DIV=p.clki_div, p_FEEDBK_PATH="CLKOP", p_CLKFB_DIV=p.clkfb_div,
            p_CLKOP_ENABLE="ENABLED", p_CLKOP_DIV=p.out_div, p_CLKOP_CPHASE=base,
            p_CLKOP_FPHASE=0,
            p_CLKOS_ENABLE="ENABLED", p_CLKOS_DIV=p.out_div,
            p_CLKOS_CPHASE=base + p.shift_cycles, p_CLKOS_FPHASE=p.shift_eighths,
            i_CLKI=self.clk_in, i_CLKFB=self.clk, i_RST=Const(0), i_STDBY=Const(0),
            i_PHASESEL0=Const(0), i_PHASESEL1=Const(0), i_PHASEDIR=Const(1),
            i_PHASESTEP=Const(1), i_PHASELOADREG=Const(1), i_PLLWAKESYNC=Const(0),
            i_ENCLKOP=Const(0), i_ENCLKOS=Const(0),
            o_CLKOP=self.clk, o_CLKOS=self.clk_shifted, o_LOCK=self.lock,
            a_FREQUENCY_PIN_CLKI=f"{self.f_in_mhz:.6f}", a_FREQUENCY_PIN_CLKOP=f,
            a_FREQUENCY_PIN_CLKOS=f, a_ICP_CURRENT="12", a_LPF_RESISTOR="8",
            a_MFG_ENABLE_FILTEROPAMP="1", a_MFG_GMCREF_SEL="2")
        return m
