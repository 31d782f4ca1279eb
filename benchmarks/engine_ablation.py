"""The `farm engine tune` and `farm engine bench` services without the CLI's imports, for
machines that carry the engine's dependencies only (the GPU machine has no database stack).

    python benchmarks/engine_ablation.py tune --model DIR --precision fp16 --out tuned.json
    python benchmarks/engine_ablation.py tune --model DIR --precision f16-storage --backend dawn \
        --merge-into tuned.json --out tuned.json   # Chrome's f16-storage settings beside fp16's
    python benchmarks/engine_ablation.py bench --model DIR --precision fp16 --reps 5 --e2e-steps 20 \\
        --residency staged --tuned tuned.json --json out.json

Both call the same engine functions as the CLI (engine.tune.tune, engine.bench.run_ablation)
with the same defaults, and `bench` writes the same JSON document.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["tune", "bench"])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--precision", choices=["fp32", "fp16", "f16-storage"], default="fp16")
    ap.add_argument("--backend", choices=["wgpu-native", "dawn"], default="wgpu-native",
                    help="dawn: run through Dawn, what Chrome runs (no shader-f16 on NVIDIA's Vulkan driver)")
    ap.add_argument("--out", type=Path, help="tune: the profile to write")
    ap.add_argument("--ops", help="tune: only these ops, comma-separated (e.g. linear,conv2d)")
    ap.add_argument("--merge-into", type=Path,
                    help="tune: keep this profile's rules and measurements for the ops not tuned")
    ap.add_argument("--networks", help="tune: only these networks' calls (text_encoder, unet, vae_decoder)")
    ap.add_argument("--vae-dtype", choices=["f32", "f16"],
                    help="tune: time the VAE decoder in this element type (its rules then name it)")
    ap.add_argument("--where", type=json.loads,
                    help='tune: only the shapes this rule condition holds for, e.g. \'{"cout": {"max": 4}}\'')
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--time-budget", type=float, default=600.0)
    ap.add_argument("--tuned", type=Path, help="bench: a tuned profile for the last row")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--e2e-steps", type=int, default=0)
    ap.add_argument("--residency", choices=["resident", "staged"], default="resident")
    ap.add_argument("--no-vae", action="store_true", help="bench: skip the VAE decode timing")
    ap.add_argument("--profiles-only", action="store_true",
                    help="bench: only the shipped profile and --tuned (before/after), no ablation rows")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    if args.backend == "dawn":
        from model_args import use_dawn

        use_dawn()
    from engine.device import get_gpu
    from engine.kernels import storage_dtype

    if args.command == "tune":
        from engine.models.config import load_model_config
        from engine.tune import tune

        config = load_model_config(args.model)
        gpu = get_gpu()
        dtype = storage_dtype(args.precision, gpu.caps.has_f16)  # fp16 without shader-f16: f16-storage
        h, w = config.native_size
        t0 = time.perf_counter()
        ops = set(args.ops.split(",")) if args.ops else None
        networks = set(args.networks.split(",")) if args.networks else None
        base = json.loads(args.merge_into.read_text()) if args.merge_into else None
        doc = tune(config, gpu, dtype, h, w, args.out, repeats=args.repeats, time_budget_s=args.time_budget, ops=ops,
                   networks=networks, vae_dtype=args.vae_dtype, where=args.where, base=base)
        print(f"wrote {args.out}: {len(doc['measurements'])} (op, shape) pairs in {time.perf_counter() - t0:.0f} s")
        return 0

    from engine import load_pipeline
    from engine.bench import rows_as_json, run_ablation

    pipe = load_pipeline(args.model, precision=args.precision, profile="reference", residency=args.residency)
    res = pipe.native_size[0]
    rows = run_ablation(pipe, res, res, reps=args.reps, warmup=args.warmup, e2e_steps=args.e2e_steps,
                        tuned=args.tuned, vae=not args.no_vae, profiles_only=args.profiles_only)
    base = rows[0].unet_step_ms["median"]
    for r in rows:
        u = r.unet_step_ms
        print(f"{r.name:70s} {u['median']:8.1f} ({u['min']:.1f}-{u['max']:.1f}) {(u['median'] / base - 1) * 100:+6.1f}% "
              f"peak {r.peak_gpu_bytes / 2**20:.0f} MiB e2e {r.end_to_end_ms or 0:.0f} ms"
              + (f" vae {r.vae_decode_ms['median']:.1f} ms" if r.vae_decode_ms else ""))
    if rows[-1].stage_peak_gpu_bytes:
        print("stage peaks MiB:", {k: round(v / 2**20) for k, v in rows[-1].stage_peak_gpu_bytes.items()})
    for name, ms in list(rows[-1].kernel_ms.items())[:14]:
        print(f"  {name:40s} {ms:8.2f} ms")
    if rows[-1].roofline:
        from engine.roofline import print_roofline

        print_roofline(rows[-1].roofline)
    if args.json:
        caps = pipe.gpu.caps
        args.json.write_text(json.dumps({"date": dt.date.today().isoformat(), "adapter": caps.device,
                                         "backend": caps.backend, "driver": caps.description,
                                         "precision": pipe.precision, "residency": pipe.residency,
                                         "resolution": res, "rows": rows_as_json(rows)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
