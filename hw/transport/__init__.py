"""Reliable-connection transport: queue pairs, PSNs, coalesced ACK/NAK, go-back-N and
memory-key protection (issue 5). :class:`Transport` is the node-level block;
:class:`Requester` and :class:`Responder` are its halves."""

from .layouts import HDR, RECV_CMPL, WRITE_CMPL, WRITE_DESC, QPState, Status
from .requester import Requester
from .responder import Responder
from .transport import STATS, Transport

__all__ = ["HDR", "RECV_CMPL", "STATS", "WRITE_CMPL", "WRITE_DESC", "QPState", "Requester",
           "Responder", "Status", "Transport"]
