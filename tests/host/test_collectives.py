"""Every collective x dtype x op against numpy, for world sizes 1, 2, 3, 4, 5 and 8."""

from __future__ import annotations

import pytest

from ._world import all_ok, run_world
from .cases import run_all

# Each world size also runs a different path MTU so segmentation is covered widely.
WORLDS = [(1, 4096), (2, 256), (3, 1024), (4, 4096), (5, 9000), (8, 2048)]


@pytest.mark.parametrize(("world", "mtu"), WORLDS, ids=[f"world{w}-mtu{m}" for w, m in WORLDS])
def test_every_collective_dtype_op(world: int, mtu: int) -> None:
    seed = 1000 + world
    res = all_ok(run_world(world, run_all, seed=seed, big=world in (2, 4),
                           comm_kw={"mtu": mtu, "deadline_s": 60}, timeout=240))
    fails = [f for r in res for f in r["fails"]]
    assert not fails, "\n".join(fails[:30])
    # Floating-point reductions must give the same bytes on every rank.
    digests = {r["digest"] for r in res}
    assert len(digests) == 1, "ranks disagree on float reduction results"
