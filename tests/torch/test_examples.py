"""examples/ddp_train.py (and fsdp_train.py, moe_layer.py) on fpgaccl against Gloo from the
same seed, launched the three ways a user would: ``fpgaccl run``, torchrun and plain env://."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.torch.test_torch_backend import ROOT, free_port, run_ranks, same_bits  # noqa: E402

LOSS_RTOL = 1e-5
"""fpgaccl's and Gloo's allreduces add the ranks' float32 gradients in different orders,
so the parameters differ by a few ulps (4.5e-8 at most in 10 steps, measured) and the
losses by at most 1.2e-7 relative: this tolerance leaves ~100x."""


def load(outdir: Path, p: int) -> list[dict]:
    return [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(p)]


def fpgaccl_run(p: int, argv: list[str], options: tuple[str, ...] = (),
                timeout_s: float = 180) -> str:
    res = subprocess.run([sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(p),
                          *options, "--", sys.executable, *argv], cwd=ROOT, text=True,
                         capture_output=True, timeout=timeout_s)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_ddp_train_matches_gloo(tmp_path: Path) -> None:
    steps, p = 4, 4
    script = ["examples/ddp_train.py", "--steps", str(steps)]
    out = fpgaccl_run(p, [*script, "--out", str(tmp_path / "fpgaccl")])
    assert out.count(" loss ") == steps  # rank 0 prints one line a step
    run_ranks([sys.executable, *script, "--backend", "gloo", "--out", str(tmp_path / "gloo")], p)
    mine, gloo = load(tmp_path / "fpgaccl", p), load(tmp_path / "gloo", p)
    for s in range(steps):
        for r in range(1, p):
            assert same_bits(mine[r]["params"][s], mine[0]["params"][s]), (s, r)
    torch.testing.assert_close(torch.tensor(mine[0]["losses"]), torch.tensor(gloo[0]["losses"]),
                               rtol=LOSS_RTOL, atol=0)
    assert mine[0]["losses"] == mine[p - 1]["losses"]


def test_ddp_train_on_simulated_nodes_matches_software(tmp_path: Path) -> None:
    """The simulated HDL nodes reduce the gradients of real training steps. They run the
    software engine's programs, in its order, so every rank's parameters and losses equal
    the software backend's bits."""
    steps, p = 2, 4
    script = ["examples/ddp_train.py", "--steps", str(steps)]
    out = fpgaccl_run(p, [*script, "--out", str(tmp_path / "sim")], ("--backend", "sim"),
                      timeout_s=900)
    assert out.count(" loss ") == steps
    fpgaccl_run(p, [*script, "--out", str(tmp_path / "software")])
    sim, software = load(tmp_path / "sim", p), load(tmp_path / "software", p)
    for r in range(p):
        assert sim[r]["losses"] == software[r]["losses"], r
        assert len(sim[r]["params"]) == steps
        for s in range(steps):
            assert same_bits(sim[r]["params"][s], software[r]["params"][s]), (r, s)


def test_ddp_train_under_torchrun(tmp_path: Path) -> None:
    """torchrun's agent holds MASTER_PORT; fpgaccl's rendezvous port comes from the store."""
    res = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "examples/ddp_train.py",
                          "--steps", "2", "--out", str(tmp_path)], cwd=ROOT, text=True,
                         capture_output=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    a, b = load(tmp_path, 2)
    assert same_bits(a["params"][-1], b["params"][-1])


def test_moe_layer_bit_identical_to_gloo(tmp_path: Path) -> None:
    """Dispatch and combine only move rows: outputs and every gradient equal Gloo's bits."""
    p = 4
    for backend in ("fpgaccl", "gloo"):
        run_ranks([sys.executable, "examples/moe_layer.py", "--backend", backend,
                   "--out", str(tmp_path / backend)], p)
    mine, gloo = load(tmp_path / "fpgaccl", p), load(tmp_path / "gloo", p)
    for r in range(p):
        assert mine[r]["y"].abs().sum() > 0 and mine[r]["x_grad"].abs().sum() > 0
        assert same_bits(mine[r]["y"], gloo[r]["y"]), r
        assert same_bits(mine[r]["x_grad"], gloo[r]["x_grad"]), r
        assert mine[r]["grads"].keys() == gloo[r]["grads"].keys()
        for name, g in mine[r]["grads"].items():
            assert same_bits(g, gloo[r]["grads"][name]), (r, name)


def test_fsdp_train_bit_identical_to_gloo(tmp_path: Path) -> None:
    """FSDP2 (fully_shard) at 2 ranks: its all-gathers move bits and a reduce-scatter of two
    addends is one commutative add, so losses and full parameters equal Gloo's bits."""
    steps, p = 3, 2
    script = [sys.executable, "examples/fsdp_train.py", "--steps", str(steps)]
    for backend in ("fpgaccl", "gloo"):
        run_ranks([*script, "--backend", backend, "--out", str(tmp_path / backend)], p)
    mine, gloo = load(tmp_path / "fpgaccl", p), load(tmp_path / "gloo", p)
    assert mine[0]["losses"] == gloo[0]["losses"]
    assert mine[0]["losses"][-1] < mine[0]["losses"][0]
    for r in range(p):
        assert len(mine[r]["params"]) == steps
        for s in range(steps):
            assert same_bits(mine[r]["params"][s], gloo[r]["params"][s]), (r, s)
