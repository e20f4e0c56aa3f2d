"""The sequencer engine on Amaranth's simulator, its program in a block RAM read a cycle
late like the CSR bank's: the chunk-range check (chunk + count <= SETUP's nchunks), which
the RANGE state registers for EXEC, stops an out-of-range COPY or SEND before any command
leaves, and lets the in-range ones through, each judged on its own instruction."""

from amaranth.hdl import Module
from amaranth.lib.memory import Memory
from amaranth.sim import Simulator

from fpgaccl.hw.sequencer.engine import ErrorCode, Sequencer
from fpgaccl.proto.isa import Buf, Instr, SeqOp, assemble


def run(program, count=1000):
    m = Module()
    m.submodules.seq = seq = Sequencer(imem_words=32, peers=2)
    m.submodules.imem = imem = Memory(shape=32, depth=32, init=assemble(program))
    rd = imem.read_port()
    m.d.comb += [rd.addr.eq(seq.imem_raddr), seq.imem_rdata.eq(rd.data)]
    out = {"cmds": []}

    async def bench(ctx):
        ctx.set(seq.count, count)
        ctx.set(seq.cmd.ready, 1)
        ctx.set(seq.grant.valid, 1)          # SENDs find their grant
        ctx.set(seq.start, 1)
        await ctx.tick()
        ctx.set(seq.start, 0)
        ctx.set(seq.grant.valid, 0)
        for _ in range(400):
            if ctx.get(seq.cmd.valid):
                c = ctx.get(seq.cmd.payload)
                out["cmds"].append((SeqOp(c.op), c.offset, c.length))
                out.setdefault("xoffsets", []).append(c.xoffset)
                await ctx.tick()
                ctx.set(seq.cmd_done, 1)
                await ctx.tick()
                ctx.set(seq.cmd_done, 0)
                continue
            if ctx.get(seq.done) or ctx.get(seq.error):
                break
            await ctx.tick()
        out["error"] = ctx.get(seq.error)
        out["code"] = ctx.get(seq.error_code)

    sim = Simulator(m)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return out


def test_in_range_copies_issue_and_an_out_of_range_one_stops_the_program():
    ok = [Instr(SeqOp.SETUP, step=4),
          Instr(SeqOp.COPY, buf=Buf.OUT, chunk=3, count=1),     # 4 <= 4: the last chunk
          Instr(SeqOp.COPY, buf=Buf.OUT, chunk=0, count=4),
          Instr(SeqOp.DONE)]
    got = run(ok)
    assert got["error"] == 0
    assert got["cmds"] == [(SeqOp.COPY, 750, 250), (SeqOp.COPY, 0, 1000)]
    # One chunk too far, right after an in-range instruction (a verdict left from the
    # previous instruction would let it through).
    bad = [Instr(SeqOp.SETUP, step=4),
           Instr(SeqOp.COPY, buf=Buf.OUT, chunk=0, count=4),
           Instr(SeqOp.COPY, buf=Buf.OUT, chunk=3, count=2),
           Instr(SeqOp.DONE)]
    got = run(bad)
    assert got["cmds"] == [(SeqOp.COPY, 0, 1000)]
    assert got["error"] == 1 and got["code"] == ErrorCode.CHUNK_RANGE
    send = [Instr(SeqOp.SETUP, step=4),
            Instr(SeqOp.SEND, src=Buf.OUT, peer=1, chunk=2, count=3),
            Instr(SeqOp.DONE)]
    got = run(send)
    assert got["cmds"] == [] and got["code"] == ErrorCode.CHUNK_RANGE


