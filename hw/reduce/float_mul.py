"""One floating-point multiplier lane: IEEE 754 round-to-nearest-even, subnormals in
and out."""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal, signed
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .common import FloatFormat, Unpacked, leading_zeros, shift_right_sticky


class FloatMul(wiring.Component):
    """``o = a * b`` after :attr:`latency` cycles, one operation per cycle.

    Stage 1a forms the four partial products of the significands' halves (the DSP
    stage) and, beside them, counts each operand's leading zeros (nonzero only for
    subnormal inputs); stage 1b adds the partial products; stage 2 shifts the
    product left by their sum, which leaves at most one more bit to normalise, and
    picks how far a subnormal result must go right; stages 3a/3b do that right shift
    (whole bytes, then bits) with sticky; stage 4a decides the rounding, 4b rounds and
    packs. (One 48-bit
    leading-zero count, a left and a right shift in one cycle was the deepest path of
    the node's reduction unit; so was the DSP's product summed in the cycle it formed.)
    """

    latency = 7

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

        # Stage 1a: the partial products of the significands' halves, each within one
        # DSP block, the exponent of the product's bit 2p-2 (value 1.0), and the leading
        # zeros of the two significands (only subnormals have any).
        h = (p + 1) // 2
        a_lo, a_hi, b_lo, b_hi = a.sig[:h], a.sig[h:], b.sig[:h], b.sig[h:]
        pp_ll = Signal(2 * h)
        pp_lh = Signal(p)
        pp_hl = Signal(p)
        pp_hh = Signal(2 * (p - h))
        s1a_special = Signal()
        s1a_special_val = Signal(f.width)
        s1a_exp = Signal(signed(exp_w))
        s1a_sign = Signal()
        s1a_lz = Signal(range(2 * p + 1))
        lz_a = leading_zeros(m, a.sig)
        lz_b = leading_zeros(m, b.sig)
        m.d.sync += [
            pp_ll.eq(a_lo * b_lo), pp_lh.eq(a_lo * b_hi), pp_hl.eq(a_hi * b_lo),
            pp_hh.eq(a_hi * b_hi),
            s1a_special.eq(a.is_nan | b.is_nan | a.is_inf | b.is_inf | a.is_zero | b.is_zero),
            s1a_special_val.eq(special_val),
            s1a_exp.eq(a.exp_eff + b.exp_eff - f.bias),
            s1a_sign.eq(sign),
            s1a_lz.eq(lz_a + lz_b),
        ]

        # Stage 1b: the product. The outer partial products do not overlap, so they
        # concatenate; only the two cross products are added in.
        s1_special = Signal()
        s1_special_val = Signal(f.width)
        s1_prod = Signal(2 * p)
        s1_exp = Signal(signed(exp_w))
        s1_sign = Signal()
        s1_lz = Signal(range(2 * p + 1))
        m.d.sync += [
            s1_prod.eq(Cat(pp_ll, pp_hh) + ((pp_lh + pp_hl) << h)),
            s1_special.eq(s1a_special), s1_special_val.eq(s1a_special_val),
            s1_exp.eq(s1a_exp), s1_sign.eq(s1a_sign), s1_lz.eq(s1a_lz),
        ]

        # Stage 2: a product of significands with lz_a and lz_b leading zeros has lz_a +
        # lz_b or one more (zero operands are specials): shift by the sum, then by one if
        # the top bit is still clear. The biased exponent of the result is exp + 1 - lz;
        # below the minimum exponent the significand must go right by 1 - exp (at most
        # 2p + 1, past which only the sticky bit is left): both candidates are worked out
        # beside the shifter and picked with it.
        pre = Signal(2 * p)
        m.d.comb += pre.eq(s1_prod << s1_lz)
        fix = Signal()
        m.d.comb += fix.eq(~pre[-1])
        normed = Signal(2 * p)
        m.d.comb += normed.eq(Mux(fix, pre << 1, pre))
        e0 = Signal(signed(exp_w))
        m.d.comb += e0.eq(s1_exp + 1 - s1_lz)

        def underflow(e):
            u = Signal(range(2 * p + 2))
            m.d.comb += u.eq(Mux(e < 1, Mux(e < -2 * p, 2 * p + 1, 1 - e), 0))
            return u

        u0, u1 = underflow(e0), underflow(e0 - 1)
        e1 = Signal(signed(exp_w))
        m.d.comb += e1.eq(e0 - 1)
        s2_norm = Signal(2 * p)
        s2_under = Signal(range(2 * p + 2))
        s2_exp = Signal(signed(exp_w))
        s2_special = Signal()
        s2_special_val = Signal(f.width)
        s2_sign = Signal()
        m.d.sync += [
            s2_norm.eq(normed), s2_under.eq(Mux(fix, u1, u0)),
            s2_exp.eq(Mux(fix, Mux(e1 < 1, 1, e1), Mux(e0 < 1, 1, e0))),
            s2_special.eq(s1_special), s2_special_val.eq(s1_special_val), s2_sign.eq(s1_sign),
        ]

        # Stage 3a/3b: the subnormal result's right shift, whole bytes first, then the
        # rest; the sticky bit remembers what fell off in either.
        n = 2 * p
        amt = Signal(range(n + 1))
        m.d.comb += amt.eq(Mux(s2_under > n, n, s2_under))
        coarse = Cat(Const(0, 3), amt[3:])
        s3a_norm = Signal(n)
        s3a_fine = Signal(3)
        s3a_lost = Signal()
        s3a_exp = Signal(signed(exp_w))
        s3a_special = Signal()
        s3a_special_val = Signal(f.width)
        s3a_sign = Signal()
        m.d.sync += [
            s3a_norm.eq(s2_norm >> coarse), s3a_fine.eq(amt[:3]),
            s3a_lost.eq((s2_norm & ((Const(1, n + 1) << coarse) - 1)).any()),
            s3a_exp.eq(s2_exp), s3a_special.eq(s2_special),
            s3a_special_val.eq(s2_special_val), s3a_sign.eq(s2_sign),
        ]
        shifted, lost = shift_right_sticky(m, s3a_norm, s3a_fine)
        s3_norm = Signal(n)
        s3_lost = Signal()
        s3_exp = Signal(signed(exp_w))
        s3_special = Signal()
        s3_special_val = Signal(f.width)
        s3_sign = Signal()
        m.d.sync += [
            s3_norm.eq(shifted), s3_lost.eq(lost | s3a_lost), s3_exp.eq(s3a_exp),
            s3_special.eq(s3a_special), s3_special_val.eq(s3a_special_val),
            s3_sign.eq(s3a_sign),
        ]

        # Stage 4a: the round-to-nearest-even decision.
        mant = s3_norm[p:]
        guard = s3_norm[p - 1]
        rest = s3_norm[:p - 1].any() | s3_lost
        s4_mant = Signal(p)
        s4_up = Signal()
        s4_exp = Signal(signed(exp_w))
        s4_special = Signal()
        s4_special_val = Signal(f.width)
        s4_sign = Signal()
        m.d.sync += [
            s4_mant.eq(mant), s4_up.eq(guard & (rest | mant[0])), s4_exp.eq(s3_exp),
            s4_special.eq(s3_special), s4_special_val.eq(s3_special_val), s4_sign.eq(s3_sign),
        ]

        # Stage 4b: round and pack, as in the adder: the rounded significand (hidden bit
        # included) added onto exp - 1.
        rounded = s4_mant + s4_up
        mag = Signal(signed(exp_w + f.m + 2))
        m.d.comb += mag.eq(((s4_exp - 1) << f.m) + rounded)
        overflow = mag[f.m:].as_signed() >= f.exp_max
        with m.If(s4_special):
            m.d.sync += self.o.eq(s4_special_val)
        with m.Elif(overflow):
            m.d.sync += self.o.eq(Cat(Const(0, f.m), Const(f.exp_max, f.e), s4_sign))
        with m.Else():
            m.d.sync += self.o.eq(Cat(mag[:f.width - 1], s4_sign))
        return m
