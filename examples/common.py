"""What the examples share: joining the process group from the launcher's environment
(torchrun, ``fpgaccl run`` or plain env:// variables) and saving results for comparing."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def start(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse ``ap`` (plus ``--backend`` and ``--out``) and join the default group."""
    ap.add_argument("--backend", default="fpgaccl", help="fpgaccl (default), gloo, ...")
    ap.add_argument("--out", help="directory for this rank's results (rank<r>.pt)")
    args = ap.parse_args()
    if args.backend == "fpgaccl":
        import fpgaccl.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=120))
    return args


def save(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(results, os.path.join(args.out, f"rank{dist.get_rank()}.pt"))


def start_mlp(doc: str) -> tuple[argparse.Namespace, nn.Module, torch.Tensor, torch.Generator]:
    """The training examples' start: their arguments, the process group, the MLP and
    teacher (the same on every rank, from ``--seed``) and this rank's batch generator (its
    own shard of the data)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = start(ap)
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 1))
    teacher = torch.randn(32, 1)
    data = torch.Generator().manual_seed(args.seed * 1000 + dist.get_rank() + 1)
    return args, model, teacher, data


def mlp_batch(teacher: torch.Tensor, data: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 32, generator=data)
    return x, torch.sin(x @ teacher / 32**0.5)  # a smooth target the MLP can learn


def mean_loss(loss: torch.Tensor) -> float:
    """The mean of the ranks' losses: what the whole batch saw (rank 0 prints it)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    return mean.item()


def train(args: argparse.Namespace, wrapped: nn.Module, teacher: torch.Tensor,
          data: torch.Generator, flat_params: Callable[[], torch.Tensor]) -> None:
    """``args.steps`` Adam steps of ``wrapped`` on the MLP task; rank 0 prints each step's
    mean loss; ``--out`` saves the losses and ``flat_params()`` after each step."""
    opt = torch.optim.Adam(wrapped.parameters(), lr=3e-3)
    losses, params = [], []
    for step in range(args.steps):
        x, y = mlp_batch(teacher, data)
        loss = nn.functional.mse_loss(wrapped(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(mean_loss(loss))
        if args.out:
            params.append(flat_params())
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    save(args, {"losses": losses, "params": params})
