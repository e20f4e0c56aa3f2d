"""Why a received frame is dropped. Each reason has a saturating counter in hardware
(CSR block ``drops``) and in the software engine, indexed by these numbers."""

from __future__ import annotations

from enum import IntEnum


class DropReason(IntEnum):
    TRUNCATED = 0
    BAD_ETHERTYPE = 1
    IPV4_VERSION = 2
    IPV4_OPTIONS = 3
    IPV4_FRAGMENT = 4
    IPV4_CHECKSUM = 5
    IPV4_PROTOCOL = 6
    IPV4_LENGTH = 7
    UDP_PORT = 8
    UDP_LENGTH = 9
    BTH_VERSION = 10
    UNKNOWN_OPCODE = 11
    BAD_ICRC = 12
    BAD_QPN = 13
    PSN_DUPLICATE = 14
    PSN_OUT_OF_ORDER = 15
    BAD_RKEY = 16
    OUT_OF_BOUNDS = 17
    ACCESS_DENIED = 18
    OVERSIZE = 19        # longer than the receive buffer (the parser's frame FIFO) or
                         # than the MAC's maximum frame
    # The network boundary (hw/eth): the MAC's checks, then the L2/L3 demux's.
    BAD_FCS = 20         # Ethernet frame check sequence wrong
    RUNT = 21            # shorter than 64 bytes including the FCS
    PHY_ERROR = 22       # the PHY flagged a receive error (rx_er) inside the frame
    RX_OVERFLOW = 23     # no room: the receive path's consumer stalled past its buffer
    NOT_FOR_US = 24      # another host's MAC (not broadcast) or another IPv4 address
    # The control port (hw/eth/control.py, proto/control.py).
    CONTROL_KEY = 25     # a control request without the board's key (or before it is set)
    CONTROL_MALFORMED = 26  # not a well-formed control request (magic, version, flags,
                            # lengths, longer than the endpoint's buffer)
    # Hostile or stale traffic the ICRC cannot tell from good (anyone can compute one).
    WRONG_SOURCE = 27    # a valid packet for a QP from an address/port not its peer's
    ACK_PSN_INVALID = 28  # an ACK/NAK naming a PSN that is not outstanding
    # The network boundary's responders (hw/eth): each answers one frame at a time.
    SERVICE_BUSY = 29    # an ARP, ICMP echo or control frame that came while its
                         # responder was still answering the last (the sender retries)


ETH_DROPS = frozenset({DropReason.BAD_FCS, DropReason.RUNT, DropReason.PHY_ERROR,
                       DropReason.RX_OVERFLOW, DropReason.NOT_FOR_US,
                       DropReason.CONTROL_KEY, DropReason.CONTROL_MALFORMED,
                       DropReason.SERVICE_BUSY})
"""Reasons only the network boundary (``hw/eth``: MAC, demux, control port) gives; a node
without it reads them as zero."""

DROP_COUNTER_BITS = 32
