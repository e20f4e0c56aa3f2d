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

import torch
import torch.distributed as dist
from common import start_mlp, train
from torch import nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args, model, teacher, data = start_mlp(__doc__)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    # full_tensor() all-gathers each sharded parameter
    train(args, model, teacher, data,
          lambda: torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
