"""The eager engine against the same work replayed from an engine plan, in one process on one
adapter: first the check that a plan's generation equals Pipeline.generate bit for bit (2 steps),
then the UNet CFG step (median of --reps after warm-up; inputs on the GPU, timed to GPU
completion, no upload or readback) and a whole generation of --e2e-steps steps, each way.

    python benchmarks/plan_replay.py --preset sd14 --precision fp16 --json docs/benchmarks/X.json
    python benchmarks/plan_replay.py --preset sd14 --precision fp32 --backend dawn   # Chrome's WebGPU
    python benchmarks/plan_replay.py --preset tiny --executor browser                 # a Chromium page

--backend dawn runs everything through Dawn (`wgpudawn`, Chrome's WebGPU implementation) instead
of wgpu-native: what a Chrome tab on that GPU would reach. --executor browser runs the plan in a
headless Chromium page instead of this process (the eager side stays native).

Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def eager_unet_ms(pipe, height: int, width: int, reps: int, warmup: int) -> list[float]:
    import numpy as np

    f = pipe.vae_scale_factor
    rng = np.random.default_rng(0)
    rt = pipe.rt
    x = rt.upload(rng.standard_normal((2, pipe.latent_channels, height // f, width // f)).astype(np.float32), pipe.dtype)
    temb = pipe._temb(981, 2)
    ctx = rt.upload(rng.standard_normal((2, 77, pipe.config.unet.cross_attention_dim)).astype(np.float32),
                    pipe.dtype)
    times = []
    with pipe.weights_on_gpu("unet", "unet_context"):  # (staged: up for the whole measurement)
        ctx = pipe.context_kv(ctx)  # once, as a generation does (plan replay: stage unet_context)
        for r in range(warmup + reps):
            rt.sync()
            t0 = time.perf_counter()
            eps = pipe.unet_model(x, temb, ctx)
            rt.sync()
            del eps
            if r >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "sd14"])
    parser.add_argument("--model", type=Path, help="a model folder instead of a preset")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16"])
    parser.add_argument("--size", type=int, help="image side (default: the model's native size)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--e2e-steps", type=int, default=20)
    parser.add_argument("--e2e-reps", type=int, default=3)
    parser.add_argument("--profile", help="a kernel-selection profile (a shipped name or a file; default auto)")
    parser.add_argument("--residency", default="resident", choices=["resident", "staged"],
                        help="staged: each network's weights go up when its stage starts (what fits a phone)")
    parser.add_argument("--backend", default="wgpu-native", choices=["wgpu-native", "dawn"])
    parser.add_argument("--executor", default="plan", choices=["plan", "browser"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.backend == "dawn":
        from model_args import use_dawn

        use_dawn()

    import numpy as np

    import engine
    from engine.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(args.preset, 0, Path(tmp) / args.preset, dtype=args.precision)
        t0 = time.perf_counter()
        native = engine.load_pipeline(model, precision=args.precision, residency=args.residency, profile=args.profile)
        load_native = time.perf_counter() - t0
        t0 = time.perf_counter()
        planned = engine.load_pipeline(model, precision=args.precision, executor=args.executor,
                                       residency=args.residency, profile=args.profile)
        caps = native.caps
        size = args.size or native.native_size[0]
        kw = {"steps": 2, "seed": 3, "height": size, "width": size, "scheduler": "pndm"}
        a, b = native.generate("a lighthouse on a cliff at dusk", **kw), planned.generate("a lighthouse on a cliff at dusk", **kw)
        load_plan = time.perf_counter() - t0
        equal = bool(np.array_equal(a.latents, b.latents) and np.array_equal(a.image, b.image))
        max_diff = float(np.abs(a.latents - b.latents).max())
        ex = planned.plan_executor(size, size)
        eager = eager_unet_ms(native, size, size, args.reps, args.warmup)
        replay = ex.time_stage("unet_step", args.reps, args.warmup)
        e2e, uploads = {"eager": [], "plan": []}, {"eager": [], "plan": []}
        stages = {"eager": [], "plan": []}  # each generation's timings: text encoder, UNet loop, VAE, total
        kw = {"steps": args.e2e_steps, "seed": 5, "height": size, "width": size, "scheduler": "pndm"}
        if args.e2e_steps:
            for name, pipe in (("eager", native), ("plan", planned)):
                pipe.generate("warm-up", **kw)
                for _ in range(args.e2e_reps):
                    timings = pipe.generate("a red bicycle leaning on a wall", **kw).timings
                    e2e[name].append(timings["total_ms"])
                    stages[name].append(timings)
                    upload = timings.get("weights_upload_ms", timings.get("weight_upload_ms"))  # native, plan
                    if upload is not None:
                        uploads[name].append(upload)
        plan = ex.plan
        planned_adapter = planned.caps.device
        if hasattr(planned, "close"):
            planned.close()

    dispatches = sum(c["op"] == "dispatch" for c in plan["stages"]["unet_step"]["commands"])
    result = {
        "date": time.strftime("%Y-%m-%d"), "adapter": caps.device, "backend": args.backend,
        "driver": caps.description, "executor": args.executor, "plan_adapter": planned_adapter, "model": args.preset if not args.model else str(args.model),
        "precision": args.precision, "dtype": plan["dtype"], "size": size, "profile": plan["profile"]["name"],
        "unet_dispatches": dispatches, "bit_equal_2_step_generation": equal, "max_latent_diff": max_diff,
        "unet_step_ms": {"eager": eager, "plan": replay},
        "unet_step_median_ms": {"eager": statistics.median(eager), "plan": statistics.median(replay)},
        "e2e_ms": e2e, "e2e_median_ms": {k: statistics.median(v) for k, v in e2e.items() if v},
        "residency": args.residency, "e2e_weights_upload_ms": uploads, "e2e_timings": stages,
        "load_s": {"eager": load_native, "plan_and_check": load_plan},
    }
    me, mp = result["unet_step_median_ms"]["eager"], result["unet_step_median_ms"]["plan"]
    print(f"\n{caps.device} ({args.backend}), {plan['dtype']}, {size}x{size}, profile {plan['profile']['name']}, "
          f"UNet CFG step ({dispatches} dispatches), {args.reps} reps after {args.warmup} warm-up")
    print("| | eager | plan replay | plan / eager |\n|---|---|---|---|")
    print(f"| UNet step ms (median) | {me:.1f} ({min(eager):.1f}-{max(eager):.1f}) | {mp:.1f} "
          f"({min(replay):.1f}-{max(replay):.1f}) | {mp / me:.3f} |")
    if args.e2e_steps:
        ee, ep = result["e2e_median_ms"]["eager"], result["e2e_median_ms"]["plan"]
        print(f"| {args.e2e_steps}-step generation ms (median of {args.e2e_reps}) | {ee:.0f} | {ep:.0f} | {ep / ee:.3f} |")
        for key in ("text_encoder_ms", "unet_total_ms", "vae_decode_ms"):
            se, sp = (statistics.median(t[key] for t in stages[k]) if stages[k] and key in stages[k][0] else float("nan")
                      for k in ("eager", "plan"))
            print(f"| of which {key[:-3].replace('_', ' ')} ms | {se:.1f} | {sp:.1f} | |")
        if uploads["plan"] or uploads["eager"]:
            ue, up = (statistics.median(uploads[k]) if uploads[k] else float("nan") for k in ("eager", "plan"))
            print(f"| of which weight uploads ms ({args.residency}) | {ue:.0f} | {up:.0f} | |")
    if args.executor == "browser":
        print(f"the plan ran in a Chromium page on {planned_adapter}: another adapter than the eager side's, so "
              f"equal bits are not expected (largest latent difference {max_diff:.3g})")
    else:
        print(f"2-step generation bit-equal: {equal} (largest latent difference {max_diff:.3g})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
