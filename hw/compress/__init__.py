"""Lossless float compression of :mod:`fpgaccl.proto.codec`: an encoder for the send path
and a decoder for the receive path, one beat per cycle. Not yet wired into the node."""

from .decoder import BlockDecoder, coded_beat_layout, decoded_beat_layout
from .encoder import BlockEncoder

__all__ = ["BlockDecoder", "BlockEncoder", "coded_beat_layout", "decoded_beat_layout"]
