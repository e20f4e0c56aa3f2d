"""The router's dispatch scoreboard on Amaranth's simulator: commands are handed on
without waiting for them to finish, except where an earlier one still reads what a
later one writes (or writes what it reads), a peer already has a message in flight, or a
GRANT needs everything drained."""

from amaranth.sim import Simulator

from fpgaccl.hw.datapath.router import Router
from fpgaccl.hw.net.layouts import header_layout
from fpgaccl.proto import COLLECTIVE_IMM
from fpgaccl.proto.isa import Buf, SeqOp
from fpgaccl.proto.reduce import DType

PEERS = 4


def command(op, *, peer=1, src=Buf.OUT, dst=Buf.OUT, offset=0, length=8, step=0):
    return {"op": int(op), "peer": peer, "src": int(src), "dst": int(dst),
            "scratch": int(Buf.TMP), "offset": offset, "length": length, "xoffset": offset,
            "step": step, "coll_id": 1}


def run(script):
    dut = Router(PEERS)

    async def bench(ctx):
        ctx.set(dut.ctx.dtype, int(DType.INT32))
        for i in range(4):
            ctx.set(dut.ctx.base[i], 0x1000 * (i + 1))
        for s in (dut.copy_job, dut.reduce_job, dut.desc):
            ctx.set(s.ready, 1)
        await script(ctx, dut)

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()


async def issue(ctx, dut, cmd):
    """Hand the router one command; returns once it has taken it."""
    ctx.set(dut.cmd.payload, cmd)
    ctx.set(dut.cmd.valid, 1)
    await ctx.tick().until(dut.cmd.ready)
    ctx.set(dut.cmd.valid, 0)


async def watch(ctx, dut, cycles):
    """Which job/descriptor outputs fired, and whether cmd_done pulsed, over ``cycles``."""
    seen = set()
    for _ in range(cycles):
        await ctx.tick()
        for name in ("copy_job", "reduce_job", "desc"):
            if ctx.get(getattr(dut, name).valid):
                seen.add(name)
        if ctx.get(dut.cmd_done):
            seen.add("done")
    return seen


async def complete_send(ctx, dut, peer):
    ctx.set(dut.cmpl.payload, {"qp": peer, "status": 0})
    ctx.set(dut.cmpl.valid, 1)
    await ctx.tick()
    ctx.set(dut.cmpl.valid, 0)


async def finish_reduce(ctx, dut):
    ctx.set(dut.reduce_done, 1)
    await ctx.tick()
    ctx.set(dut.reduce_done, 0)


def test_send_does_not_wait_for_its_acknowledgement():
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.SEND, offset=0, length=8))
        assert await watch(ctx, dut, 4) == {"desc", "done"}
        assert not ctx.get(dut.idle)
        # A reduction into other elements runs while the SEND is unacknowledged.
        await issue(ctx, dut, command(SeqOp.RECV_REDUCE, offset=8, length=8))
        assert await watch(ctx, dut, 4) == {"reduce_job", "done"}
        await finish_reduce(ctx, dut)
        await complete_send(ctx, dut, 1)
        await ctx.tick()
        assert ctx.get(dut.idle)
    run(script)


def test_write_after_read_waits_for_the_acknowledgement():
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.SEND, offset=0, length=8))
        await watch(ctx, dut, 2)
        # Overlaps the SEND's last element: the transport may still re-read it.
        await issue(ctx, dut, command(SeqOp.RECV_REDUCE, offset=7, length=8))
        assert await watch(ctx, dut, 20) == set()
        await complete_send(ctx, dut, 1)
        assert await watch(ctx, dut, 4) == {"reduce_job", "done"}
    run(script)


def test_a_copy_into_another_buffer_does_not_wait():
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.SEND, src=Buf.OUT, offset=0, length=8))
        await watch(ctx, dut, 2)
        await issue(ctx, dut, command(SeqOp.COPY, src=Buf.IN, dst=Buf.TMP, offset=0,
                                      length=8))
        assert await watch(ctx, dut, 4) == {"copy_job", "done"}
    run(script)


def test_read_after_write_waits_for_the_reduction():
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.RECV_REDUCE, offset=16, length=8))
        await watch(ctx, dut, 2)
        await issue(ctx, dut, command(SeqOp.SEND, peer=2, offset=20, length=8))
        assert await watch(ctx, dut, 20) == set()
        await finish_reduce(ctx, dut)
        assert await watch(ctx, dut, 4) == {"desc", "done"}
        # A SEND of elements the reduction did not touch would not have waited.
        await complete_send(ctx, dut, 2)
        await issue(ctx, dut, command(SeqOp.RECV_REDUCE, offset=16, length=8))
        await watch(ctx, dut, 2)
        await issue(ctx, dut, command(SeqOp.SEND, peer=2, offset=24, length=8))
        assert await watch(ctx, dut, 4) == {"desc", "done"}
    run(script)


