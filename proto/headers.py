"""Field tables of every header fpgaccl puts on the wire, in wire order."""

from __future__ import annotations

from .fields import Field, Header, equals, one_of
from .opcodes import (
    BTH_VERSION,
    DEFAULT_PKEY,
    ETHERTYPE_IPV4,
    IP_PROTO_UDP,
    ROCEV2_UDP_PORT,
    SUPPORTED_OPCODES,
)

ETH = Header("Ether", (
    Field("dst", 48, 0xFFFFFFFFFFFF, "destination MAC", hex=True),
    Field("src", 48, 0, "source MAC", hex=True),
    Field("type", 16, ETHERTYPE_IPV4, "EtherType; the engine accepts IPv4 only", hex=True),
), "Ethernet II")

IPV4 = Header("IP", (
    Field("version", 4, 4, "IP version", check=equals(4)),
    Field("ihl", 4, 5, "header length in 32-bit words; options are not accepted",
          check=equals(5)),
    Field("tos", 8, 0, "DSCP (6 bits) + ECN (2 bits); variant, masked by the ICRC"),
    Field("len", 16, 20, "total length of IP header + payload in bytes"),
    Field("id", 16, 0, "identification"),
    Field("flags", 3, 0b010, "reserved, DF, MF; RoCEv2 sets DF"),
    Field("frag", 13, 0, "fragment offset; fragments are not accepted"),
    Field("ttl", 8, 64, "time to live; variant, masked by the ICRC"),
    Field("proto", 8, IP_PROTO_UDP, "payload protocol: UDP", check=equals(IP_PROTO_UDP)),
    Field("chksum", 16, 0, "header checksum (RFC 791); variant, masked by the ICRC", hex=True),
    Field("src", 32, 0, "source address", hex=True),
    Field("dst", 32, 0, "destination address", hex=True),
), "IPv4 without options")

UDP = Header("UDP", (
    Field("sport", 16, 0xC000, "source port; RoCEv2 uses it for ECMP entropy"),
    Field("dport", 16, ROCEV2_UDP_PORT, "destination port: 4791 is RoCEv2"),
    Field("len", 16, 8, "UDP header + payload length in bytes"),
    Field("chksum", 16, 0, "checksum; RoCEv2 sends 0, masked by the ICRC", hex=True),
), "UDP")

# Field names and widths follow scapy.contrib.roce.BTH so that the two can be compared
# field for field (tests/proto/test_scapy_agreement.py).
BTH = Header("BTH", (
    Field("opcode", 8, 0, "transport + operation", check=one_of(SUPPORTED_OPCODES, "opcode")),
    Field("solicited", 1, 0, "solicited event"),
    Field("migreq", 1, 0, "migration state"),
    Field("padcount", 2, 0, "pad bytes added to reach a 4-byte multiple"),
    Field("version", 4, BTH_VERSION, "transport header version", check=equals(BTH_VERSION)),
    Field("pkey", 16, DEFAULT_PKEY, "partition key", hex=True),
    Field("fecn", 1, 0, "forward ECN; variant, masked by the ICRC"),
    Field("becn", 1, 0, "backward ECN; variant, masked by the ICRC"),
    Field("resv6", 6, 0, "reserved; masked by the ICRC"),
    Field("dqpn", 24, 0, "destination queue pair number"),
    Field("ackreq", 1, 0, "acknowledge request: the responder must ACK this PSN"),
    Field("resv7", 7, 0, "reserved"),
    Field("psn", 24, 0, "packet sequence number"),
), "InfiniBand Base Transport Header")

RETH = Header("RETH", (
    Field("va", 64, 0, "remote virtual address of the first payload byte", hex=True),
    Field("rkey", 32, 0, "remote memory key", hex=True),
    Field("dlen", 32, 0, "DMA length of the whole RDMA WRITE message in bytes"),
), "RDMA Extended Transport Header")

AETH = Header("AETH", (
    Field("syndrome", 8, 0, "ACK/RNR-NAK/NAK kind + credit or NAK code", hex=True),
    Field("msn", 24, 0, "message sequence number", hex=True),
), "ACK Extended Transport Header")

IMMDT = Header("ImmDt", (
    Field("imm", 32, 0, "immediate data; fpgaccl puts COLLECTIVE_IMM in it", hex=True),
), "Immediate Data Extended Transport Header")

COLLECTIVE_IMM = Header("CollectiveImm", (
    Field("coll_id", 16, 0, "collective call number, wraps at 2^16"),
    Field("grant", 1, 0, "1: a zero-length credit (sequencer GRANT), 0: data"),
    Field("step", 15, 0, "algorithm step (sequencer message tag)"),
), "fpgaccl's meaning of the 32 immediate bits of a collective message")

RING_IMM = Header("RingImm", (
    Field("coll_id", 16, 0, "call number (send/recv: per peer-pair sequence number; "
          "credit: the ring slot returned)"),
    Field("final", 1, 0, "1: the last message of a transfer"),
    Field("step", 15, 0, "schedule step, or RING_STEP_CREDIT / RING_STEP_P2P"),
), "the software engine's immediate for WRITEs into a per-peer receive ring "
   "(point-to-point and non-program schedules). A responder tells it from "
   "COLLECTIVE_IMM by the memory region the WRITE lands in: the ring's rkey is given "
   "only to that peer's QP, never to a sequencer; sequencer programs use the "
   "collective region and COLLECTIVE_IMM")
RING_STEP_CREDIT = 0x7FFF
"""RING_IMM step of a zero-length WRITE returning a ring slot (``coll_id`` = the slot)."""
RING_STEP_P2P = 0x7FFE
"""RING_IMM step of a send/recv message (``coll_id`` = per peer-pair sequence number)."""

# The network boundary's own protocols (hw/eth): answered there, never by the engine.
# Field names follow scapy's ARP and ICMP (tests/hw/test_eth_arp_icmp.py compares).
ARP = Header("ARP", (
    Field("hwtype", 16, 1, "hardware type: Ethernet"),
    Field("ptype", 16, ETHERTYPE_IPV4, "protocol type: IPv4", hex=True),
    Field("hwlen", 8, 6, "hardware address length"),
    Field("plen", 8, 4, "protocol address length"),
    Field("op", 16, 1, "1 request (who-has), 2 reply (is-at)"),
    Field("hwsrc", 48, 0, "sender MAC", hex=True),
    Field("psrc", 32, 0, "sender IPv4 address", hex=True),
    Field("hwdst", 48, 0, "target MAC (zero in a request)", hex=True),
    Field("pdst", 32, 0, "target IPv4 address", hex=True),
), "ARP for IPv4 over Ethernet (RFC 826)")
ARP_REQUEST, ARP_REPLY = 1, 2

ICMP = Header("ICMP", (
    Field("type", 8, 8, "8 echo request, 0 echo reply"),
    Field("code", 8, 0, "0 for echo"),
    Field("chksum", 16, 0, "RFC 1071 sum over the ICMP message", hex=True),
    Field("id", 16, 0, "echo identifier"),
    Field("seq", 16, 0, "echo sequence number"),
), "ICMP echo request/reply header (RFC 792)")
ICMP_ECHO_REQUEST, ICMP_ECHO_REPLY = 8, 0

ICRC_BYTES = 4
HEADERS = (ETH, IPV4, UDP, BTH, RETH, AETH, IMMDT)
