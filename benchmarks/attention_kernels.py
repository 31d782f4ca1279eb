"""Time each attention variant (and constant setting) on SD 1.4's attention shapes with GPU
timestamps, and check each against the reference variant on the same fresh random inputs.

    python benchmarks/attention_kernels.py --precision fp16 --json out.json
    python benchmarks/attention_kernels.py --variants flash_gemm --set BQ=128,TX=5

Prints one line per (shape, variant, constants): median / min / max ms over the repetitions
after warm-up, TFLOP/s of the median (4 * B * H * Tq * Tk * dh flops), and the largest error
relative to the reference's largest magnitude.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (b, tq, tk, heads, dh): the UNet's self- and cross-attention at 512x512 (64x64 latents), CFG batch 2
SD14_SHAPES = [
    (2, 4096, 4096, 8, 40), (2, 4096, 77, 8, 40), (2, 1024, 1024, 8, 80), (2, 1024, 77, 8, 80),
    (2, 256, 256, 8, 160), (2, 256, 77, 8, 160), (2, 64, 64, 8, 160), (2, 64, 77, 8, 160),
]


def parse_setting(text: str) -> dict:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", choices=["fp32", "fp16"], default="fp16")
    ap.add_argument("--variants", default="partial_softmax,flash,flash_gemm,flash_packed")
    ap.add_argument("--set", action="append", default=[], help="extra constant setting tried on every variant, e.g. BQ=128,TX=5")
    ap.add_argument("--candidates", action="store_true", help="also time each variant's tuner candidates")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--warm-up-s", type=float, default=2.0,
                    help="seconds of the reference kernel before each shape's timings (clocks up from idle; "
                    "without it two runs in one H100 session differed up to 2.9x)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from engine.device import get_gpu
    from engine.errors import EngineError
    from engine.gpu import GpuContext, time_gpu_work
    from engine.kernels import PipelineCache, Selection, variants
    from engine.ops import Ops
    from engine.tune import warm_up

    gpu = get_gpu()
    dtype = "f16" if args.precision == "fp16" else "f32"
    rt = GpuContext(gpu, poison=True)
    pipes = PipelineCache(gpu)
    ops = Ops(rt, pipes, Selection(frozenset(gpu.caps.features)), dtype)
    table = variants("attention")
    rng = np.random.default_rng()
    print(f"{gpu.caps.device} ({gpu.caps.backend}, {gpu.caps.description}), {dtype}")
    rows = []
    ref_v = table["reference"]
    for b, tq, tk, heads, dh in SD14_SHAPES:
        x = [rt.upload(rng.standard_normal((b, t, heads * dh)).astype(np.float32), dtype) for t in (tq, tk, tk)]
        ref = rt.read(ref_v.launch(ops, ref_v, {}, *x, heads, False, dh**-0.5)).astype(np.float64)
        if args.warm_up_s > 0:  # a GPU fresh from idle runs slow until its clocks ramp up
            warm_up(rt, lambda x=x, n=heads, sc=dh**-0.5: ref_v.launch(ops, ref_v, {}, *x, n, False, sc),
                    args.warm_up_s)
        flops = 4.0 * b * heads * tq * tk * dh
        for name in args.variants.split(","):
            v = table[name]
            settings = [{}] + [parse_setting(s) for s in args.set]
            if args.candidates:
                settings += [dict(c) for c in v.candidates]
            for consts in settings:
                try:
                    got = rt.read(v.launch(ops, v, consts, *x, heads, False, dh**-0.5)).astype(np.float64)
                    call = lambda v=v, c=consts, x=x, n=heads, sc=dh**-0.5: v.launch(ops, v, c, *x, n, False, sc)  # noqa: E731
                    samples = time_gpu_work(rt, call, args.warmup, args.reps)
                except EngineError as exc:
                    print(f"  {tq}x{tk} dh{dh} {name} {consts}: skipped ({exc})")
                    continue
                err = float(np.abs(got - ref).max() / np.abs(ref).max())
                med = statistics.median(samples)
                row = {"shape": {"b": b, "tq": tq, "tk": tk, "heads": heads, "dh": dh}, "variant": name,
                       "constants": consts, "median_ms": round(med, 4), "min_ms": round(min(samples), 4),
                       "max_ms": round(max(samples), 4), "n": len(samples), "tflops": round(flops / med / 1e9, 2),
                       "max_rel_err_vs_reference": err}
                rows.append(row)
                print(f"  {tq}x{tk} dh{dh} {name:16s} {json.dumps(consts):32s} {med:8.3f} ms "
                      f"({min(samples):.3f}-{max(samples):.3f})  {row['tflops']:6.2f} TFLOP/s  err {err:.2e}")
    if args.json:
        args.json.write_text(json.dumps({"device": gpu.caps.device, "dtype": dtype, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
