"""One floating-point multiplier lane: IEEE 754 round-to-nearest-even, subnormals in
and out."""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .common import FloatFormat, Unpacked, leading_zeros, shift_right_sticky


class FloatMul(wiring.Component):
    """``o = a * b`` after :attr:`latency` cycles, one operation per cycle.

    Stage 1 multiplies the significands (the DSP stage), stage 2 normalises the
    product (left for subnormal inputs, right with sticky for subnormal results),
    stage 3 rounds and packs.
    """

    latency = 3

    def __init__(self, fmt: FloatFormat) -> None:
        self.fmt = fmt
        super().__init__({
            "a": In(fmt.width),
            "b": In(fmt.width),
            "o": Out(fmt.width),
        })

    def elaborate(self, platform) -> Module:
        m = Module()
        f = self.fmt
        p = f.p
        exp_w = f.e + 3                 # signed room for ea + eb - bias, both ways

        a, b = Unpacked(m, f, self.a), Unpacked(m, f, self.b)
        sign = a.sign ^ b.sign
        special_val = Signal(f.width)
        inf = Cat(Const(0, f.m), Const(f.exp_max, f.e), sign)
        with m.If(a.is_nan):
            m.d.comb += special_val.eq(a.quieted)
        with m.Elif(b.is_nan):
            m.d.comb += special_val.eq(b.quieted)
        with m.Elif((a.is_inf & b.is_zero) | (a.is_zero & b.is_inf)):
            m.d.comb += special_val.eq(f.default_nan)
        with m.Elif(a.is_inf | b.is_inf):
            m.d.comb += special_val.eq(inf)
        with m.Else():
            m.d.comb += special_val.eq(Cat(Const(0, f.width - 1), sign))

        # Stage 1: significand product and the exponent of its bit 2p-2 (value 1.0).
        s1_special = Signal()
        s1_special_val = Signal(f.width)
        s1_prod = Signal(2 * p)
        s1_exp = Signal(signed(exp_w))
        s1_sign = Signal()
        m.d.sync += [
            s1_special.eq(a.is_nan | b.is_nan | a.is_inf | b.is_inf | a.is_zero | b.is_zero),
            s1_special_val.eq(special_val),
            s1_prod.eq(a.sig * b.sig),
            s1_exp.eq(a.exp_eff + b.exp_eff - f.bias),
            s1_sign.eq(sign),
        ]

        # Stage 2: bring the leading one to the top bit; the biased exponent of the
        # result is then exp + 1 - lz. Below the minimum exponent, shift right instead
        # and let the sticky bit remember what fell off.
        lz = leading_zeros(m, s1_prod)
        exp_n = Signal(signed(exp_w))
        m.d.comb += exp_n.eq(s1_exp + 1 - lz)
        normed = Signal(2 * p)
        m.d.comb += normed.eq(s1_prod << lz)
        under = Signal(range(2 * p + 2))
        m.d.comb += under.eq(Mux(exp_n < 1, Mux(exp_n < -2 * p, 2 * p + 1, 1 - exp_n), 0))
        shifted, lost = shift_right_sticky(m, normed, under)
        s2_norm = Signal(2 * p)
        s2_lost = Signal()
        s2_exp = Signal(signed(exp_w))
        s2_special = Signal()
        s2_special_val = Signal(f.width)
        s2_sign = Signal()
        m.d.sync += [
            s2_norm.eq(shifted), s2_lost.eq(lost),
            s2_exp.eq(Mux(exp_n < 1, 1, exp_n)),
            s2_special.eq(s1_special), s2_special_val.eq(s1_special_val), s2_sign.eq(s1_sign),
        ]

        # Stage 3: round to nearest even and pack, as in the adder: the rounded
        # significand (hidden bit included) added onto exp - 1.
        mant = s2_norm[p:]
        guard = s2_norm[p - 1]
        rest = s2_norm[:p - 1].any() | s2_lost
        rounded = mant + (guard & (rest | mant[0]))
        mag = Signal(signed(exp_w + f.m + 2))
        m.d.comb += mag.eq(((s2_exp - 1) << f.m) + rounded)
        overflow = mag[f.m:].as_signed() >= f.exp_max
        with m.If(s2_special):
            m.d.sync += self.o.eq(s2_special_val)
        with m.Elif(overflow):
            m.d.sync += self.o.eq(Cat(Const(0, f.m), Const(f.exp_max, f.e), s2_sign))
        with m.Else():
            m.d.sync += self.o.eq(Cat(mag[:f.width - 1], s2_sign))
        return m
