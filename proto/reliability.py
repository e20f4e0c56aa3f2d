"""Reliable Connection recovery: what a responder may do with a packet that arrives early,
and what a requester may then assume. The wire is standard RoCEv2 RC in every case (ACK
and NAK-PSN-sequence-error AETHs, cumulative, the NAK carrying the first missing PSN); only
what a responder keeps differs.

* A **go-back-N responder** (the HDL, ``hw/transport/responder.py``) drops every packet
  after a gap and NAKs once per gap; its requester resends everything from the NAKed PSN.
* A **holding responder** (the software engine) also keeps early packets that lie fewer
  than :func:`hold_packets` PSNs ahead. An RDMA WRITE MIDDLE whose address is known (it
  belongs to the WRITE in progress, carries a full path-MTU payload and is not the WRITE's
  last packet: ``(d + 1) * mtu < bytes still due``) is written at ``offset + d * mtu``.
  Toward a software requester, every other early packet (a LAST, the next WRITE's FIRST
  and MIDDLEs) is kept aside as it came and taken in PSN order once the gap before it
  fills, exactly as if it had arrived then. Both count as held. Toward an HDL requester,
  which resends everything after a gap anyway, anything else early is dropped as the
  go-back-N responder drops it, and NAKed at once. While early packets are held, the NAK
  for the gap waits until one :data:`NAK_HOLDOFF_PACKETS` or more ahead arrives (small
  reordering is no loss). A packet that fills a gap this responder NAKed or dropped behind
  is ACKed at once; if held packets remain behind a new gap, that gap is NAKed at once
  (the NAK ACKs what precedes it).

A holding responder whose peer is a software engine (known at rendezvous) also **reports
every hole** it holds packets behind, once: when a packet :data:`NAK_HOLDOFF_PACKETS` or
more past a missing MIDDLE arrives, it sends a NAK-PSN-sequence-error whose PSN is still
the expected one (the NAK keeps its cumulative meaning) and whose AETH MSN field carries
the PSN of that hole (the first hole's NAK names itself). The requester resends each named
PSN alone, at most once a round trip, so the holes of a window are repaired together rather
than one round trip each. Only two software engines use this: an HDL responder's MSN counts
messages as the standard says, and the HDL requester ignores the MSN.

Between two software engines a holding responder also **names every packet that arrives
twice**: a *duplicate report* is an ACK (cumulative, as any ACK) whose credit field is
``opcodes.ACK_CREDIT_DUPLICATE`` and whose MSN field carries the duplicated PSN. A requester
that resent a reported hole alone, once, learns from it that the original arrived after all:
the packet was late, not lost (as it is when a hole fills before its resend). It undoes the
window cut that hole caused and, for a while, stops cutting the window for first reports of
holes; where many holes were late, their resend waits out a reordering window measured from
how late they were. A hole reported again after its resend is a loss either way. The HDL
reads only an ACK's kind, and no HDL node is sent one.

A holding responder also **reports how far it holds**, so that a hole does not stall the
requester's window for a round trip: when it holds a packet that asks for an ACK (AckReq),
it sends at once a *holding report*, an ACK (cumulative, as any ACK) whose credit field is
``opcodes.ACK_CREDIT_HELD`` and whose MSN field carries the farthest PSN it holds. The
requester counts what lies between its oldest unACKed PSN and that one, less the holes it
knows, as delivered: its congestion window limits only the packets still in the network
(TCP's SACK "pipe"), while all that is outstanding stays within its send window and the
responder's :func:`hold_packets`. Software engines only, as above.

A requester that finds the path reordering tells the responder so, to spare the reports
themselves: a *reordering notice* is an ACK (cumulative, as any ACK: its PSN is the
sender's own expected PSN less one) whose credit field is ``opcodes.ACK_CREDIT_REORDERING``
and whose MSN field carries its reordering window in microseconds. For a while after it
(the requester renews it while late holes go on), the responder holds each hole report
back that long, and a hole that fills meanwhile is never reported: a late packet then costs
no report, no resend and no duplicate report. A report that does come names a hole older
than the window, which the requester resends at once. Where few of the held-back holes
fill before their report, the holes were lost, not late: the responder reports at once
again and ignores notices for a while. Software engines only, as above.

An engine that finds a peer dead (its peer timeout, its retry limit, or an ICMP port
unreachable for the peer's address) tells each of its other software peers at once: a
*dead-peer notice* is an ACK (cumulative, as any ACK) whose credit field is
``opcodes.ACK_CREDIT_PEER_DEAD`` and whose MSN field carries the dead rank. The engine it
is sent to fails the same way, naming that rank. Without it, a rank that exits on the
error is what the ranks still waiting find dead next, and they name it instead. A notice
is not passed on, and a lost one costs only the name.

A requester talking to a holding responder resends, on a NAK (or a first timer expiry),
the oldest packet alone and, if the ACKs then stop exactly at the first packet the
responder could not hold (toward a software responder: the first :func:`hold_packets`
ahead), everything from there. It stays correct against a go-back-N
responder only if it knows which kind it talks to: a software engine announces itself at
rendezvous, an HDL node is go-back-N. A go-back-N
requester (the HDL) stays correct against a holding responder: what it resends and the
responder holds is a duplicate, dropped and re-ACKed.
"""

HOLD_BYTES = 1 << 20
"""How far ahead of the expected PSN a holding responder keeps early packets, in payload
bytes: a software engine's whole send window (``engine.software_window``), so that
one loss never costs the packets sent after it."""


def hold_packets(mtu: int) -> int:
    """How many PSNs ahead of the expected one a holding responder keeps, at ``mtu``."""
    return max(1, HOLD_BYTES // mtu)


NAK_HOLDOFF_PACKETS = 3
"""A holding responder NAKs a gap once a packet this far (or farther) ahead arrives. Small,
like TCP's three duplicate ACKs: a loss cut window is often under 16 packets, and with a
holdoff of 16 its losses waited for the timer (bench/loss.py, idle: 3 halved the time at
5 % and 10 % loss); a spurious NAK for a reordered packet costs one resent packet."""

__all__ = ["HOLD_BYTES", "NAK_HOLDOFF_PACKETS", "hold_packets"]
