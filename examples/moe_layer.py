"""A mixture-of-experts layer with expert parallelism: 2 experts on each rank, top-2
routing, tokens dispatched to their experts' ranks and combined back with
``all_to_all_single`` and per-rank split sizes (forward and backward).

    torchrun --nproc-per-node 4 examples/moe_layer.py
    ./fpgaccl run -n 4 -- python examples/moe_layer.py [--backend gloo] [--out DIR]

All-to-all only moves rows, so the outputs and gradients are bit-identical on any
backend: ``--out DIR`` saves them (rank<r>.pt) for comparing.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import save, start
from torch import nn

EXPERTS_PER_RANK = 2
TOP_K = 2


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over rows with split sizes; its gradient goes back the same
    way with the sizes swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.sizes = send, recv
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        send, recv = ctx.sizes
        return AllToAll.apply(grad, recv, send), None, None


class MoE(nn.Module):
    def __init__(self, dim: int, world: int, rank: int) -> None:
        super().__init__()
        self.world, self.rank = world, rank
        self.gate = nn.Linear(dim, world * EXPERTS_PER_RANK, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                   nn.Linear(2 * dim, dim))
                                     for _ in range(EXPERTS_PER_RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x).softmax(-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        token = torch.arange(x.shape[0]).repeat_interleave(TOP_K)
        expert = experts.reshape(-1)
        order = torch.argsort(expert, stable=True)  # grouped by destination rank
        token, expert = token[order], expert[order]
        dest = expert // EXPERTS_PER_RANK
        send = torch.bincount(dest, minlength=self.world)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)  # how many rows each rank will send here
        send_sizes, recv_sizes = send.tolist(), recv.tolist()

        local = (expert % EXPERTS_PER_RANK).contiguous()
        local_in = torch.empty(sum(recv_sizes), dtype=local.dtype)
        dist.all_to_all_single(local_in, local, recv_sizes, send_sizes)
        rows = AllToAll.apply(x[token], send_sizes, recv_sizes)
        done = torch.zeros_like(rows)
        for k, ex in enumerate(self.experts):
            mine = (local_in == k).nonzero().squeeze(1)
            done = done.index_add(0, mine, ex(rows[mine]))
        back = AllToAll.apply(done, recv_sizes, send_sizes)
        w = weights.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, token, w * back)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dim", type=int, default=16)
    args = start(ap)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same gate everywhere; experts differ by rank
    layer = MoE(args.dim, world, rank)
    torch.manual_seed(1 + rank)
    for ex in layer.experts:
        ex.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    x = torch.randn(args.tokens, args.dim, requires_grad=True)
    y = layer(x)
    loss = y.pow(2).mean()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    if rank == 0:
        print(f"moe: {world} ranks x {EXPERTS_PER_RANK} experts, top-{TOP_K}, "
              f"{args.tokens} tokens a rank; loss {total.item() / world:.6f}")
    save(args, {"y": y.detach(), "x_grad": x.grad,
                "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
