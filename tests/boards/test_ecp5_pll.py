"""The ECP5 PLL's dividers: exact frequency, the VCO in range, the phase in eighths."""

import pytest

from fpgaccl.boards.ecp5_pll import VCO_MHZ, Ecp5Pll, pll_params


@pytest.mark.parametrize("f_in,f_out,phase", [(100, 125, 90), (100, 125, 0), (25, 125, 90),
                                               (25, 100, 180)])
def test_pll_params_are_exact(f_in, f_out, phase):
    p = pll_params(f_in, f_out, phase)
    assert f_in / p.clki_div * p.clkfb_div == pytest.approx(f_out)
    assert VCO_MHZ[0] <= p.vco_mhz <= VCO_MHZ[1]
    assert p.vco_mhz == pytest.approx(f_out * p.out_div)
    assert abs(p.phase_deg - phase) <= 360 / (8 * p.out_div) / 2


def test_rgmii_pll_from_the_ecpix5_oscillator():
    # 100 MHz -> 125 MHz: 25 MHz at the phase detector, VCO 750 MHz; 90 degrees is
    # 2 ns = 1.5 VCO cycles.
    p = pll_params(100, 125, 90)
    assert (p.clki_div, p.clkfb_div, p.out_div) == (4, 5, 6)
    assert (p.shift_cycles, p.shift_eighths) == (1, 4) and p.phase_deg == 90


def test_pll_refuses_what_it_cannot_make():
    with pytest.raises(ValueError, match="f_out_mhz"):
        pll_params(100, 1000, 0)           # above the VCO
    with pytest.raises(ValueError, match="phase_deg"):
        Ecp5Pll(100, 125, 360)
