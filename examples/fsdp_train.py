"""Fully sharded data-parallel training (FSDP2, ``fully_shard``) of the MLP of
ddp_train.py on fpgaccl (or any torch.distributed backend).

    torchrun --nproc-per-node 2 examples/fsdp_train.py
    ./fpgaccl run -n 2 -- python examples/fsdp_train.py [--steps 50] [--backend gloo]

Each Linear holds 1/world of its parameters on each rank: forward and backward all-gather
them (``all_gather_into_tensor`` of one flat buffer per layer) and the gradients are
averaged and re-sharded by ``reduce_scatter_tensor`` (ReduceOp.AVG). ``--out DIR`` saves
each rank's losses and its full parameters per step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import mean_loss, mlp_batch, mlp_task, save, start
from torch import nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = start(ap)

    model, teacher, data = mlp_task(args.seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    losses, params = [], []
    for step in range(args.steps):
        x, y = mlp_batch(teacher, data)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(mean_loss(loss))
        if args.out:  # full_tensor() all-gathers each sharded parameter
            params.append(torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    save(args, {"losses": losses, "params": params})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
