"""cocotb bench: library programs on N HDL sequencers joined by a Python datapath and
network. The datapath does what the node's DMA, reduce unit and transport will do
(copy, reduce, RDMA WRITE with immediate, grants); the links deliver in order per peer
pair with seeded random latency. Results must equal the executable model's bit for bit.
"""

import random
from collections import deque

import cocotb
import numpy as np
from amaranth.lib import data
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from fpgaccl.hw.sequencer.command import Command, Event
from fpgaccl.proto import programs as P
from fpgaccl.proto.isa import Buf, SeqOp, assemble
from fpgaccl.proto.reduce import DType, ReduceOp, reduce_reference
from fpgaccl.sim import bench_params
from fpgaccl.sim.models.sequencer import SequencerModel
from fpgaccl.sim.models.stream import pack, unpack

CMD = data.Layout.cast(Command)
EVT = data.Layout.cast(Event)


class Datapath:
    """Per-rank buffers plus the links between ranks."""

    def __init__(self, dut, world, inputs, dtype, op, rng):
        self.dut, self.world, self.rng = dut, world, rng
        self.dtype, self.op = dtype, op
        n = len(inputs[0])
        self.bufs = []
        for x in inputs:
            scratch = np.zeros(n + 256, dtype=x.dtype)
            self.bufs.append({Buf.IN: x.copy(), Buf.OUT: np.zeros_like(x),
                              Buf.TMP: scratch.copy(), Buf.TMP2: scratch.copy()})
        self.links: dict[tuple[int, int], deque] = {}
        self.last_arrival: dict[tuple[int, int], int] = {}
        self.done_at = [None] * world
        self.grant_q = [deque() for _ in range(world)]
        self.landed_q = [deque() for _ in range(world)]

    def command(self, r, c, now):
        op, b = SeqOp(c["op"]), self.bufs[r]
        lo, hi = c["offset"], c["offset"] + c["length"]
        if op is SeqOp.COPY:
            b[Buf(c["dst"])][lo:hi] = b[Buf(c["src"])][lo:hi]
        elif op is SeqOp.RECV_REDUCE:
            xs = c["xoffset"]
            b[Buf(c["dst"])][lo:hi] = reduce_reference(
                self.dtype, self.op, b[Buf(c["src"])][lo:hi],
                b[Buf(c["scratch"])][xs:xs + hi - lo])
        elif op in (SeqOp.SEND, SeqOp.GRANT):
            key = (r, c["peer"])
            at = max(self.last_arrival.get(key, 0), now + self.rng.randint(2, 40))
            self.last_arrival[key] = at
            payload = b[Buf(c["src"])][lo:hi].copy() if op is SeqOp.SEND else None
            self.links.setdefault(key, deque()).append(
                (at, op, c["step"], Buf(c["dst"]), c["xoffset"], payload))
        else:
            raise AssertionError(f"rank {r}: unexpected command {op!r}")
        self.done_at[r] = now + self.rng.randint(1, 4)

    def deliver(self, now):
        for (src, dst), q in list(self.links.items()):
            while q and q[0][0] <= now:
                _, op, step, rbuf, xoff, payload = q.popleft()
                if op is SeqOp.SEND:
                    self.bufs[dst][rbuf][xoff:xoff + len(payload)] = payload
                    self.landed_q[dst].append((src, step))
                else:
                    self.grant_q[dst].append((src, step))
            if not q:
                del self.links[(src, dst)]