def test_one_message_per_peer_and_grant_drains_everything():
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.SEND, peer=1, offset=0, length=8))
        await watch(ctx, dut, 2)
        await issue(ctx, dut, command(SeqOp.SEND, peer=1, offset=8, length=8))
        assert await watch(ctx, dut, 20) == set()
        await complete_send(ctx, dut, 1)
        assert await watch(ctx, dut, 4) == {"desc", "done"}
        # Another peer's message goes alongside.
        await issue(ctx, dut, command(SeqOp.SEND, peer=3, offset=8, length=8))
        assert await watch(ctx, dut, 4) == {"desc", "done"}
        await issue(ctx, dut, command(SeqOp.GRANT, peer=2, length=0))
        assert await watch(ctx, dut, 10) == set()
        await complete_send(ctx, dut, 1)
        assert await watch(ctx, dut, 10) == set()
        await complete_send(ctx, dut, 3)
        assert await watch(ctx, dut, 4) == {"desc", "done"}
        assert ctx.get(dut.desc.payload.len) == 0
    run(script)


def test_a_completion_in_a_dispatch_cycle_is_not_lost():
    # Peer 1's completion lands at every cycle around peer 2's dispatch, one of them
    # the dispatch's own: both busy flags change then, and neither may be lost.
    for delay in range(5):
        async def script(ctx, dut, delay=delay):
            await issue(ctx, dut, command(SeqOp.SEND, peer=1, offset=0, length=8))
            await watch(ctx, dut, 2)
            await issue(ctx, dut, command(SeqOp.SEND, peer=2, offset=8, length=8))
            for _ in range(delay):
                await ctx.tick()
            await complete_send(ctx, dut, 1)
            await watch(ctx, dut, 4)
            assert not ctx.get(dut.idle)
            await complete_send(ctx, dut, 2)
            await ctx.tick()
            assert ctx.get(dut.idle), f"completion {delay} cycles after the take"
        run(script)


def test_hazards_are_judged_against_the_command_just_taken():
    """The command before left no hazard against its own buffers (a SEND landing in the
    peer's TMP, a reduction reading IN), but the next one overlaps what it put in flight:
    a hazard verdict that still described the previous command would let it through."""
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.SEND, src=Buf.OUT, dst=Buf.TMP, offset=0,
                                      length=8))
        assert await watch(ctx, dut, 2) == {"desc", "done"}
        await issue(ctx, dut, command(SeqOp.RECV_REDUCE, src=Buf.OUT, dst=Buf.OUT,
                                      offset=0, length=8))
        assert await watch(ctx, dut, 20) == set()
        await complete_send(ctx, dut, 1)
        assert await watch(ctx, dut, 4) == {"reduce_job", "done"}
        # Read after write: the reduction still writes what this SEND reads.
        await issue(ctx, dut, command(SeqOp.SEND, peer=2, src=Buf.OUT, offset=4,
                                      length=8))
        assert await watch(ctx, dut, 20) == set()
        await finish_reduce(ctx, dut)
        assert await watch(ctx, dut, 4) == {"desc", "done"}
    run(script)


def test_jobs_and_descriptors_carry_the_commands_addresses():
    """Byte addresses: local buffer base + offset, the scratch (and the peer's buffer)
    at ``xoffset``, the peer's key for that buffer, lengths in bytes (int32: x4)."""
    async def script(ctx, dut):
        for p in range(PEERS):
            for i in range(4):
                ctx.set(dut.ctx.rbase[p][i], 0x100000 * (p + 1) + 0x10000 * i)
                ctx.set(dut.ctx.rkey[p][i], 16 * p + i)
        cmd = command(SeqOp.SEND, peer=2, src=Buf.IN, dst=Buf.TMP2, offset=5, length=3)
        await issue(ctx, dut, {**cmd, "xoffset": 9})
        await ctx.tick().until(dut.desc.valid)
        d = ctx.get(dut.desc.payload)
        assert (d.qp, d.laddr, d.raddr, d.rkey, d.len) == (
            2, 0x1000 * (int(Buf.IN) + 1) + 5 * 4,
            0x300000 + 0x10000 * int(Buf.TMP2) + 9 * 4, 16 * 2 + int(Buf.TMP2), 12)
        await complete_send(ctx, dut, 2)
        cmd = command(SeqOp.RECV_REDUCE, src=Buf.IN, dst=Buf.OUT, offset=7, length=2)
        await issue(ctx, dut, {**cmd, "xoffset": 1})
        await ctx.tick().until(dut.reduce_job.valid)
        j = ctx.get(dut.reduce_job.payload)
        assert (j.a, j.b, j.dst, j.len) == (
            0x1000 * (int(Buf.IN) + 1) + 28, 0x1000 * (int(Buf.TMP) + 1) + 4,
            0x1000 * (int(Buf.OUT) + 1) + 28, 8)

    run(script)


