"""CRC-32 over wide beats, with the ICRC's RoCEv2 masking, generated at elaboration time.

The CRC register (reflected CRC-32, polynomial 0xEDB88320, as zlib) is updated one
``N``-byte beat per cycle by a GF(2) matrix computed here in Python: every output bit is
the XOR of the state and data bits its row selects. Two tricks keep the hardware small
and free of per-keep matrices:

* **Zero init.** ``crc32`` starts from all ones; that equals starting from zero with the
  first four message bytes inverted. The ICRC's message starts with eight 0xFF bytes
  (the LRH placeholder), so the stream is taken from frame byte 0 with bytes 0..9 forced
  to zero and bytes 10..13 to 0xFF, and the register starts at zero: leading zeros do
  not move a zero register, so the Ethernet header simply falls out.
* **Un-zero.** The beat where the CRC region ends is fed with its tail bytes zeroed;
  shifting a zero byte into the register is an invertible map ``A``, so the true state is
  recovered by ``A^-z`` for ``z`` trailing zeros, built as ``log2(N)`` conditional 32x32
  stages.

The receive side runs the CRC over the packet *including* its ICRC and compares with
the CRC-32 residue; the transmit side stops before the ICRC slot and inserts ``~state``.
"""

from __future__ import annotations

from functools import cache

from amaranth.hdl import Cat, Const, Module, Signal, Value

from fpgaccl.proto import ETH
from fpgaccl.proto.icrc import VARIANT_MASK

POLY = 0xEDB88320
MASK32 = 0xFFFFFFFF

# Frame bytes [0, LRH_ZERO) are forced to 0, [LRH_ZERO, ETH.size) to 0xFF: with a zero
# register this is crc32's all-ones init followed by the 8-byte LRH placeholder.
LRH_ZERO = ETH.size - 4
ICRC_MASK_END = ETH.size + len(VARIANT_MASK)
"""Frame bytes below this have a fixed ICRC mask (Ethernet + IPv4 + UDP + BTH)."""


def raw_update(state: int, data: bytes) -> int:
    """The CRC register after shifting ``data`` in (no init, no final inversion)."""
    for b in data:
        state ^= b
        for _ in range(8):
            state = (state >> 1) ^ (POLY if state & 1 else 0)
    return state


def _residue() -> int:
    msg = b"fpgaccl"
    crc = raw_update(MASK32, msg) ^ MASK32
    return raw_update(MASK32, msg + crc.to_bytes(4, "little"))


RESIDUE = _residue()
"""Raw register after a message followed by its own little-endian CRC-32 (0xDEBB20E3),
starting from the all-ones init; our zero-init stream reaches the same value."""


@cache
def residue_after_zeros(zbytes: int) -> int:
    """The register a good frame leaves when ``zbytes`` zero bytes followed its ICRC.

    Un-zeroing is the invertible map ``A^-z``, so ``unzero(crc, z) == RESIDUE`` holds
    exactly when ``crc == A^z RESIDUE``: the receiver compares with one of these
    constants instead of un-zeroing its register (three 32x32 GF(2) stages off the
    end-of-frame path)."""
    return raw_update(RESIDUE, bytes(zbytes))


