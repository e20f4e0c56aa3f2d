"""Port layouts of the reliable transport, and the shapes it takes from the CSR bank.

The header record is the transport-level half of the parser's/builder's
:data:`fpgaccl.hw.net.record.RECORD` (same field names and layouts, so a node wires one
to the other field by field): of Ethernet/IPv4/UDP the transport sees only the IPv4
source (``src_ip``, checked against the QP's peer), and on transmit it says which QP
context (``qp``) the builder takes the peer's addresses from.
"""

from __future__ import annotations

from amaranth.lib import data

from fpgaccl.hw.csr.bank import register_layout
from fpgaccl.hw.net.layouts import header_layout
from fpgaccl.proto import AETH, BTH, IMMDT, RETH
from fpgaccl.proto.regmap import REGMAP, Access

QP_BITS = 8
PAYLOAD_LEN_BITS = 16

HDR = data.StructLayout({
    "bth": header_layout(BTH),
    "reth": header_layout(RETH),
    "aeth": header_layout(AETH),
    "immdt": header_layout(IMMDT),
    "has_reth": 1,
    "has_aeth": 1,
    "has_immdt": 1,
    "payload_len": PAYLOAD_LEN_BITS,
    "qp": QP_BITS,
    "src_ip": 32,
})
"""One packet's transport headers. ``payload_len`` excludes BTH pad; ``qp`` is the local
QP index on transmit (unused on receive); ``src_ip`` the IPv4 source on receive (unused
on transmit): only a QP's peer speaks for it."""

WRITE_DESC = data.StructLayout({
    "qp": QP_BITS,
    "laddr": 64,     # local source address of the first byte
    "raddr": 64,     # remote virtual address (RETH.va)
    "rkey": 32,
    "len": 32,       # bytes; 0 sends one zero-length WRITE (credit messages do)
    "imm": 32,
    "has_imm": 1,
})
"""An RDMA WRITE (with immediate) work request."""


class Status:
    OK = 0
    RETRY_EXCEEDED = 1
    REMOTE_ACCESS = 2   # the peer NAKed with anything but a PSN sequence error
    FLUSHED = 3         # posted to a QP already in error


WRITE_CMPL = data.StructLayout({"qp": QP_BITS, "status": 2})
"""Requester completion: one per WRITE descriptor, in order per QP."""

RECV_CMPL = data.StructLayout({
    "qp": QP_BITS,
    "va": 64,        # where the message's first byte went
    "len": 32,
    "imm": 32,
    "has_imm": 1,
})
"""Responder completion: one per fully received (in-order, checked) message."""


def mem_write_layout(width: int) -> data.StructLayout:
    """A write beat: ``data`` byte ``i`` goes to ``addr + i`` when ``keep[i]``."""
    return data.StructLayout({"addr": 64, "data": width, "keep": width // 8, "last": 1})


MEM_READ_REQ = data.StructLayout({"addr": 64, "len": PAYLOAD_LEN_BITS})
"""Read ``len`` (> 0) bytes from ``addr``; the answer is a beat packet (byte 0 of the
first beat is ``addr``), answers in request order."""


# Only the block's register definitions matter here (not the rest of the map), so the
# layouts are built from them with the count the transport is built for.
def _block_layout(block: str, count: int, accesses) -> data.ArrayLayout:
    regs = [r for r in REGMAP[block].registers if r.access in accesses]
    return data.ArrayLayout(
        data.StructLayout({r.name: register_layout(r) for r in regs}), count)


def qp_ctl_layout(nqp: int) -> data.ArrayLayout:
    """Exactly :class:`~fpgaccl.hw.csr.bank.CSRBank`'s ``qp_ctl`` for ``nqp`` QPs."""
    return _block_layout("qp", nqp, (Access.RW, Access.WO))


def mr_ctl_layout(nmr: int) -> data.ArrayLayout:
    """Exactly :class:`~fpgaccl.hw.csr.bank.CSRBank`'s ``mr_ctl`` for ``nmr`` regions."""
    return _block_layout("mr", nmr, (Access.RW, Access.WO))


def qp_sts_layout(nqp: int) -> data.ArrayLayout:
    return _block_layout("qp", nqp, (Access.RO, Access.RC))


class QPState:
    """Values of the ``qp.state`` register (see proto.regmap)."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    ERROR = 4
