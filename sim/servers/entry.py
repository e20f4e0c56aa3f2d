"""The servers' one cocotb test: cocotb runs Python inside the simulator only as a test,
so this builds the server its parameters name and hands it to the loop. Everything else
lives in plain modules (:mod:`.loop`, :mod:`.cluster`, :mod:`.board`,
:mod:`.tap_node`)."""

from __future__ import annotations

import cocotb

from fpgaccl.sim import bench_params

from .board import BoardServer
from .cluster import ClusterServer
from .loop import serve
from .tap_node import TapNodeServer

SERVERS = {"cluster": ClusterServer, "board": BoardServer, "tap_node": TapNodeServer}


@cocotb.test()
async def serve_requests(dut) -> None:
    p = bench_params()
    server = SERVERS[p["server"]](dut, p)
    await serve(server, p["socket"], idle_timeout_s=p.get("idle_timeout_s", 600),
                summary_path=p.get("summary"), log=dut._log)