def test_local_commands_leave_the_peers_ranges_alone():
    """A peer slot takes a SEND's range before its dispatch, and only a SEND's (or
    GRANT's): a reduction whose (unused) peer field names a busy peer must not replace
    that peer's in-flight range, or a later write over the SEND's source would pass."""
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.SEND, peer=1, offset=0, length=8))
        assert await watch(ctx, dut, 2) == {"desc", "done"}
        await issue(ctx, dut, command(SeqOp.RECV_REDUCE, peer=1, offset=16, length=8))
        assert await watch(ctx, dut, 4) == {"reduce_job", "done"}
        await finish_reduce(ctx, dut)
        await issue(ctx, dut, command(SeqOp.COPY, peer=1, src=Buf.IN, offset=4, length=8))
        assert await watch(ctx, dut, 20) == set()
        await complete_send(ctx, dut, 1)
        assert await watch(ctx, dut, 4) == {"copy_job", "done"}
    run(script)


def test_a_grant_in_flight_holds_no_range():
    """A GRANT reads nothing, so while it is unacknowledged a write over the elements of
    its command's offset/length still goes: its slot's range stays empty after the
    dispatch too."""
    async def script(ctx, dut):
        await issue(ctx, dut, command(SeqOp.GRANT, peer=2, offset=0, length=8))
        assert await watch(ctx, dut, 4) == {"desc", "done"}
        await issue(ctx, dut, command(SeqOp.COPY, src=Buf.IN, dst=Buf.OUT, offset=0,
                                      length=8))
        assert await watch(ctx, dut, 4) == {"copy_job", "done"}
    run(script)


DIGEST = 0x0123_4567_89AB_CDEF
_IMM = header_layout(COLLECTIVE_IMM)


def _imm(step, grant, coll_id):
    return _IMM.const({"coll_id": coll_id, "step": step, "grant": grant}).as_value().value


async def receive(ctx, dut, *, peer, va, step=0, grant=1, coll_id=1):
    """One receive completion; the grant/landed events and mismatch state after it."""
    ctx.set(dut.recv.payload, {"qp": peer, "va": va, "len": 0,
                               "imm": _imm(step, grant, coll_id), "has_imm": 1})
    ctx.set(dut.recv.valid, 1)
    await ctx.tick()
    ctx.set(dut.recv.valid, 0)
    events = []
    for _ in range(4):
        for name in ("grant", "landed"):
            s = getattr(dut, name)
            if ctx.get(s.valid):
                events.append((name, ctx.get(s.payload.peer), ctx.get(s.payload.step)))
        await ctx.tick()
    return events


async def start(ctx, dut, coll_id, sig):
    """A doorbell: the program's coll_id and digest, and the start pulse."""
    ctx.set(dut.coll_id, coll_id)
    ctx.set(dut.ctx.sig, sig)
    ctx.set(dut.start, 1)
    await ctx.tick()
    ctx.set(dut.start, 0)
    await ctx.tick().repeat(6)       # the sequencer's first EXEC comes no sooner


def ahead(ctx, dut):
    """The ``ahead`` counts per peer (a flat port, counter_bits per peer)."""
    bits = len(dut.ahead) // PEERS
    return [ctx.get(dut.ahead[bits * p:bits * (p + 1)]) for p in range(PEERS)]


def test_a_grant_carries_the_digest_in_its_va():
    async def script(ctx, dut):
        ctx.set(dut.ctx.sig, DIGEST)
        ctx.set(dut.ctx.rbase[2][int(Buf.OUT)], 0x500000)
        await issue(ctx, dut, command(SeqOp.GRANT, peer=2, offset=3, length=8))
        await ctx.tick().until(dut.desc.valid)
        d = ctx.get(dut.desc.payload)
        assert (d.qp, d.raddr, d.len) == (2, DIGEST, 0)
        await complete_send(ctx, dut, 2)
        # A SEND still goes to the peer's buffer.
        await issue(ctx, dut, command(SeqOp.SEND, peer=2, offset=3, length=8))
        await ctx.tick().until(dut.desc.valid)
        assert ctx.get(dut.desc.payload.raddr) == 0x500000 + 3 * 4
    run(script)


