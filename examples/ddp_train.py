"""Data-parallel training of a small MLP on fpgaccl (or any torch.distributed backend).

    torchrun --nproc-per-node 4 examples/ddp_train.py
    ./fpgaccl run -n 4 -- python examples/ddp_train.py [--steps 50] [--backend gloo]

Every rank draws its own batches of a synthetic regression task; DDP averages the
gradients (bucketed allreduces that run while backward still does) and rank 0 prints
the loss of each step. ``--out DIR`` saves each rank's losses and parameters per step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import save, start
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = start(ap)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(args.seed)  # the same model on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 1))
    teacher = torch.randn(32, 1)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its shard

    losses, params = [], []
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        y = torch.sin(x @ teacher / 32**0.5)  # a smooth target the MLP can learn
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # the mean of the ranks' losses: what the whole batch saw
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        losses.append(mean.item())
        if args.out:
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    save(args, {"losses": losses, "params": params})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
