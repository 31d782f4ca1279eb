"""The VAE decode in f32 (what an fp16 pipeline runs for a force_upcast VAE, SD 1.x's) against the
same decoder in f16, and at other Winograd scratch bounds (the VAE's Ops scratch_scale), on one
adapter in one process: wall time of one latent to one image (median of --reps after warm-up,
read back included), GPU time per kernel label (timestamps, one decode), the stage's peak GPU
memory (staged weights: the VAE's own weights and the decode), and how far each image is from
the first run's (the largest difference relative to its largest magnitude, the mean absolute
difference, non-finite pixels).

    python benchmarks/vae_precision.py --model /tmp/sd14 --runs f32:1,f32:4,f16:4 --json vae.json

Random-weight models (engine.make_model) do not have a real VAE's activations: the f16 error
here says nothing about overflow on real weights, only what f16 arithmetic costs in accuracy and
saves in time. Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def decode_in(model: Path, vae_dtype: str, scale: int, latent, reps: int, warmup: int, profile=None) -> dict:
    import numpy as np

    import engine
    import engine.pipeline as pipeline_module

    rule, shipped = pipeline_module._vae_dtype, pipeline_module.VAE_SCRATCH_SCALE
    pipeline_module._vae_dtype = lambda config, dtype, decodes_again=False: vae_dtype  # the experiment: this element type
    pipeline_module.VAE_SCRATCH_SCALE = scale  # and these scratch bounds
    try:
        pipe = engine.load_pipeline(model, precision="fp16", residency="staged", profile=profile)
    finally:
        pipeline_module._vae_dtype, pipeline_module.VAE_SCRATCH_SCALE = rule, shipped
    rt = pipe.rt
    rt.reset_peak()
    with pipe.weights_on_gpu("vae_decoder"):
        z = rt.upload(latent, "f32")
        for _ in range(warmup):
            image = pipe._decode(z)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            image = pipe._decode(z)  # reads the image back: waits for the GPU
            times.append((time.perf_counter() - t0) * 1e3)
        kernels = {}
        if pipe.gpu.caps.has_timestamps:
            rt.set_profiling(True)
            rt.take_times()
            pipe._decode(z)
            by_label, _ = rt.take_times()
            rt.set_profiling(False)
            kernels = {k: round(v.total_ms, 3) for k, v in sorted(by_label.items(), key=lambda kv: -kv[1].total_ms)}
        peak = rt.peak_bytes
    return {"vae_dtype": vae_dtype, "scratch_scale": scale, "peak_gpu_bytes": peak, "decode_ms": times, "median_ms": statistics.median(times),
            "kernel_ms": kernels, "gpu_ms": round(sum(kernels.values()), 3),
            "image": np.asarray(image, np.float64), "device": pipe.gpu.caps.device}


def main() -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="f32:4,f16:4", help="VAE element type:scratch scale, comma-separated; "
                    "the first is the reference image")
    ap.add_argument("--profile", help="a kernel-selection profile (a shipped name or a file; default auto)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    latent = np.random.default_rng(args.seed).standard_normal((1, 4, args.size // 8, args.size // 8)).astype(np.float32)
    runs = []
    for spec in args.runs.split(","):
        dtype, scale = spec.split(":")
        runs.append(decode_in(args.model, dtype, int(scale), latent, args.reps, args.warmup, args.profile))
    ref = runs[0]["image"]
    for r in runs:
        got = r.pop("image")
        finite = np.isfinite(got)
        diff = np.abs(np.where(finite, got, 0.0) - ref)
        r["error"] = {"max_rel": float(diff.max() / np.abs(ref).max()), "mean_abs": float(diff.mean()),
                      "non_finite": int((~finite).sum())}
    print(f"{runs[0]['device']}, VAE decode {args.size}x{args.size}, {args.reps} reps after {args.warmup} warm-up")
    print("| VAE | scratch scale | decode ms (median, min-max) | GPU ms (kernels) | stage peak MiB | max err vs first |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        t = r["decode_ms"]
        print(f"| {r['vae_dtype']} | {r['scratch_scale']} | {r['median_ms']:.1f} ({min(t):.1f}-{max(t):.1f}) | "
              f"{r['gpu_ms']:.1f} | {r['peak_gpu_bytes'] / 2**20:.0f} | {r['error']['max_rel']:.2e} |")
    for r in runs:
        top = list(r["kernel_ms"].items())[:8]
        print(f"  {r['vae_dtype']}:{r['scratch_scale']} kernels: " + ", ".join(f"{k} {v}" for k, v in top))
    if args.json:
        out = {"date": time.strftime("%Y-%m-%d"), "device": runs[0]["device"], "size": args.size, "runs": runs}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
