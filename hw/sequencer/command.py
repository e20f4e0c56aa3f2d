"""What the sequencer asks of the datapath, one command per data-moving instruction.

Offsets and lengths are in elements: the sequencer has already resolved chunk numbers
against the collective's geometry; the datapath multiplies by the element size and adds
the buffer base addresses it holds.
"""

# No `from __future__ import annotations` here: data.Struct reads its field shapes from
# the class annotations, which must stay values, not strings.


from amaranth.lib import data

ELEM_BITS = 32
PEER_BITS = 8
STEP_BITS = 16

class Command(data.Struct):
    op: 4           # proto.isa.SeqOp: COPY, SEND, RECV_REDUCE or GRANT
    peer: PEER_BITS
    src: 2          # proto.isa.Buf
    dst: 2          # COPY/RECV_REDUCE destination; SEND: the buffer it lands in remotely
    scratch: 2      # RECV_REDUCE: the scratch buffer holding the peer's data
    offset: ELEM_BITS
    length: ELEM_BITS
    xoffset: ELEM_BITS  # SEND: element offset at the peer; RECV_REDUCE: in scratch
    step: STEP_BITS
    coll_id: 16


class Event(data.Struct):
    """A grant or a landed message reported by the transport's receive side."""

    peer: PEER_BITS
    step: STEP_BITS
