"""Data-parallel training of a small MLP on fpgaccl (or any torch.distributed backend).

    torchrun --nproc-per-node 4 examples/ddp_train.py
    ./fpgaccl run -n 4 -- python examples/ddp_train.py [--steps 50] [--backend gloo]

Every rank draws its own batches of a synthetic regression task; DDP averages the
gradients (bucketed allreduces that run while backward still does) and rank 0 prints
the loss of each step. ``--out DIR`` saves each rank's losses and parameters per step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import start_mlp, train
from torch import nn


def main() -> None:
    args, model, teacher, data = start_mlp(__doc__)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
    train(args, ddp, teacher, data,
          lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
