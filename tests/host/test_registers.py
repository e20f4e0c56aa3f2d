"""The register-driven backend's mapping of a node's signature mismatch: the digest is
written with every program, and a port's NodeMismatch (decoded from ctrl.status and the
coll.mismatch_* registers) becomes the CollectiveMismatchError the software backend
raises, with nothing put into the caller's buffers."""

from __future__ import annotations

import numpy as np

from fpgaccl.errors import CollectiveMismatchError
from fpgaccl.host.backends.base import ProgramRun, Segment
from fpgaccl.host.backends.registers import NodeMismatch, RegisterBackend, node_mismatch
from fpgaccl.host.executor import digest_mismatch_error
from fpgaccl.proto import programs as lib
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.proto.regmap import StopCause, default_map
from fpgaccl.proto.signature import Kind, Signature

RMAP = default_map(qps=4, imem_words=256, dma=False)
THEIRS = 0x3E27_42BA_17B5_E21C


class _Port:
    """A node that stops every program on a mismatch with rank 0, as its registers
    say (the decoding is node_mismatch's, the registers a node's)."""

    clock_mhz, rmap, imem_words, stage_bytes, native_barrier = 250.0, RMAP, 256, 4096, False
    buffers = (0, 4096, 8192, 12288)

    def __init__(self) -> None:
        self.writes = []

    def execute(self, name, coll_id, writes, inbuf, out_bytes, signature, deadline_s):
        self.writes += writes
        at = RMAP.address
        regs = {at("ctrl.status"): RMAP["ctrl"]["status"].encode(
                    error=1, cause=int(StopCause.SIGNATURE)),
                at("coll.mismatch_peer"): 0, at("coll.peer_sig_lo"): THEIRS & 0xFFFFFFFF,
                at("coll.peer_sig_hi"): THEIRS >> 32}
        status = RMAP["ctrl"]["status"].decode(regs[at("ctrl.status")])
        raise node_mismatch(RMAP, status, regs.__getitem__)


def test_a_node_mismatch_is_the_software_backends_error() -> None:
    port = _Port()
    backend = RegisterBackend("sim", 1, 2, port, barrier_at_close=False)
    sig = Signature(1, Kind.ALLREDUCE, 8, DType.INT32, ReduceOp.MAX, None, 5, rank=1)
    x = np.arange(8, dtype=np.int32)
    put = []
    run = ProgramRun("allreduce", tuple(lib.rd_allreduce(1, 2)), DType.INT32, x.dtype,
                     ReduceOp.MAX, [Segment(1, 0, 8, 8)], lambda lo, hi: x[lo:hi],
                     lambda out, lo, hi: put.append(out), signature=sig)
    call = backend.run(run, 5.0)       # runs on the backend's own thread
    assert call.event.wait(5)
    err = call.error
    assert isinstance(err, CollectiveMismatchError)
    want = digest_mismatch_error(0, THEIRS, 1, sig.digest)
    assert (err.field, err.ranks, err.values) == (want.field, want.ranks, want.values)
    assert err.ranks == (0, 1) and err.values[0] == f"{THEIRS:#x}"
    assert put == []
    got = dict(port.writes)
    assert got[RMAP.address("coll.sig_lo")] | got[RMAP.address("coll.sig_hi")] << 32 == \
        sig.digest


def test_other_stops_are_no_mismatch() -> None:
    word = RMAP["ctrl"]["status"].encode(error=1, cause=int(StopCause.CHUNK_RANGE))
    assert node_mismatch(RMAP, RMAP["ctrl"]["status"].decode(word), lambda a: 0) is None
    ok = RMAP["ctrl"]["status"].decode(0)
    assert node_mismatch(RMAP, ok, lambda a: 0) is None
    assert isinstance(node_mismatch(
        RMAP, RMAP["ctrl"]["status"].decode(RMAP["ctrl"]["status"].encode(
            error=1, cause=int(StopCause.SIGNATURE))), lambda a: 2), NodeMismatch)
