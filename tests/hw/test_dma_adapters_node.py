"""One DmaNode on Amaranth's simulator at 128 bits (the Verilator test runs 64): WORK
entries start a copy program host -> GPU window through the node's copy engine; the
same program into an unmapped GPU page completes with UNMAPPED and writes nothing; a
WORK entry for a disabled node completes with NOT_STARTED."""

import pytest
from amaranth.sim import Simulator

from fpgaccl.hw.dma_node import DmaNode
from fpgaccl.proto import programs as P
from fpgaccl.proto.plans import collective_writes
from fpgaccl.proto.queues import Opcode, Space, Status, node_addr, pack_wqe, unpack_cqe, work_imm
from fpgaccl.proto.reduce import DType, ReduceOp
from fpgaccl.sim.models.gpu import GPU_PAGE, VA_BASE, GpuMemory
from fpgaccl.sim.models.host_memory import HostMemory
from fpgaccl.sim.tb.dma_agents import AxiAgent, run_agents

IN, TMP, TMP2, SQ, CQ = 0x1_0000, 0x2_0000, 0x3_0000, 0x8_0000, 0x9_0000


class Csr:
    """Applies phases of register writes, one per cycle; a phase starts once its
    predicate holds."""

    def __init__(self, dut, phases):
        self.dut, self.phases, self.q = dut, list(phases), []

    def drive(self, ctx):
        if not self.q and self.phases and self.phases[0][0]():
            self.q = list(self.phases.pop(0)[1])
        ctx.set(self.dut.csr.w_stb, bool(self.q))
        if self.q:
            addr, value = self.q.pop(0)
            ctx.set(self.dut.csr.addr, addr)
            ctx.set(self.dut.csr.w_data, value)

    def sample(self, ctx):
        pass

    def commit(self):
        pass


@pytest.mark.slow
def test_dma_node_copy_and_unmapped_128():
    width = 128
    dut = DmaNode(width, qps=2, regions=2, imem_words=64, mtu=1024, seg_bytes=1024,
                  timeout=1 << 12, gpu_pages=64)
    rm = dut.regmap
    host, gpu = HostMemory(width, stall=0.1, seed=1), GpuMemory(width, pages=64, seed=2)
    va = gpu.alloc(GPU_PAGE)
    n = 300
    payload = bytes((7 * i + 3) & 0xFF for i in range(4 * n))
    host.mem.write(IN, payload)
    host.mem.write(CQ, bytes(256))
    dst = va + 0x100 + 5

    def w(path, **f):
        b, r = path.split(".")
        return rm.address(path), rm[b][r].encode(**f)

    setup = [w("ctrl.control", enable=1),
             *collective_writes(rm, [*P._setup(1), P.DONE],
                                buffers=[IN, node_addr(Space.GPU, dst), TMP, TMP2], count=n,
                                dtype=DType.INT32, op=ReduceOp.SUM),
             (rm.address("dma_host.length"), 0xFFFF_F000),
             w("dma_host.access", read=1, write=1),
             (rm.address("dma.gpu_va_lo"), VA_BASE & 0xFFFF_FFFF),
             (rm.address("dma.gpu_va_hi"), VA_BASE >> 32),
             *[(rm.address(f"dma_gpt.pte{p.index}"),
                rm["dma_gpt"]["pte0"].encode(valid=1, read=1, write=1, page=p.bus >> 16))
               for p in gpu.register(va, GPU_PAGE)],
             (rm.address("dma.sq_base_lo"), SQ), w("dma.sq_cfg", log2_size=4),
             (rm.address("dma.cq_base_lo"), CQ), w("dma.cq_cfg", log2_size=4),
             w("dma.control", enable=1, max_rd=16, max_wr=16),
             (rm.address("dma.sq_tail"), 1)]
    hole = node_addr(Space.GPU, VA_BASE + 30 * GPU_PAGE)
    second = [(rm.address("coll.out_lo"), hole & 0xFFFF_FFFF),
              (rm.address("coll.out_hi"), hole >> 32), (rm.address("dma.sq_tail"), 2)]
    third = [w("ctrl.control", enable=0), (rm.address("dma.sq_tail"), 3)]
    for i in range(3):
        host.mem.write(SQ + 64 * i, pack_wqe(opcode=Opcode.WORK, wr_id=i + 1,
                                             imm=work_imm(0, i + 1)))

    def cqe(i):
        return unpack_cqe(host.mem.read(CQ + 16 * i, 16))

    first_done = {}

    def after_first():
        if cqe(0)["phase"] and "writes" not in first_done:
            first_done["writes"] = len(gpu.writes())
        return bool(cqe(0)["phase"])

    csr = Csr(dut, [(lambda: True, setup), (after_first, second),
                    (lambda: cqe(1)["phase"] == 1, third)])

    class Net:
        def drive(self, ctx):
            ctx.set(dut.tx.ready, 1)

        def sample(self, ctx):
            pass

        def commit(self):
            pass

    sim = Simulator(dut)
    sim.add_clock(1e-8)

    async def tb(ctx):
        await run_agents(ctx, [csr, Net(), AxiAgent(dut.host, host), AxiAgent(dut.gpu, gpu)],
                         lambda: cqe(2)["phase"] == 1 and host.idle(), 20_000)

    sim.add_testbench(tb)
    sim.run()
    assert cqe(0) == {"wr_id": 1, "len": 0, "opcode": Opcode.WORK, "status": Status.OK,
                      "phase": 1}
    assert gpu.read_va(dst, len(payload)) == payload
    assert gpu.read_va(dst - 5, 5) == bytes(5)
    assert gpu.read_va(dst + len(payload), 16) == bytes(16)
    assert cqe(1)["status"] == Status.UNMAPPED
    assert len(gpu.writes()) == first_done["writes"]      # nothing after the first program
    assert cqe(2)["status"] == Status.NOT_STARTED          # the node was disabled
