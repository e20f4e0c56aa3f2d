"""Goodput of the transport: node 0 WRITEs ``msg_bytes`` messages to node 1 through the
link model; reports, per loss rate, the payload-beat utilisation of node 0's transmit
data stream (cycles carrying payload / total cycles, retransmissions included) and the
goodput (unique payload beats / total cycles), into the JSON file ``out`` names.
Used by ``bench/transport_goodput.py``; every transferred byte is compared."""

from __future__ import annotations

import json

import cocotb

from fpgaccl.hw.transport.layouts import Status
from fpgaccl.sim import bench_params

from .transport_pair import DST, KEYS, SRC, TB


@cocotb.test()
async def goodput(dut) -> None:
    prm = bench_params()
    results = []
    for i, loss in enumerate(prm["losses"]):
        tb = TB(dut, seed=prm.get("seed", 1), loss=loss, start_clock=i == 0)
        await tb.reset()
        a, b = tb.nodes
        n, count = prm["msg_bytes"], prm["messages"]
        nb = tb.width // 8
        b.set_mr(1, base=DST, length=count * n, key=KEYS[1])
        datas = []
        for k in range(count):
            data = tb.rng.randbytes(n)
            a.mem.write(SRC + k * n, data)
            a.post(qp=0, laddr=SRC + k * n, raddr=DST + k * n, rkey=KEYS[1], length=n, imm=k)
            datas.append(data)
        start = tb.cycle
        await tb.run(lambda a=a, count=count: len(a.completions) == count,
                     prm.get("max_cycles", 2_000_000))
        cycles = tb.cycle - start
        assert a.completions == [(0, Status.OK)] * count, a.completions
        wrong = sum(b.mem.read(DST + k * n, n) != d for k, d in enumerate(datas))
        unique = count * -(-n // nb)
        results.append({
            "loss": loss, "msg_bytes": n, "messages": count, "width": tb.width,
            "mtu": prm["mtu"], "cycles": cycles, "payload_cycles": a.data_cycles,
            "utilisation": a.data_cycles / cycles, "goodput": unique / cycles,
            "retransmits": a.counter("retransmits"), "timeouts": a.counter("timeouts"),
            "naks": a.counter("naks_rx"), "frames_lost": tb.links[0].stats["lost"]
            + tb.links[1].stats["lost"], "wrong": wrong})
        dut._log.info("%s", results[-1])
        assert wrong == 0
    with open(prm["out"], "w") as f:
        json.dump(results, f)
