"""Bit-level helpers shared by the floating-point lanes."""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal, Value


class FloatFormat:
    """An IEEE 754 binary format: ``exp_bits`` exponent bits, ``frac_bits`` stored
    fraction bits (the hidden bit is not stored)."""

    def __init__(self, exp_bits: int, frac_bits: int) -> None:
        self.e = exp_bits
        self.m = frac_bits
        self.width = 1 + exp_bits + frac_bits
        self.p = frac_bits + 1                 # precision, hidden bit included
        self.bias = (1 << (exp_bits - 1)) - 1
        self.exp_max = (1 << exp_bits) - 1     # all-ones exponent field: inf/NaN
        self.quiet = 1 << (frac_bits - 1)
        # Default NaN of x86 SSE (what numpy shows): sign set, quiet bit only.
        self.default_nan = ((1 << (exp_bits + 2)) - 1) << (frac_bits - 1)

    def __repr__(self) -> str:
        return f"FloatFormat(e={self.e}, m={self.m})"


class Unpacked:
    """Fields and classification of one float operand (combinational)."""

    def __init__(self, m: Module, fmt: FloatFormat, bits: Value) -> None:
        self.bits = bits
        self.sign = bits[fmt.width - 1]
        self.exp = bits[fmt.m:fmt.m + fmt.e]
        self.frac = bits[:fmt.m]
        self.mag = bits[:fmt.width - 1]
        exp_zero = self.exp == 0
        exp_ones = self.exp == fmt.exp_max
        frac_zero = self.frac == 0
        self.is_nan = Signal()
        self.is_inf = Signal()
        self.is_zero = Signal()
        self.exp_eff = Signal(fmt.e)
        self.sig = Signal(fmt.p)
        m.d.comb += [
            self.is_nan.eq(exp_ones & ~frac_zero),
            self.is_inf.eq(exp_ones & frac_zero),
            self.is_zero.eq(exp_zero & frac_zero),
            # Subnormals have the exponent of the smallest normal and no hidden bit, so
            # one datapath serves both.
            self.exp_eff.eq(Mux(exp_zero, 1, self.exp)),
            self.sig.eq(Cat(self.frac, ~exp_zero)),
        ]
        self.quieted = bits | fmt.quiet


def leading_zeros(m: Module, v: Value) -> Signal:
    """Number of zero bits above the highest set bit of ``v`` (``len(v)`` if zero).

    A balanced tree rather than a priority chain: log-depth logic, and Amaranth's Python
    simulator cannot compile a 100-deep nest of muxes. Results are Signals because
    Amaranth re-emits a shared expression at every use.
    """
    n = len(v)
    size = 1 << max(n - 1, 0).bit_length()
    padded = Cat(Const(0, size - n), v)     # pad below so the count is unchanged

    def tree(x: Value) -> Value:
        if len(x) == 1:
            return ~x[0]
        half = len(x) // 2
        hi, lo = x[half:], x[:half]
        return Mux(hi.any(), tree(hi), half + tree(lo))

    res = Signal(range(size + 1))
    out = Signal(range(n + 1))
    m.d.comb += [res.eq(tree(padded)), out.eq(Mux(res > n, n, res))]
    return out


def shift_right_sticky(m: Module, v: Value, amount: Value) -> tuple[Signal, Signal]:
    """``v >> amount`` and whether any set bit was shifted out (the sticky bit)."""
    n = len(v)
    wide = Signal(2 * n)
    shifted = Signal(n)
    sticky = Signal()
    m.d.comb += [
        wide.eq(Cat(Const(0, n), v) >> Mux(amount > n, n, amount)),
        shifted.eq(wide[n:]),
        sticky.eq(wide[:n].any()),
    ]
    return shifted, sticky
