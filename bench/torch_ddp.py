"""torch.distributed on fpgaccl against Gloo: a DDP training step, and an expert-parallel
MoE layer's dispatch and combine, same ranks (``fpgaccl run -n``), rounds that alternate
which backend runs first.

- ``ddp``: ``--steps`` steps of an MLP (forward, backward with DDP's bucketed
  allreduces, SGD) after ``--warmup`` steps.
- ``moe``: what an MoE layer's forward sends per step, top-2 routing of ``--tokens``
  tokens of ``--dim`` float32 to 4 ranks' experts: the split sizes
  (``all_to_all_single`` of counts), the dispatch and the combine (``all_to_all_single``
  of rows with per-peer splits). The combine returns every row where it came from, which
  the worker checks bit for bit.
- ``small``: ``all_reduce`` of an 8-byte tensor, 50 blocking calls a step: the latency
  a torch user sees for small collectives (divide the step time by 50).

A run's number is the slowest rank's mean step time. The JSON has every run, and per
workload the median per backend, the ratio of the medians and the median of each
round's own ratio (on a shared machine, read the ratios).

    python bench/torch_ddp.py                          # 4 ranks, 3 rounds, both workloads
    python bench/torch_ddp.py -n 2 --rounds 1 --steps 5 --hidden 256 --workloads ddp
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
WORKLOADS = ("ddp", "moe", "small")
TOP_K = 2
SMALL_CALLS = 50


def worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if args.backend == "fpgaccl":
        import fpgaccl.torch  # noqa: F401  (registers the backend)
    dist.init_process_group(args.backend, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the ranks share the cores; compute threads would contend
    steps = {"ddp": ddp_step, "moe": moe_step, "small": small_step}
    step, check, size = steps[args.workload](args, torch, dist)
    for _ in range(args.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    mean = torch.tensor([(time.perf_counter() - t0) / args.steps], dtype=torch.float64)
    check()
    dist.all_reduce(mean, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"step_s": mean.item(), **size}, f)
    dist.destroy_process_group()


def ddp_step(args: argparse.Namespace, torch, dist) -> tuple:
    from torch import nn

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

    return step, lambda: None, {"params": sum(p.numel() for p in model.parameters())}


def moe_step(args: argparse.Namespace, torch, dist) -> tuple:
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = args.tokens * TOP_K
    gen = torch.Generator().manual_seed(1 + rank)
    # Each row's destination rank: a skewed router, so the splits differ per peer.
    weights = torch.tensor([2.0 ** -(i % world) for i in range(world)]).roll(rank)
    dest = torch.multinomial(weights, rows, replacement=True, generator=gen).sort().values
    x = torch.randn(rows, args.dim, generator=gen)
    send = torch.bincount(dest, minlength=world)
    counts = torch.empty_like(send)
    back = torch.empty_like(x)

    def step() -> None:
        dist.all_to_all_single(counts, send)
        s, r = send.tolist(), counts.tolist()
        out = x.new_empty(sum(r), args.dim)
        dist.all_to_all_single(out, x, r, s)      # dispatch
        dist.all_to_all_single(back, out, s, r)   # combine

    def check() -> None:
        if not torch.equal(back.view(torch.int32), x.view(torch.int32)):
            raise SystemExit(f"rank {rank}: the combine did not return the dispatched rows")

    return step, check, {"rows": rows, "dim": args.dim, "bytes": rows * args.dim * 4}


def small_step(args: argparse.Namespace, torch, dist) -> tuple:
    x = torch.zeros(2)  # sums of zeros stay exact however many calls

    def step() -> None:
        for _ in range(SMALL_CALLS):
            dist.all_reduce(x)

    def check() -> None:
        if not x.eq(0).all():
            raise SystemExit(f"the small all_reduce gave {x.tolist()}")

    return step, check, {"calls": SMALL_CALLS, "bytes": 8}


def run(args: argparse.Namespace, workload: str, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "fpgaccl.host.cli", "run", "-n", str(args.n), "--",
               sys.executable, __file__, "--worker", "--workload", workload,
               "--backend", backend, "--result", result,
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--hidden", str(args.hidden), "--batch", str(args.batch),
               "--bucket-mb", str(args.bucket_mb), "--tokens", str(args.tokens),
               "--dim", str(args.dim)]
        # the 1-minute load average around each run: on a shared machine it says how far
        # the run's time is the machine's rather than the backend's
        before = os.getloadavg()[0]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{workload} on {backend} failed:\n{proc.stdout[-2000:]}"
                     f"{proc.stderr[-2000:]}")
        with open(result) as f:
            return {"workload": workload, "backend": backend, "loadavg_before": before,
                    "loadavg": os.getloadavg()[0], **json.load(f)}


def summarize(runs: list[dict], rounds: int) -> dict:
    med = {b: statistics.median(x["step_s"] for x in runs if x["backend"] == b)
           for b in BACKENDS}

    def at(r: int, b: str) -> float:
        return next(x["step_s"] for x in runs if x["round"] == r and x["backend"] == b)

    return {"median_step_s": med, "speedup_vs_gloo": med["gloo"] / med["fpgaccl"],
            "median_round_speedup": statistics.median(at(r, "gloo") / at(r, "fpgaccl")
                                                      for r in range(rounds))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="ranks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--hidden", type=int, default=1024, help="ddp: MLP width (3 layers h x h)")
    ap.add_argument("--batch", type=int, default=32, help="ddp: batch size")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="ddp: DDP's bucket_cap_mb")
    ap.add_argument("--tokens", type=int, default=2048, help="moe: tokens a rank routes")
    ap.add_argument("--dim", type=int, default=256, help="moe: model width (float32)")
    ap.add_argument("--json", default=None, help="results file (bench/results/torch_ddp.json)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--backend", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    workloads = args.workloads.split(",")
    if unknown := set(workloads) - set(WORKLOADS):
        ap.error(f"--workloads: unknown {sorted(unknown)}; known: {', '.join(WORKLOADS)}")
    runs = []
    for r in range(args.rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        for workload in workloads:
            for backend in order:
                runs.append({"round": r, **run(args, workload, backend)})
                got = runs[-1]
                size = (f"{got['params']} parameters" if workload == "ddp" else
                        f"{got['bytes'] >> 10} KiB dispatched" if workload == "moe" else
                        f"{got['calls']} calls of {got['bytes']} B")
                print(f"round {r}  {workload}  {backend:8s} {runs[-1]['step_s'] * 1e3:9.2f} "
                      f"ms/step ({size}, load {runs[-1]['loadavg']:.1f})", flush=True)
    loads = [x[k] for x in runs for k in ("loadavg_before", "loadavg")]
    summary = {w: summarize([x for x in runs if x["workload"] == w], args.rounds)
               for w in workloads}
    summary.update(loadavg_range=[min(loads), max(loads)], cores=os.cpu_count())
    for w in workloads:
        med = summary[w]["median_step_s"]
        print(f"{w}: fpgaccl {med['fpgaccl'] * 1e3:.2f} ms/step, gloo {med['gloo'] * 1e3:.2f} "
              f"ms/step: {summary[w]['speedup_vs_gloo']:.2f}x (rounds' median "
              f"{summary[w]['median_round_speedup']:.2f}x)")
    config = {k: getattr(args, k) for k in ("n", "rounds", "steps", "warmup", "workloads",
                                            "hidden", "batch", "bucket_mb", "tokens", "dim")}
    if args.json:
        path = args.json
        with open(path, "w") as f:
            json.dump({"config": config, "summary": summary, "runs": runs}, f, indent=2)
    else:
        path = write_results("torch_ddp", runs, config=config, summary=summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
