"""Operand generators for the reduction unit's tests: random bits mixed with the edge
cases that break float datapaths (cancellation, subnormals, inf/NaN, signed zero,
rounding ties, overflow) and integer wrap-around."""

from __future__ import annotations

import numpy as np

from fpgaccl.proto.reduce import DType


def _uint(dtype: DType) -> np.dtype:
    return np.dtype(f"uint{DType(dtype).bits}")


def special_bits(dtype: DType) -> list[int]:
    """Bit patterns every test should see for ``dtype``."""
    d = DType(dtype)
    bits = d.bits
    if not d.is_float:
        top = 1 << (bits - 1)
        return [0, 1, 2, top - 1, top, top + 1, (1 << bits) - 1, (1 << bits) - 2, 0x55, 0xAA]
    e, m = d.info.exp_bits, d.info.frac_bits
    sign = 1 << (bits - 1)
    exp_ones = ((1 << e) - 1) << m
    one = ((1 << (e - 1)) - 1) << m
    vals = [
        0, 1, 2, 3, (1 << m) - 1, 1 << m, (1 << m) | 1,        # zero, subnormals, min normal
        one, one | 1, one + (1 << m), exp_ones - 1, exp_ones - (1 << m),  # 1.0, max finite
        exp_ones, exp_ones | 1, exp_ones | (1 << (m - 1)), exp_ones | ((1 << m) - 1),  # inf, NaNs
    ]
    return vals + [v | sign for v in vals]


def operands(dtype: DType, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` operand pairs as unsigned bit patterns of ``dtype``'s width."""
    d = DType(dtype)
    u = _uint(d)
    bits = d.bits
    full = (1 << bits) - 1

    def rand(k: int) -> np.ndarray:
        return rng.integers(0, full, k, dtype=u, endpoint=True)

    a = rand(n)
    b = rand(n)
    specials = np.array(special_bits(d), dtype=u)
    kind = rng.integers(0, 8, n)
    # Specials on either side.
    a = np.where(kind == 1, rng.choice(specials, n), a)
    b = np.where(kind == 2, rng.choice(specials, n), b)
    both = kind == 3
    a = np.where(both, rng.choice(specials, n), a)
    b = np.where(both, rng.choice(specials, n), b)
    if d.is_float:
        e, m = d.info.exp_bits, d.info.frac_bits
        sign = u.type(1 << (bits - 1))
        # Near-cancellation: b = -a with a few low bits changed.
        low = rng.integers(0, 1 << min(m, 8), n, dtype=u)
        b = np.where(kind == 4, (a ^ sign) ^ low, b)
        # Close exponents: b shares a's exponent region, random fraction and sign.
        shift = rng.integers(0, m + 4, n).astype(u)
        exp_a = (a >> u.type(m)) & u.type((1 << e) - 1)
        exp_b = np.clip(exp_a.astype(np.int64) - shift.astype(np.int64), 0,
                        (1 << e) - 2).astype(u)
        close = (rand(n) & u.type((1 << m) - 1)) | (exp_b << u.type(m)) | (rand(n) & sign)
        b = np.where(kind == 5, close, b)
        # Subnormal pairs and subnormal/normal boundary.
        sub_mask = u.type((1 << (m + 1)) - 1)
        a = np.where(kind == 6, rand(n) & (sub_mask | sign), a)
        b = np.where(kind == 6, rand(n) & (sub_mask | sign), b)
        # Products near over/underflow: exponents summing around the limits.
        exp_hi = rng.integers(0, 1 << e, n).astype(u)
        exp_field = u.type((1 << e) - 1) << u.type(m)
        a = np.where(kind == 7, (a & ~exp_field) | (exp_hi << u.type(m)), a)
    return a.astype(u), b.astype(u)
