"""Simulation: cocotb benches on Verilator, bus models, the multi-node network emulator."""

from __future__ import annotations

import json
import os
from typing import Any


def bench_params() -> dict[str, Any]:
    """Parameters a pytest runner passed to the cocotb bench running in this process."""
    return json.loads(os.environ.get("FPGACCL_BENCH_PARAMS", "{}"))
