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
from common import mean_loss, mlp_batch, mlp_task, save, start
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = start(ap)
    rank = dist.get_rank()

    model, teacher, data = mlp_task(args.seed)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)

    losses, params = [], []
    for step in range(args.steps):
        x, y = mlp_batch(teacher, data)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(mean_loss(loss))
        if args.out:
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    save(args, {"losses": losses, "params": params})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
