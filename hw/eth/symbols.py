"""What flows between the MAC's stages: byte symbols, the receive verdict, and how a
verdict is counted as a :class:`~fpgaccl.proto.DropReason`."""

from __future__ import annotations

from amaranth.lib import data, enum

from fpgaccl.proto import DropReason

from ..stream.beat import beat_layout


class RxDrop(enum.Enum, shape=3):
    """A received frame's verdict, carried on its last byte and beat."""
    NONE = 0
    BAD_FCS = 1
    RUNT = 2
    OVERSIZE = 3
    PHY_ERROR = 4
    OVERFLOW = 5


RX_DROP_REASON = {
    RxDrop.BAD_FCS: DropReason.BAD_FCS,
    RxDrop.RUNT: DropReason.RUNT,
    RxDrop.OVERSIZE: DropReason.OVERSIZE,
    RxDrop.PHY_ERROR: DropReason.PHY_ERROR,
    RxDrop.OVERFLOW: DropReason.RX_OVERFLOW,
}
"""The CSR drop reason each verdict is counted under."""

BYTE = data.StructLayout({"data": 8, "last": 1})
RX_BYTE = data.StructLayout({"data": 8, "last": 1, "drop": RxDrop})


def rx_beat_layout(width: int) -> data.StructLayout:
    return data.StructLayout({"beat": beat_layout(width), "drop": RxDrop})
