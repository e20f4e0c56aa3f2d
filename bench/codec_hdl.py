"""The HDL codec's throughput on Amaranth's simulator: beats per cycle of the encoder's
input and the decoder's output at 512 bits, with nothing stalling either side.

    python bench/codec_hdl.py [--blocks 128] [--width 512]

Inputs: real gradients and weights (tests/data/codec_real.npz, tiled), random bits.
Each is coded by ``BlockEncoder`` and the coded bytes decoded by ``BlockDecoder``; the
bytes are checked against ``proto.codec``. Cycles count from the first handshake to the
last on the side measured. Writes bench/results/codec_hdl.json.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from amaranth.sim import Simulator
from common import REPO, write_results

from fpgaccl.hw.compress import BlockDecoder, BlockEncoder
from fpgaccl.proto import codec


def beats(payload: bytes, width: int) -> list[tuple[int, int, bool]]:
    wb = width // 8
    return [(int.from_bytes(payload[at:at + wb], "little"),
             (1 << len(payload[at:at + wb])) - 1, at + wb >= len(payload))
            for at in range(0, len(payload), wb)]


def stream(dut, items: list[tuple[int, int, bool]], count: int) -> tuple[bytes, list, list]:
    out, took_in, took_out = bytearray(), [], []
    wb = dut.width // 8

    async def bench(ctx):
        sent = 0
        ctx.set(dut.o.ready, 1)
        for cycle in range(20 * len(items) + 1000):
            ctx.set(dut.i.valid, sent < len(items))
            if sent < len(items):
                d, k, last = items[sent]
                ctx.set(dut.i.payload.data, d)
                ctx.set(dut.i.payload.keep, k)
                ctx.set(dut.i.payload.first, sent == 0)
                ctx.set(dut.i.payload.last, last)
                if hasattr(dut.i.payload, "count"):
                    ctx.set(dut.i.payload.count, count)
                if ctx.get(dut.i.ready):
                    took_in.append(cycle)
                    sent += 1
            if ctx.get(dut.o.valid):
                took_out.append(cycle)
                n = bin(ctx.get(dut.o.payload.keep)).count("1")
                out.extend(ctx.get(dut.o.payload.data).to_bytes(wb, "little")[:n])
                if ctx.get(dut.o.payload.last):
                    return
            await ctx.tick()
        raise RuntimeError("stream did not finish")

    sim = Simulator(dut)
    sim.add_clock(1e-8)
    sim.add_testbench(bench)
    sim.run()
    return bytes(out), took_in, took_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args()
    load = os.getloadavg()
    f = codec.format_of("bfloat16")
    real = np.load(REPO / "tests" / "data" / "codec_real.npz")
    n = args.blocks * codec.BLOCK
    rng = np.random.default_rng(0)
    inputs = {
        "real gradients": np.resize(real["gradients"], n).astype(f.dtype.numpy_dtype()),
        "real weights": np.resize(real["weights"], n).astype(f.dtype.numpy_dtype()),
        "random bits": rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16)
                          .view(f.dtype.numpy_dtype()),
    }
    enc, dec = BlockEncoder(f, args.width), BlockDecoder(f, args.width)
    rows = []
    print(f"{'input':>15} {'coded/raw':>9} {'enc in beats/cyc':>16} {'dec out beats/cyc':>17} "
          f"{'sim s':>6}")
    for name, a in inputs.items():
        t = time.time()
        raw_beats = beats(a.tobytes(), args.width)
        coded, e_in, e_out = stream(enc, raw_beats, a.size)
        assert coded == codec.encode(a, "bfloat16"), name
        back, d_in, d_out = stream(dec, beats(coded, args.width), a.size)
        assert back == a.tobytes(), name
        row = {"input": name, "elements": int(a.size), "ratio": len(coded) / a.nbytes,
               "encoder_in_beats": len(e_in), "encoder_in_cycles": e_in[-1] - e_in[0] + 1,
               "encoder_in_beats_per_cycle": len(e_in) / (e_in[-1] - e_in[0] + 1),
               "encoder_latency_cycles": e_out[-1] - e_in[-1],
               "decoder_out_beats": len(d_out), "decoder_out_cycles": d_out[-1] - d_out[0] + 1,
               "decoder_out_beats_per_cycle": len(d_out) / (d_out[-1] - d_out[0] + 1),
               "decoder_latency_cycles": d_out[0] - d_in[0],
               "sim_seconds": time.time() - t}
        rows.append(row)
        print(f"{name:>15} {row['ratio']:9.4f} {row['encoder_in_beats_per_cycle']:16.4f} "
              f"{row['decoder_out_beats_per_cycle']:17.4f} {row['sim_seconds']:6.1f}", flush=True)
    path = write_results("codec_hdl", rows, width=args.width, dtype="bfloat16",
                         simulator="amaranth pysim", load_before=load, load_after=os.getloadavg())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
