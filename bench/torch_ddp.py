"""DDP training step time: torch.distributed on fpgaccl against Gloo, same model, same
ranks (``fpgaccl run -n``), rounds that alternate which backend runs first.

Each run times ``--steps`` steps of an MLP (forward, backward with DDP's bucketed
allreduces, SGD) after ``--warmup`` steps; a run's number is the slowest rank's mean step
time. The JSON has every run, the median per backend, the ratio of the medians and the
median of each round's own ratio (on a shared machine, read the ratios).

    python bench/torch_ddp.py                          # 4 ranks, 3 rounds
    python bench/torch_ddp.py -n 2 --rounds 1 --steps 5 --hidden 256   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from common import REPO, write_results

BACKENDS = ("fpgaccl", "gloo")


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch import nn

    if args.backend == "fpgaccl":
        import fpgaccl.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the ranks share the cores; compute threads would contend
    h = args.hidden
    model = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                          nn.Linear(h, h))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(args.batch, h)

    def step() -> None:
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    mean = torch.tensor([(time.perf_counter() - t0) / args.steps], dtype=torch.float64)
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(args.result, "w") as f:
            json.dump({"step_s": mean.item(), "params": params}, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(args.n), "--",
               sys.executable, __file__, "--worker", "--backend", backend, "--result", result,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--hidden", str(args.hidden), "--batch", str(args.batch),
               "--bucket-mb", str(args.bucket_mb)]
        # the 1-minute load average around each run: on a shared machine it says how far
        # the run's time is the machine's rather than the backend's
        before = os.getloadavg()[0]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{backend} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        with open(result) as f:
            return {"backend": backend, "loadavg_before": before,
                    "loadavg": os.getloadavg()[0], **json.load(f)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="ranks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024, help="MLP width (3 layers of h x h)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    ap.add_argument("--json", default=None, help="results file (bench/results/torch_ddp.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    runs = []
    for r in range(args.rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        for backend in order:
            runs.append({"round": r, **run(args, backend)})
            print(f"round {r}  {backend:8s} {runs[-1]['step_s'] * 1e3:9.2f} ms/step "
                  f"({runs[-1]['params']} parameters, load {runs[-1]['loadavg']:.1f})",
                  flush=True)
    med = {b: statistics.median(x["step_s"] for x in runs if x["backend"] == b)
           for b in BACKENDS}
    per_round = [next(x["step_s"] for x in runs if x["round"] == r and x["backend"] == "gloo")
                 / next(x["step_s"] for x in runs if x["round"] == r and x["backend"] == "fpgaccl")
                 for r in range(args.rounds)]
    loads = [x[k] for x in runs for k in ("loadavg_before", "loadavg")]
    summary = {"median_step_s": med, "speedup_vs_gloo": med["gloo"] / med["fpgaccl"],
               "median_round_speedup": statistics.median(per_round),
               "loadavg_range": [min(loads), max(loads)], "cores": os.cpu_count()}
    print(f"fpgaccl {med['fpgaccl'] * 1e3:.2f} ms/step, gloo {med['gloo'] * 1e3:.2f} ms/step: "
          f"{summary['speedup_vs_gloo']:.2f}x (rounds' median "
          f"{summary['median_round_speedup']:.2f}x)")
    config = {k: getattr(args, k) for k in ("n", "rounds", "steps", "warmup", "hidden", "batch",
                                            "bucket_mb")}
    if args.json:
        path = args.json
        with open(path, "w") as f:
            json.dump({"config": config, "summary": summary, "runs": runs}, f, indent=2)
    else:
        path = write_results("torch_ddp", runs, config=config, summary=summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