async def run_collective(dut, programs, inputs, dtype, op, seed, max_cycles=200_000):
    world = len(programs)
    rng = random.Random(seed)
    for r, prog in enumerate(programs):
        for i, w in enumerate(assemble(prog)):
            dut.load_rank.value, dut.load_addr.value, dut.load_data.value = r, i, w
            dut.load_en.value = 1
            await RisingEdge(dut.clk)
    dut.load_en.value = 0
    dp = Datapath(dut, world, inputs, dtype, op, rng)
    cmd = [getattr(dut, f"cmd{r}__payload") for r in range(world)]
    cmd_valid = [getattr(dut, f"cmd{r}__valid") for r in range(world)]
    for r in range(world):
        getattr(dut, f"cmd{r}__ready").value = 1
    dut.count.value = len(inputs[0])
    dut.coll_id.value = seed & 0xFFFF
    dut.start.value = (1 << world) - 1
    await RisingEdge(dut.clk)
    dut.start.value = 0
    finished = [False] * world
    for now in range(max_cycles):
        await RisingEdge(dut.clk)
        done_bits, err_bits = int(dut.done.value), int(dut.error.value)
        assert err_bits == 0, f"sequencer error on ranks {err_bits:#b}"
        for r in range(world):
            finished[r] |= bool(done_bits >> r & 1)
            if cmd_valid[r].value:
                c = unpack(CMD, int(cmd[r].value))
                if bench_params().get("trace"):
                    dut._log.info(f"rank {r} @{now}: {SeqOp(c['op']).name} {c}")
                dp.command(r, c, now)
            getattr(dut, f"cmd_done{r}").value = int(dp.done_at[r] == now)
        dp.deliver(now)
        for r in range(world):
            for q, name in ((dp.grant_q[r], "grant"), (dp.landed_q[r], "landed")):
                valid = getattr(dut, f"{name}{r}__valid")
                if q:
                    peer, step = q.popleft()
                    getattr(dut, f"{name}{r}__payload").value = pack(EVT, {"peer": peer,
                                                                          "step": step})
                    valid.value = 1
                else:
                    valid.value = 0
        if all(finished) and not dp.links:
            return [b[Buf.OUT] for b in dp.bufs], now
    raise AssertionError(f"collective did not finish in {max_cycles} cycles: {finished}")


def cases():
    worlds = bench_params().get("worlds", [1, 2, 3, 4, 5, 8])
    for world in worlds:
        yield "ring_allreduce", world, lambda r, w=world: P.ring_allreduce(r, w)
        yield "rhd_allreduce", world, lambda r, w=world: P.rhd_allreduce(r, w)
        yield "ring_reduce_scatter", world, lambda r, w=world: P.ring_reduce_scatter(r, w)
        yield "ring_allgather", world, lambda r, w=world: P.ring_allgather(r, w)
        yield "chain_broadcast", world, lambda r, w=world: P.chain_broadcast(r, w, w // 2)
        yield "chain_reduce", world, lambda r, w=world: P.chain_reduce(r, w, w - 1)
        yield "alltoall", world, lambda r, w=world: P.alltoall(r, w)
        yield "gather", world, lambda r, w=world: P.gather(r, w, w - 1)
        yield "scatter", world, lambda r, w=world: P.scatter(r, w, w // 2)
        yield "barrier", world, lambda r, w=world: P.barrier(r, w)
        if world > 1:   # a pair: the others run an empty program
            yield "p2p", world, lambda r, w=world: (
                P.p2p_send(r, w, w - 1) if r == 0 else P.p2p_recv(r, w, 0) if r == w - 1
                else [P.Instr(SeqOp.SETUP, step=1), P.DONE])
        if world % 2 == 0 and world > 2:
            yield "hierarchical_allreduce", world, \
                lambda r, w=world: P.hierarchical_allreduce(r, w, 2)


@cocotb.test()
async def library_programs_match_the_model(dut):
    Clock(dut.clk, 4, unit="ns").start()
    dut.rst.value = 1
    await ClockCycles(dut.clk, 2)
    dut.rst.value = 0
    log = []
    for i, (name, world, gen) in enumerate(cases()):
        for dtype, op, npt in ((DType.INT32, ReduceOp.SUM, np.int32),
                               (DType.FLOAT32, ReduceOp.SUM, np.float32)):
            rng = np.random.default_rng(i)
            n = int(rng.integers(world, 9 * world + 3))
            if name in ("alltoall", "gather", "scatter"):  # equal blocks, as the API makes them
                n -= n % world
            xs = [(rng.standard_normal(n) * 100).astype(npt) for _ in range(world)]
            progs = [gen(r) for r in range(world)]
            got, cycles = await run_collective(dut, progs, xs, dtype, op, seed=i)
            want = SequencerModel(progs, xs, dtype, op, seed=i).run()
            for r in range(world):
                assert got[r].tobytes() == want[r].tobytes(), \
                    f"{name} world={world} {dtype.name} rank {r}: {got[r]} != {want[r]}"
            log.append(f"{name} w={world} {dtype.name}: {cycles} cycles")
    dut._log.info("\n".join(log))
