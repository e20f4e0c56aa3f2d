"""What the examples share: joining the process group from the launcher's environment
(torchrun, ``fpgaccl run`` or plain env:// variables) and saving results for comparing."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


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
