"""One block of :mod:`fpgaccl.proto.codec`, coded and decoded by combinational logic.

Every field of a coded block is a fixed wiring of the element bits: the sign/mantissa
planes always, and the exponent code planes too, because a code below ``2**k`` leaves
the planes ``k..E-1`` zero. So coding is a min/max tree, ``E``-bit subtractions and
wires, and the chunk's byte length (``fixed + 8k``) picks how much of it counts.
"""

from __future__ import annotations

from amaranth.hdl import Cat, Const, Module, Mux, Signal, Value

from fpgaccl.proto.codec import BLOCK, HEADER_BYTES, Format


def beats_per_block(f: Format, width: int) -> int:
    """Beats of ``width`` bits in one raw block; ValueError where the width does not hold
    whole elements or divide a block at least twice (both units' parameters)."""
    block_bits = BLOCK * f.bits
    if width % f.bits or block_bits % width or width > block_bits // 2:
        raise ValueError(f"width {width} must hold whole elements and divide a block "
                         f"({block_bits} bits) at least twice")
    return block_bits // width


def buffer_bytes(f: Format, width: int) -> int:
    """A unit's byte buffer: the longest coded block and two beats of backlog."""
    return f.max_block_bytes + 2 * width // 8


def _tree(values: list[Value], pick_first) -> Value:
    while len(values) > 1:
        pairs = [Mux(pick_first(a, b), a, b)
                 for a, b in zip(values[::2], values[1::2], strict=False)]
        values = pairs + values[len(values) // 2 * 2:]
    return values[0]


def bitlen(v: Value, width: int) -> Value:
    """Bits needed for ``v`` (0 for 0): the count of powers of two it reaches."""
    return sum((v >= (1 << j)) for j in range(width))


def split(f: Format, raw: Value, i: int) -> tuple[Value, Value]:
    """Element ``i``'s exponent field and its sign-above-mantissa value."""
    at = i * f.bits
    e = raw[at + f.man_bits: at + f.man_bits + f.exp_bits]
    sm = Cat(raw[at: at + f.man_bits], raw[at + f.bits - 1])
    return e, sm


def sm_planes(f: Format, sm: list[Value]) -> Value:
    byte_planes = [sm[i][8 * p: 8 * p + 8] for p in range(f.sm_byte_planes) for i in range(BLOCK)]
    bit_planes = [sm[i][8 * f.sm_byte_planes + j] for j in range(f.sm_bit_planes)
                  for i in range(BLOCK)]
    return Cat(*byte_planes, *bit_planes)


def encode_block(m: Module, f: Format, raw: Value) -> tuple[Value, Value]:
    """The coded block of ``raw`` (BLOCK elements) padded with zeros to the longest
    block, and its length in bytes."""
    E = f.exp_bits
    es, sms = zip(*(split(f, raw, i) for i in range(BLOCK)), strict=True)
    lo = Signal(E, name="lo")
    hi = Signal(E, name="hi")
    lo_nz = Signal(E + 1, name="lo_nz")
    m.d.comb += [
        lo.eq(_tree(list(es), lambda a, b: a <= b)),
        hi.eq(_tree(list(es), lambda a, b: a >= b)),
        lo_nz.eq(_tree([Mux(e == 0, 1 << E, e) for e in es], lambda a, b: a <= b)),
    ]
    k0 = Signal(4, name="k0")
    k1 = Signal(5, name="k1")
    z = Signal(name="z")
    k = Signal(4, name="k")
    base = Signal(E, name="base")
    m.d.comb += [
        k0.eq(bitlen(hi - lo, E)),
        k1.eq(Mux(lo_nz <= hi, bitlen((hi - lo_nz + 1)[:E + 1], E + 1), E + 1)),
        z.eq(k1 < k0),
        k.eq(Mux(z, k1, k0)),
        base.eq(Mux(z, lo_nz, lo)),
    ]
    codes = []
    for i, e in enumerate(es):
        c = Signal(E, name=f"code{i}")
        m.d.comb += c.eq(Mux(z, Mux(e == 0, 0, e - base + 1), e - base))
        codes.append(c)
    header = Cat(k, z, Const(0, 3), base, Const(0, 8 - E))
    code_planes = Cat(*(codes[i][j] for j in range(E) for i in range(BLOCK)))
    chunk = Cat(header, sm_planes(f, list(sms)), code_planes)
    assert len(chunk) == 8 * f.max_block_bytes
    length = Signal(range(f.max_block_bytes + 1), name="block_len")
    m.d.comb += length.eq(f.fixed_bytes + (BLOCK // 8) * k)
    return chunk, length


def header_length(m: Module, f: Format, head: Value) -> tuple[Value, Value]:
    """A block's length in bytes from its first two bytes, and whether they are bad."""
    E = f.exp_bits
    k, z, reserved, base = head[0:4], head[4], head[5:8], head[8:16]
    bad = Signal(name="bad_header")
    length = Signal(range(f.max_block_bytes + 1), name="coded_len")
    m.d.comb += [
        bad.eq((reserved != 0) | (k > E) | (base >= (1 << E)) | (z & ((k == 0) | (base == 0)))),
        length.eq(f.fixed_bytes + (BLOCK // 8) * k),
    ]
    return length, bad


def decode_block(m: Module, f: Format, chunk: Value) -> tuple[Value, Value]:
    """The BLOCK raw elements of a coded block (bytes past its length are ignored), and
    whether a code overflows the exponent field."""
    E, M = f.exp_bits, f.man_bits
    k, z, base = chunk[0:4], chunk[4], chunk[8:8 + E]
    at = 8 * HEADER_BYTES
    sms = [Signal(f.sm_bits, name=f"sm{i}") for i in range(BLOCK)]
    for p in range(f.sm_byte_planes):
        for i in range(BLOCK):
            m.d.comb += sms[i][8 * p: 8 * p + 8].eq(chunk[at + 8 * i: at + 8 * i + 8])
        at += 8 * BLOCK
    for j in range(f.sm_bit_planes):
        for i in range(BLOCK):
            m.d.comb += sms[i][8 * f.sm_byte_planes + j].eq(chunk[at + i])
        at += BLOCK
    plane_on = [Signal(name=f"plane{j}") for j in range(E)]
    m.d.comb += [p.eq(k > j) for j, p in enumerate(plane_on)]
    elems, overs = [], []
    for i in range(BLOCK):
        code = Cat(*(chunk[at + j * BLOCK + i] & plane_on[j] for j in range(E)))
        e = Signal(E + 1, name=f"e{i}")
        m.d.comb += e.eq(Mux(z & (code == 0), 0, base + code - z))
        overs.append(e[E])
        elems.append(Cat(sms[i][:M], e[:E], sms[i][M]))
    return Cat(*elems), Cat(*overs).any()