def test_a_grant_with_another_digest_is_no_grant():
    """For the running program (its coll_id): an equal digest, or 0 on either side, is
    a grant; a differing one raises ``mismatch`` with the peer and its digest (the
    first such, until ``start``) and never becomes a grant event; the call's later
    grants and messages are dropped. Messages are events whatever their VA."""
    async def script(ctx, dut):
        await start(ctx, dut, 1, DIGEST)
        assert await receive(ctx, dut, peer=1, va=DIGEST, step=4) == [("grant", 1, 4)]
        assert await receive(ctx, dut, peer=2, va=0, step=5) == [("grant", 2, 5)]
        assert await receive(ctx, dut, peer=3, va=0x4000, grant=0) == [("landed", 3, 0)]
        assert not ctx.get(dut.mismatch)
        other = DIGEST ^ (1 << 40)
        assert await receive(ctx, dut, peer=3, va=other, step=6) == []
        assert ctx.get(dut.mismatch)
        assert (ctx.get(dut.mismatch_peer), ctx.get(dut.mismatch_sig)) == (3, other)
        assert await receive(ctx, dut, peer=1, va=other ^ 1) == []
        assert await receive(ctx, dut, peer=1, va=DIGEST) == []
        assert await receive(ctx, dut, peer=2, va=0x40, grant=0) == []
        assert (ctx.get(dut.mismatch_peer), ctx.get(dut.mismatch_sig)) == (3, other)
        # Without a digest of our own (send/recv, numbered apart), nothing is compared
        # and no grant is behind: one of another program counts as ahead.
        await start(ctx, dut, 0x900, 0)
        assert not ctx.get(dut.mismatch)
        assert await receive(ctx, dut, peer=1, va=other, step=7, coll_id=0x900) == [
            ("grant", 1, 7)]
        assert await receive(ctx, dut, peer=2, va=other, step=8, coll_id=3) == [
            ("grant", 2, 8)]
        assert not ctx.get(dut.mismatch)
        assert ahead(ctx, dut)[1:3] == [0, 1]
    run(script)


def test_grants_ahead_are_checked_at_start_and_leftovers_dropped():
    """A grant for a later program (a peer that is ahead, before our doorbell) counts
    at once, in ``ahead`` too, and its digest is compared once that program starts; a
    grant or checked message behind the running program's coll_id (a failed call's
    leftover) is dropped."""
    async def script(ctx, dut):
        other = DIGEST + 1
        await start(ctx, dut, 5, DIGEST)
        assert await receive(ctx, dut, peer=1, va=DIGEST, coll_id=6, step=1) == [
            ("grant", 1, 1)]
        assert await receive(ctx, dut, peer=2, va=other, coll_id=6, step=2) == [
            ("grant", 2, 2)]
        assert await receive(ctx, dut, peer=2, va=other, coll_id=7, step=3) == [
            ("grant", 2, 3)]
        assert ahead(ctx, dut) == [0, 1, 2, 0]
        assert await receive(ctx, dut, peer=3, va=DIGEST, coll_id=4) == []
        assert await receive(ctx, dut, peer=3, va=0x40, grant=0, coll_id=4) == []
        assert not ctx.get(dut.mismatch)
        await start(ctx, dut, 6, DIGEST)
        assert ctx.get(dut.mismatch)
        assert (ctx.get(dut.mismatch_peer), ctx.get(dut.mismatch_sig)) == (2, other)
        assert ahead(ctx, dut) == [0] * PEERS
        # Agreeing grants ahead pass.
        assert await receive(ctx, dut, peer=1, va=DIGEST + 2, coll_id=7) == [
            ("grant", 1, 0)]
        await start(ctx, dut, 7, DIGEST + 2)
        assert not ctx.get(dut.mismatch)
    run(script)


def test_of_several_early_digests_that_differ_the_lowest_peer_is_latched():
    """Grants ahead from peers 3 and 1 with digests that differ from the program's:
    at its start the lowest peer and its digest are latched, whatever the order."""
    async def script(ctx, dut):
        await start(ctx, dut, 5, DIGEST)
        assert await receive(ctx, dut, peer=3, va=DIGEST ^ 3, coll_id=6, step=1) == [
            ("grant", 3, 1)]
        assert await receive(ctx, dut, peer=2, va=DIGEST, coll_id=6, step=2) == [
            ("grant", 2, 2)]
        assert await receive(ctx, dut, peer=1, va=DIGEST ^ (1 << 63), coll_id=6,
                             step=3) == [("grant", 1, 3)]
        assert not ctx.get(dut.mismatch)
        await start(ctx, dut, 6, DIGEST)
        assert ctx.get(dut.mismatch)
        assert (ctx.get(dut.mismatch_peer), ctx.get(dut.mismatch_sig)) == (
            1, DIGEST ^ (1 << 63))
    run(script)
