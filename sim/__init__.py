"""Simulation on Verilator through cocotb.

``runner`` builds and runs designs; ``benches/`` holds the cocotb test modules, ``tb/``
their harnesses, stimulus and device-under-test tops, ``models/`` the bus-functional
models, ``hdl/`` the simulation-only hardware (memory, link, switch, cluster),
``servers/`` the simulated cluster and board served to the host (``server`` and
``board`` start them), ``bridge`` joins the simulated wire to UDP sockets and a TAP.
"""

from __future__ import annotations

import json
import os
from typing import Any


def bench_params() -> dict[str, Any]:
    """Parameters a pytest runner passed to the cocotb bench running in this process."""
    return json.loads(os.environ.get("FPGACCL_BENCH_PARAMS", "{}"))
