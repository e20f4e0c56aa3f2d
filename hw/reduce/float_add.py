"""One floating-point adder lane: IEEE 754 round-to-nearest-even, subnormals in and out."""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal
from amaranth.lib import wiring
from amaranth.lib.wiring import In, Out

from .common import FloatFormat, Unpacked, leading_zeros


class FloatAdd(wiring.Component):
    """``o = a + b`` after :attr:`latency` cycles, one operation per cycle.

    Classic three-extra-bit (guard, round, sticky) datapath: order the operands by
    magnitude, align the smaller, add or subtract, normalise, round. Six register
    stages so each carries one of the wide operations (compare, align shift, add,
    leading zero count, normalising shift, rounding increment).
    """

    latency = 6

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
        p, e_w = f.p, f.e
        ext = p + 3                               # significand + guard, round, sticky

        # Stage 1: classify, order by magnitude, exponent difference.
        a, b = Unpacked(m, f, self.a), Unpacked(m, f, self.b)
        swap = Signal()
        m.d.comb += swap.eq(b.mag > a.mag)
        # Both exponent differences are computed beside the magnitude compare and the
        # compare only picks: the subtraction is not after it.
        d_ab, d_ba = Signal(e_w), Signal(e_w)
        m.d.comb += [d_ab.eq(a.exp_eff - b.exp_eff), d_ba.eq(b.exp_eff - a.exp_eff)]

        special = Signal()
        special_val = Signal(f.width)
        with m.If(a.is_nan):
            m.d.comb += special_val.eq(a.quieted)
        with m.Elif(b.is_nan):
            m.d.comb += special_val.eq(b.quieted)
        with m.Elif(a.is_inf & b.is_inf & (a.sign != b.sign)):
            m.d.comb += special_val.eq(f.default_nan)
        with m.Elif(a.is_inf):
            m.d.comb += special_val.eq(self.a)
        with m.Else():
            m.d.comb += special_val.eq(self.b)

        s1_special = Signal()
        s1_special_val = Signal(f.width)
        s1_sig_big = Signal(p)
        s1_sig_small = Signal(p)
        s1_diff = Signal(e_w)
        s1_exp = Signal(e_w)
        s1_sign = Signal()
        s1_sub = Signal()
        m.d.comb += special.eq(a.is_nan | b.is_nan | a.is_inf | b.is_inf)
        m.d.sync += [
            s1_special.eq(special),
            s1_special_val.eq(special_val),
            s1_sig_big.eq(Mux(swap, b.sig, a.sig)),
            s1_sig_small.eq(Mux(swap, a.sig, b.sig)),
            # Clamped to the aligned width here (beside the compare), so stage 2a's
            # shift and sticky start from a 5-bit amount.
            s1_diff.eq(Mux(swap, Mux(d_ba > ext, ext, d_ba), Mux(d_ab > ext, ext, d_ab))),
            s1_exp.eq(Mux(swap, b.exp_eff, a.exp_eff)),
            s1_sign.eq(Mux(swap, b.sign, a.sign)),
            s1_sub.eq(a.sign ^ b.sign),
        ]

        # Stage 2a: align the smaller operand (sticky keeps what falls off). The sticky
        # bit is the OR of the bits below the amount, beside the shift rather than after
        # it, and goes into the sum's bit 0 in stage 2b.
        v = Cat(Const(0, 3), s1_sig_small)
        s1a_small = Signal(ext)
        s1a_sticky = Signal()
        s1a_big = Signal(p)
        below = Cat(s1_diff > i for i in range(ext))      # 1 where bit i falls off
        m.d.sync += [s1a_small.eq(v >> s1_diff), s1a_sticky.eq((v & below).any()),
                     s1a_big.eq(s1_sig_big)]
        s1a = {name: Signal(len(sig), name=f"s1a_{name}") for name, sig in
               (("special", s1_special), ("special_val", s1_special_val), ("exp", s1_exp),
                ("sign", s1_sign), ("sub", s1_sub))}
        m.d.sync += [s1a["special"].eq(s1_special), s1a["special_val"].eq(s1_special_val),
                     s1a["exp"].eq(s1_exp), s1a["sign"].eq(s1_sign), s1a["sub"].eq(s1_sub)]

        # Stage 2b: add or subtract.
        small_ext = s1a_small | s1a_sticky
        big_ext = Cat(Const(0, 3), s1a_big)
        s2_sum = Signal(ext + 1)
        s2 = {name: Signal(len(sig), name=f"s2_{name}") for name, sig in s1a.items()}
        m.d.sync += s2_sum.eq(Mux(s1a["sub"], big_ext - small_ext, big_ext + small_ext))
        m.d.sync += [s2[k].eq(v) for k, v in s1a.items()]

        # Stage 3a: how far to normalise. A carry shifts right once; otherwise shift
        # left to the hidden bit, but never below the minimum exponent (that makes a
        # subnormal).
        lz = leading_zeros(m, s2_sum[:ext])
        max_shift = s2["exp"] - 1
        s2a_sum = Signal.like(s2_sum)
        s2a_shift = Signal(range(ext + 1))
        s2a_zero = Signal()
        m.d.sync += [s2a_sum.eq(s2_sum), s2a_shift.eq(Mux(lz > max_shift, max_shift, lz)),
                     s2a_zero.eq(s2_sum == 0)]
        s2a = {k: Signal(len(v), name=f"s2a_{k}") for k, v in s2.items()}
        m.d.sync += [s2a[k].eq(v) for k, v in s2.items()]

        # Stage 3b: normalise.
        carry = s2a_sum[ext]
        low = s2a_sum[:ext]
        shift = s2a_shift
        s3_norm = Signal(ext)
        s3_exp = Signal(e_w + 1)
        s3_zero = Signal()
        with m.If(carry):
            m.d.sync += [s3_norm.eq(Cat(s2a_sum[0] | s2a_sum[1], s2a_sum[2:ext + 1])),
                         s3_exp.eq(s2a["exp"] + 1)]
        with m.Else():
            m.d.sync += [s3_norm.eq(low << shift), s3_exp.eq(s2a["exp"] - shift)]
        m.d.sync += s3_zero.eq(s2a_zero)
        s3 = {k: Signal(len(v), name=f"s3_{k}") for k, v in s2a.items()}
        m.d.sync += [s3[k].eq(v) for k, v in s2a.items()]

        # Stage 4: round to nearest even and pack. Adding the rounded significand
        # (hidden bit included) onto ``exp - 1`` lets a rounding carry bump the exponent
        # and a subnormal that rounds up become the smallest normal, with no extra case.
        mant = s3_norm[3:]
        guard = s3_norm[2]
        rest = s3_norm[:2].any()
        round_up = guard & (rest | mant[0])
        rounded = mant + round_up
        mag = Signal(e_w + f.m + 2)
        m.d.comb += mag.eq(((s3_exp - 1) << f.m) + rounded)
        overflow = mag[f.m:] >= f.exp_max
        # x + (-x) is +0 under round-to-nearest; equal signs keep their sign (-0 + -0).
        zero_sign = s3["sign"] & ~s3["sub"]
        with m.If(s3["special"]):
            m.d.sync += self.o.eq(s3["special_val"])
        with m.Elif(s3_zero):
            m.d.sync += self.o.eq(Cat(Const(0, f.width - 1), zero_sign))
        with m.Elif(overflow):
            m.d.sync += self.o.eq(Cat(Const(0, f.m), Const(f.exp_max, e_w), s3["sign"]))
        with m.Else():
            m.d.sync += self.o.eq(Cat(mag[:f.width - 1], s3["sign"]))
        return m
