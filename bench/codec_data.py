"""What the codec saves on real data: weights and gradients of a small model trained with
PyTorch for a few steps, and random bits (which must cost at most 2 %).

The model is a 2-layer character-level transformer (d=128, 4 heads, ~0.47 M parameters)
trained with AdamW on this repository's README (real text; a fixed seed, CPU,
deterministic). After the last step the weights and the gradient of one more batch are
taken in float32 and cast to bfloat16 and float16 as a mixed-precision run would send
them. Per tensor kind and dtype the table gives the exponent field's entropy and share
of zeros, the codec's size over raw (``proto.codec``), and the bound an ideal exponent
coder would reach (sign and mantissa raw, exponent at its entropy).

    python bench/codec_data.py [--steps 30] [--sample tests/data/codec_real.npz]

``--sample`` also stores 4096 weights and 4096 gradients (float32) for the tests that
check the C and HDL codecs on real data. Writes bench/results/codec_ratio.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from common import REPO, write_results

from fpgaccl.proto import codec

DTYPES = ("bfloat16", "float16", "float32")


def train(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    import torch
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    text = torch.tensor(list((REPO / "README.md").read_bytes()), dtype=torch.long)
    V, D, T = 256, 128, 64

    class CharLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(V, D)
            self.pos = torch.nn.Parameter(torch.randn(T, D) * 0.02)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(D, 4, 4 * D, 0.0, batch_first=True,
                                                 norm_first=True) for _ in range(2))
            self.head = torch.nn.Linear(D, V)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x) + self.pos[:x.shape[1]]
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            for b in self.blocks:
                h = b(h, src_mask=mask, is_causal=True)
            return self.head(h)

    model = CharLM()
    opt = torch.optim.AdamW(model.parameters(), 3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = torch.zeros(())
    for step in range(steps + 1):
        idx = torch.randint(0, len(text) - T - 1, (32,), generator=gen)
        x = torch.stack([text[i:i + T] for i in idx])
        y = torch.stack([text[i + 1:i + T + 1] for i in idx])
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step < steps:  # the last batch's gradient is the one measured
            opt.step()
        print(f"\rstep {step}/{steps} loss {loss.item():.3f}", end="", file=sys.stderr)
    print(file=sys.stderr)
    weights = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    grads = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    return weights.astype(np.float32), grads.astype(np.float32), float(loss.item())


def entropy(values: np.ndarray) -> float:
    counts = np.bincount(values.ravel().astype(np.int64))
    p = counts[counts > 0] / values.size
    return float(-(p * np.log2(p)).sum())


def measure(kind: str, a32: np.ndarray | None, dtype: str, raw: np.ndarray | None = None) -> dict:
    f = codec.format_of(dtype)
    a = raw if raw is not None else a32.astype(f.dtype.numpy_dtype())
    e = codec.exponent_fields(a, dtype)
    data = codec.encode(a, dtype)
    back = codec.decode(data, dtype, a.size)
    assert back.view(f.uint).tobytes() == a.view(f.uint).tobytes(), f"{kind} {dtype}"
    h = entropy(e)
    heads = np.frombuffer(data, np.uint8)[codec.block_offsets(data, f, a.size // codec.BLOCK)[:-1]]
    return {"kind": kind, "dtype": dtype, "count": int(a.size), "raw_bytes": int(a.nbytes),
            "coded_bytes": len(data), "ratio": len(data) / a.nbytes,
            "saved": 1 - len(data) / a.nbytes, "exp_entropy_bits": h,
            "exp_zero_share": float(np.mean(e == 0)),
            "mean_k": float(np.mean(heads & 0xF)) if heads.size else 0.0,
            "z_blocks_share": float(np.mean(heads >> 4 & 1)) if heads.size else 0.0,
            "entropy_bound_ratio": (f.bits - f.exp_bits + h) / f.bits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sample", type=Path, help="also store a small real sample here (.npz)")
    args = ap.parse_args()
    load = os.getloadavg()
    t0 = time.time()
    weights, grads, loss = train(args.steps)
    rng = np.random.default_rng(0)
    rows = []
    for dtype in DTYPES:
        rows.append(measure("weights", weights, dtype))
        rows.append(measure("gradients", grads, dtype))
        f = codec.format_of(dtype)
        bits = rng.integers(0, 1 << f.bits, weights.size, dtype=np.uint64).astype(f.uint)
        rows.append(measure("random bits", None, dtype, bits.view(f.dtype.numpy_dtype())))
    print(f"\nmodel: {weights.size} parameters, {args.steps} AdamW steps, final loss {loss:.3f}")
    print(f"{'kind':>12} {'dtype':>9} {'exp H':>6} {'zeros':>6} {'mean k':>6} {'z blk':>6} "
          f"{'coded/raw':>9} {'saved':>7} {'H bound':>7}")
    for r in rows:
        print(f"{r['kind']:>12} {r['dtype']:>9} {r['exp_entropy_bits']:6.2f} "
              f"{r['exp_zero_share']:6.3f} {r['mean_k']:6.2f} {r['z_blocks_share']:6.3f} "
              f"{r['ratio']:9.4f} {r['saved']:7.2%} {r['entropy_bound_ratio']:7.4f}")
    path = write_results("codec_ratio", rows, model={
        "kind": "char-level transformer, 2 layers, d=128, 4 heads, on README.md",
        "parameters": int(weights.size), "steps": args.steps, "optimizer": "AdamW lr 3e-3",
        "batch": "32 x 64 tokens", "seed": 0, "final_loss": loss},
        block_elements=codec.BLOCK, load_before=load, load_after=os.getloadavg(),
        seconds=time.time() - t0)
    print(f"wrote {path}")
    if args.sample:
        args.sample.parent.mkdir(parents=True, exist_ok=True)
        pick = np.random.default_rng(1)
        start_w = int(pick.integers(0, weights.size - 4096))
        start_g = int(pick.integers(0, grads.size - 4096))
        np.savez_compressed(args.sample, weights=weights[start_w:start_w + 4096],
                            gradients=grads[start_g:start_g + 4096])
        print(f"wrote {args.sample}")


if __name__ == "__main__":
    main()