@cache
def update_columns(nbytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Columns of the ``nbytes`` update: effect of each state bit and each data bit."""
    zeros = bytes(nbytes)
    state_cols = tuple(raw_update(1 << j, zeros) for j in range(32))
    # A data bit in byte i is one byte update followed by nbytes-1-i zero bytes.
    data_cols = []
    for i in range(nbytes):
        tail = bytes(nbytes - 1 - i)
        for b in range(8):
            data_cols.append(raw_update(raw_update(0, bytes([1 << b])), tail))
    return state_cols, tuple(data_cols)


@cache
def update_rows(nbytes: int) -> tuple[tuple[int, int], ...]:
    """For each of the 32 output bits, the (state mask, data mask) it XORs."""
    state_cols, data_cols = update_columns(nbytes)
    rows = []
    for o in range(32):
        smask = sum(1 << j for j, c in enumerate(state_cols) if c >> o & 1)
        dmask = sum(1 << k for k, c in enumerate(data_cols) if c >> o & 1)
        rows.append((smask, dmask))
    return tuple(rows)


def apply_update(state: int, data: bytes) -> int:
    """:func:`raw_update` through the matrix: what the hardware computes (for tests)."""
    word = int.from_bytes(data, "little")
    out = 0
    for o, (sm, dm) in enumerate(update_rows(len(data))):
        out |= ((bin(state & sm).count("1") + bin(word & dm).count("1")) & 1) << o
    return out


def _mat_mul(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """Columns of A*B for 32x32 matrices given as columns."""
    out = []
    for col in b:
        acc = 0
        for j in range(32):
            if col >> j & 1:
                acc ^= a[j]
        out.append(acc)
    return tuple(out)


def _mat_inv(cols: tuple[int, ...]) -> tuple[int, ...]:
    """Inverse over GF(2) by Gauss-Jordan on rows."""
    rows = [sum((cols[j] >> i & 1) << j for j in range(32)) | (1 << (32 + i)) for i in range(32)]
    for c in range(32):
        p = next(r for r in range(c, 32) if rows[r] >> c & 1)
        rows[c], rows[p] = rows[p], rows[c]
        for r in range(32):
            if r != c and rows[r] >> c & 1:
                rows[r] ^= rows[c]
    inv_rows = [r >> 32 for r in rows]
    return tuple(sum((inv_rows[i] >> j & 1) << i for i in range(32)) for j in range(32))


@cache
def unzero_columns(zbytes: int) -> tuple[int, ...]:
    """Columns of A^-zbytes, undoing ``zbytes`` trailing zero bytes."""
    a = update_columns(1)[0]
    inv = _mat_inv(a)
    out = tuple(1 << j for j in range(32))
    for _ in range(zbytes):
        out = _mat_mul(inv, out)
    return out


def apply_columns(cols: tuple[int, ...], state: int) -> int:
    out = 0
    for j, c in enumerate(cols):
        if state >> j & 1:
            out ^= c
    return out


# --- hardware -------------------------------------------------------------------------

def _xor_of(bits: list[Value]) -> Value:
    return Cat(*bits).xor() if bits else Const(0, 1)


def crc_update(state: Value, data: Value) -> Value:
    """The CRC register after one beat ``data`` (byte 0 at bit 0), all bytes counted."""
    nbytes = len(data) // 8
    out = []
    for sm, dm in update_rows(nbytes):
        bits = [state[j] for j in range(32) if sm >> j & 1]
        bits += [data[k] for k in range(8 * nbytes) if dm >> k & 1]
        out.append(_xor_of(bits))
    return Cat(*out)


def _apply_matrix(cols: tuple[int, ...], state: Value) -> Value:
    return Cat(*(_xor_of([state[j] for j in range(32) if cols[j] >> o & 1])
                 for o in range(32)))


def crc_unzero(m: Module, state: Value, zeros: Value, name: str = "unzero", *,
               group: int = 1) -> Signal:
    """Undo ``zeros`` trailing zero bytes (a value below ``2**len(zeros)``); each
    stage is a signal of its own so expressions stay small.

    A stage handles ``group`` bits of ``zeros``: one matrix per value of those bits
    (``2**group`` of them, identity included) and a mux. ``group=1`` is the smallest
    (one conditional matrix per bit); a larger group trades LUTs for depth: one XOR
    level and one mux per stage instead of per bit."""
    if group < 1:
        raise ValueError(f"group must be >= 1, not {group}")
    for lo in range(0, len(zeros), group):
        bits = zeros[lo:lo + group]
        stage = Signal(32, name=f"{name}_{lo}")
        with m.Switch(bits):
            for v in range(1 << len(bits)):
                with m.Case(v):
                    m.d.comb += stage.eq(
                        _apply_matrix(unzero_columns(v << lo), state) if v else state)
        state = stage
    return state


@cache
def icrc_beat_masks(nbytes: int) -> tuple[tuple[int, int], ...]:
    """(and, or) byte masks per beat index for the frame's fixed-mask prefix."""
    beats = []
    for k in range(-(-ICRC_MASK_END // nbytes)):
        and_m = or_m = 0
        for i in range(nbytes):
            pos = k * nbytes + i
            a, o = 0xFF, 0x00
            if pos < LRH_ZERO:
                a = 0x00
            elif pos < ETH.size:
                o = 0xFF
            elif pos < ICRC_MASK_END:
                o = VARIANT_MASK[pos - ETH.size]
            and_m |= a << (8 * i)
            or_m |= o << (8 * i)
        beats.append((and_m, or_m))
    return tuple(beats)


def icrc_stream_bytes(frame: bytes, end: int) -> bytes:
    """Python model of the masked stream the hardware feeds its CRC (for tests)."""
    out = bytearray(frame[:end])
    for pos in range(min(end, ICRC_MASK_END)):
        if pos < LRH_ZERO:
            out[pos] = 0
        elif pos < ETH.size:
            out[pos] = 0xFF
        else:
            out[pos] |= VARIANT_MASK[pos - ETH.size]
    return bytes(out)
