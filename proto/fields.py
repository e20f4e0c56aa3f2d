"""Header field tables: the one description of every wire format.

A :class:`Header` lists its fields in wire order (most significant bit first, as the
RFCs and the InfiniBand spec draw them). Everything else is derived: byte packing here,
``amaranth.lib.data`` layouts in ``fpgaccl.hw.net.layouts`` and scapy ``fields_desc``
in ``fpgaccl.host.layers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from fpgaccl.errors import MalformedHeaderError

Validator = Callable[[int], str | None]
"""Returns ``None`` when a decoded value is acceptable, else why it is not."""


@dataclass(frozen=True)
class Field:
    name: str
    bits: int
    default: int
    doc: str
    hex: bool = False
    """Shown in hex by the scapy layer (addresses, keys, checksums)."""
    check: Validator | None = None
    """Run on decode: a malformed value raises :class:`MalformedHeaderError`."""

    def __post_init__(self) -> None:
        if self.bits <= 0:
            raise ValueError(f"field {self.name}: width must be positive")
        if not 0 <= self.default < (1 << self.bits):
            raise ValueError(
                f"field {self.name}: default {self.default} does not fit {self.bits} bits")


def equals(expected: int) -> Validator:
    return lambda v: None if v == expected else f"must be {expected:#x}, found {v:#x}"


def one_of(allowed: Mapping[int, str] | frozenset[int], what: str) -> Validator:
    keys = frozenset(allowed)
    return lambda v: None if v in keys else f"unknown {what} {v:#x}"


@dataclass(frozen=True)
class Header:
    name: str
    fields: tuple[Field, ...]
    doc: str = ""
    _index: dict[str, Field] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        total = sum(f.bits for f in self.fields)
        if total % 8:
            raise ValueError(f"header {self.name}: {total} bits is not a whole number of bytes")
        object.__setattr__(self, "_index", {f.name: f for f in self.fields})
        if len(self._index) != len(self.fields):
            raise ValueError(f"header {self.name}: duplicate field names")

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __getitem__(self, name: str) -> Field:
        return self._index[name]

    @property
    def bits(self) -> int:
        return sum(f.bits for f in self.fields)

    @property
    def size(self) -> int:
        """Length on the wire in bytes."""
        return self.bits // 8

    def offset(self, name: str) -> int:
        """Bit offset of a field counted from the first bit on the wire."""
        pos = 0
        for f in self.fields:
            if f.name == name:
                return pos
            pos += f.bits
        raise KeyError(name)

    def defaults(self) -> dict[str, int]:
        return {f.name: f.default for f in self.fields}

    def to_int(self, values: Mapping[str, int] | None = None, **kw: int) -> int:
        """The header as one big-endian integer (first wire bit = most significant)."""
        merged = {**self.defaults(), **(values or {}), **kw}
        unknown = set(merged) - set(self._index)
        if unknown:
            raise KeyError(f"{self.name} has no field(s) {sorted(unknown)}")
        acc = 0
        for f in self.fields:
            v = int(merged[f.name])
            if not 0 <= v < (1 << f.bits):
                raise MalformedHeaderError(self.name, f.name, f"{v:#x} does not fit {f.bits} bits")
            acc = (acc << f.bits) | v
        return acc

    def pack(self, values: Mapping[str, int] | None = None, **kw: int) -> bytes:
        return self.to_int(values, **kw).to_bytes(self.size, "big")

    def from_int(self, word: int) -> dict[str, int]:
        out: dict[str, int] = {}
        shift = self.bits
        for f in self.fields:
            shift -= f.bits
            out[f.name] = (word >> shift) & ((1 << f.bits) - 1)
        return out

    def unpack(self, data: bytes, *, validate: bool = True) -> dict[str, int]:
        """Decode the first :attr:`size` bytes of ``data``.

        Raises :class:`MalformedHeaderError` naming the field that is truncated or
        carries a value the protocol forbids.
        """
        if len(data) < self.size:
            # Name the first field that is not fully present.
            have = len(data) * 8
            pos = 0
            for f in self.fields:
                if pos + f.bits > have:
                    raise MalformedHeaderError(
                        self.name, f.name,
                        f"truncated: header needs {self.size} bytes, got {len(data)}")
                pos += f.bits
        values = self.from_int(int.from_bytes(bytes(data[: self.size]), "big"))
        if validate:
            self.validate(values)
        return values

    def validate(self, values: Mapping[str, int]) -> None:
        for f in self.fields:
            if f.check is not None:
                why = f.check(int(values[f.name]))
                if why is not None:
                    raise MalformedHeaderError(self.name, f.name, why)