def test_offsets_of_large_chunks_and_the_clamp_to_the_count():
    """Chunks past 2**17 elements (both halves of the chunk size are multiplied), the
    last chunk clamped to the count, and a SEND's offset at the peer from ``xchunk``."""
    count = (1 << 21) + 12345
    prog = [Instr(SeqOp.SETUP, step=5),
            Instr(SeqOp.COPY, buf=Buf.OUT, chunk=4, count=1),
            Instr(SeqOp.COPY, buf=Buf.OUT, chunk=1, count=3),
            Instr(SeqOp.SEND, src=Buf.OUT, rbuf=Buf.TMP, peer=0, chunk=2, count=1, xchunk=3),
            Instr(SeqOp.DONE)]
    cs = -(-count // 5)
    got = run(prog, count=count)
    assert got["error"] == 0
    assert got["cmds"] == [(SeqOp.COPY, 4 * cs, count - 4 * cs), (SeqOp.COPY, cs, 3 * cs),
                           (SeqOp.SEND, 2 * cs, cs)]
    assert got["xoffsets"][2] == 3 * cs


def test_abort_stops_a_program_waiting_for_a_grant_once_drained():
    """The router's signature mismatch (``abort``): the program waiting for peer 1's
    grant issues only a GRANT to the peer that differs (so that it sees our digest)
    and stops with cause SIGNATURE, but only once the datapath has drained (a SEND
    still in flight must finish first); without it, it waits. Its
    counters keep only the grants ``keep_grants`` names (for later programs): a message
    that landed for it counts for no later program."""
    m = Module()
    m.submodules.seq = seq = Sequencer(imem_words=32, peers=2)
    program = [Instr(SeqOp.SETUP, step=1),
               Instr(SeqOp.SEND, src=Buf.OUT, peer=1, chunk=0, count=1),
               Instr(SeqOp.DONE),
               # entry 3: the next program
               Instr(SeqOp.SETUP, step=1),
               Instr(SeqOp.SEND, src=Buf.OUT, peer=0, chunk=0, count=1),
               Instr(SeqOp.RECV, peer=0),
               Instr(SeqOp.DONE)]
    m.submodules.imem = imem = Memory(shape=32, depth=32, init=assemble(program))
    rd = imem.read_port()
    m.d.comb += [rd.addr.eq(seq.imem_raddr), seq.imem_rdata.eq(rd.data)]
    out = {}

    async def pulse(ctx, sig, **payload):
        for k, v in payload.items():
            ctx.set(getattr(sig.payload, k), v)
        ctx.set(sig.valid, 1)
        await ctx.tick()
        ctx.set(sig.valid, 0)

    async def bench(ctx):
        ctx.set(seq.count, 100)
        ctx.set(seq.cmd.ready, 1)
        ctx.set(seq.start, 1)
        await ctx.tick()
        ctx.set(seq.start, 0)
        # Peer 0: a message of this call and a grant for the next.
        await pulse(ctx, seq.landed, peer=0)
        await pulse(ctx, seq.grant, peer=0)
        await ctx.tick().repeat(40)
        out["waiting"] = ctx.get(seq.busy) and not ctx.get(seq.cmd.valid)
        ctx.set(seq.drained, 0)
        ctx.set(seq.abort, 1)
        ctx.set(seq.abort_peer, 1)
        ctx.set(seq.keep_grants[:seq.counter_bits], 1)   # peer 0: 1 grant
        await ctx.tick().until(seq.cmd.valid)
        c = ctx.get(seq.cmd.payload)
        out["told"] = (SeqOp(c.op), c.peer, c.length)
        await ctx.tick()
        ctx.set(seq.cmd_done, 1)
        await ctx.tick()
        ctx.set(seq.cmd_done, 0)
        await ctx.tick().repeat(20)
        out["stopped_early"] = not ctx.get(seq.busy)
        out["more"] = ctx.get(seq.cmd.valid)
        ctx.set(seq.drained, 1)
        await ctx.tick().repeat(3)
        out["busy"], out["error"] = ctx.get(seq.busy), ctx.get(seq.error)
        out["code"], out["cmd"] = ctx.get(seq.error_code), ctx.get(seq.cmd.valid)
        ctx.set(seq.abort, 0)
        ctx.set(seq.entry, 3)
        ctx.set(seq.start, 1)
        await ctx.tick()
        ctx.set(seq.start, 0)
        sends = 0
        for _ in range(200):
            if ctx.get(seq.cmd.valid):
                sends += 1
                await ctx.tick()
                ctx.set(seq.cmd_done, 1)
                await ctx.tick()
                ctx.set(seq.cmd_done, 0)
                continue
            await ctx.tick()
        out["sends"], out["next_busy"] = sends, ctx.get(seq.busy)

    sim = Simulator(m)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    assert out["waiting"] and not out["stopped_early"] and not out["more"]
    assert out["told"] == (SeqOp.GRANT, 1, 0)
    assert (out["busy"], out["error"], out["code"], out["cmd"]) == (
        0, 1, ErrorCode.SIGNATURE, 0)
    # The kept grant lets the next program's SEND go; the landed message is gone, so
    # its RECV waits.
    assert out["sends"] == 1 and out["next_busy"]
