"""Time one classifier-free-guidance UNet step (batch 2), the VAE decode and the text encoder
of a model on this machine's WebGPU adapter, and optionally a whole generation.

Prints a table and writes JSON. Medians of the measured repetitions after warm-up; the spread
is (min, max). Run it on a model folder, or let it make a random-weight one:

    python benchmarks/engine_unet_step.py --preset sd14 --precision fp16 --json out.json
    python benchmarks/engine_unet_step.py --model models/tiny --resolution 64 --generate-steps 20
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_args import add_model_arguments, model_folder  # noqa: E402


def timed(rt, fn, warmup: int, reps: int) -> list[float]:
    for _ in range(warmup):
        fn()
    rt.sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        rt.sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--generate-steps", type=int, default=0, help="also time a whole generation")
    ap.add_argument("--skip-vae", action="store_true")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    from engine import load_pipeline

    tmp = tempfile.TemporaryDirectory()
    model = model_folder(args, Path(tmp.name))

    t0 = time.perf_counter()
    pipe = load_pipeline(model, precision=args.precision)
    load_s = time.perf_counter() - t0
    rt, caps = pipe.rt, pipe.gpu.caps
    res = args.resolution or pipe.native_size[0]
    h = w = res // pipe.vae_scale_factor
    rng = np.random.default_rng(0)
    cross = pipe.config.unet.cross_attention_dim
    sample = rng.standard_normal((2, pipe.latent_channels, h, w), dtype=np.float32)
    # the context's keys and values projected once, as a generation does for all its steps
    ctx = pipe.context_kv(rt.upload(rng.standard_normal((2, 77, cross), dtype=np.float32), pipe.dtype))
    ids = pipe.tokenize(["", "a photograph of an astronaut riding a horse"])

    rows = {}
    rows["unet_step_ms"] = timed(rt, lambda: pipe._unet(sample, 981, ctx), args.warmup, args.reps)
    print(f"UNet step: {statistics.median(rows['unet_step_ms']):.1f} ms", flush=True)
    rows["text_encoder_ms"] = timed(rt, lambda: pipe.encode_text(ids), args.warmup, args.reps)
    if not args.skip_vae:
        z = rng.standard_normal((1, pipe.latent_channels, h, w), dtype=np.float32)
        rows["vae_decode_ms"] = timed(rt, lambda: pipe.decode(z), min(args.warmup, 1), max(1, args.reps // 2))
    gen = None
    if args.generate_steps:
        r = pipe.generate("a photograph of an astronaut riding a horse", steps=args.generate_steps,
                          height=res, width=res, seed=0)
        gen = {k: round(v, 2) for k, v in r.timings.items()}
        rows["end_to_end_ms"] = [r.timings["total_ms"]]

    result = {
        "date": dt.date.today().isoformat(),
        "adapter": caps.device,
        "backend": caps.backend,
        "driver": caps.description,
        "model": args.preset or str(model),
        "precision": pipe.precision,
        "resolution": res,
        "latent": [h, w],
        "load_s": round(load_s, 2),
        "peak_gpu_bytes": rt.peak_bytes,
        "weights_bytes": rt.static_bytes,
        "metrics": {
            k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3), "max": round(max(v), 3), "n": len(v)}
            for k, v in rows.items()
        },
        "generation_timings_ms": gen,
        "dispatches": rt.dispatches,
    }
    print(f"\n{caps.device} ({caps.backend}; {caps.description}), {result['model']}, {pipe.precision}, {res}x{res}")
    print(f"{'metric':<18}{'median':>12}{'min':>12}{'max':>12}{'n':>5}")
    for k, m in result["metrics"].items():
        print(f"{k:<18}{m['median']:>12.1f}{m['min']:>12.1f}{m['max']:>12.1f}{m['n']:>5}")
    print(f"peak GPU memory {rt.peak_bytes / 2**20:.0f} MiB (weights {rt.static_bytes / 2**20:.0f} MiB)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
