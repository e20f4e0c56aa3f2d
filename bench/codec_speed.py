"""Encode and decode speed of the C codec (host/codec.c), one core, in GB/s of raw data.

    python bench/codec_speed.py [--mib 32] [--rounds 7]

Inputs: real gradients (tests/data/codec_real.npz, the sample ``bench/codec_data.py``
stores, tiled), Gaussian values (non-repeating, gradient-like exponents) and random
bits (every block raw), in bfloat16, float16 and float32. Each round times one encode
and one decode of the whole buffer per input, rounds interleaved; the table gives the
median and best round of GB per second of the thread's CPU time (what one core does
while it runs: on this shared machine wall time mostly measures the other jobs), and
the median by wall clock beside it. The load average is recorded before and after.
Writes bench/results/codec_speed.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from common import REPO, write_results

from fpgaccl.host import codec as native
from fpgaccl.proto import codec as ref

DTYPES = ("bfloat16", "float16", "float32")


def inputs(dtype: str, nbytes: int) -> dict[str, np.ndarray]:
    f = ref.format_of(dtype)
    n = nbytes // (f.bits // 8) // ref.BLOCK * ref.BLOCK
    real = np.load(REPO / "tests" / "data" / "codec_real.npz")["gradients"]
    rng = np.random.default_rng(0)
    return {
        "real gradients": np.resize(real, n).astype(f.dtype.numpy_dtype()),
        "gaussian": (rng.standard_normal(n, np.float32) * 1e-3).astype(f.dtype.numpy_dtype()),
        "random bits": rng.integers(0, 1 << f.bits, n, dtype=np.uint64).astype(f.uint)
                          .view(f.dtype.numpy_dtype()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if native.load() is None:
        sys.exit(f"C codec unavailable: {native.reason}")
    load_before = os.getloadavg()
    rows = []
    print(f"{'dtype':>9} {'input':>15} {'ratio':>7} {'enc cpu':>7} {'best':>7} {'wall':>7} "
          f"{'dec cpu':>7} {'best':>7} {'wall':>7}   (GB/s of raw bytes, one core)")
    for dtype in DTYPES:
        for name, a in inputs(dtype, args.mib << 20).items():
            out = np.empty(ref.encoded_size_bound(a.size, dtype), np.uint8)
            back = np.empty_like(a)
            coded = native.encode(a, dtype, out)  # warm-up, page faults
            native.decode(coded, dtype, a.size, back)
            assert back.tobytes() == a.tobytes()
            enc, dec, enc_wall, dec_wall = [], [], [], []
            for _ in range(args.rounds):
                w, t = time.perf_counter(), time.thread_time()
                coded = native.encode(a, dtype, out)
                enc.append(time.thread_time() - t)
                enc_wall.append(time.perf_counter() - w)
                w, t = time.perf_counter(), time.thread_time()
                native.decode(coded, dtype, a.size, back)
                dec.append(time.thread_time() - t)
                dec_wall.append(time.perf_counter() - w)
            gb = a.nbytes / 1e9
            rows.append({"dtype": dtype, "input": name, "raw_bytes": int(a.nbytes),
                         "coded_bytes": len(coded), "ratio": len(coded) / a.nbytes,
                         "encode_gbps_cpu_median": gb / float(np.median(enc)),
                         "encode_gbps_cpu_best": gb / min(enc),
                         "encode_gbps_wall_median": gb / float(np.median(enc_wall)),
                         "decode_gbps_cpu_median": gb / float(np.median(dec)),
                         "decode_gbps_cpu_best": gb / min(dec),
                         "decode_gbps_wall_median": gb / float(np.median(dec_wall))})
            r = rows[-1]
            print(f"{dtype:>9} {name:>15} {r['ratio']:7.4f} "
                  f"{r['encode_gbps_cpu_median']:7.2f} {r['encode_gbps_cpu_best']:7.2f} "
                  f"{r['encode_gbps_wall_median']:7.2f} "
                  f"{r['decode_gbps_cpu_median']:7.2f} {r['decode_gbps_cpu_best']:7.2f} "
                  f"{r['decode_gbps_wall_median']:7.2f}", flush=True)
    path = write_results("codec_speed", rows, library=native.reason, mib=args.mib,
                         rounds=args.rounds, load_before=load_before,
                         load_after=os.getloadavg(),
                         note="one core; GB/s of raw (uncompressed) bytes per second of "
                              "thread CPU time (cpu) and of wall time (wall); machine shared "
                              "with other engineers' jobs, see load")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
