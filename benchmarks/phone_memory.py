"""SD 1.4 at 512x512 as a phone's browser would hold it, measured through Dawn (what Chrome
runs; no shader-f16 on NVIDIA's Vulkan driver) or wgpu-native:

1. f16-storage (packed halves, f32 arithmetic) against fp32, every weight resident, the
   adapter's own profile: the replayed plan's UNet CFG step (median of --reps after warm-up,
   timed to GPU completion) and the executor's GPU high-water mark beside `engine.fit`'s;
2. the plan a phone gets (an adapter file from engine/adapters, the paper's 2,093 MB budget:
   staged weights, scratch divided until it fits) executed here as the page would: a --steps
   generation's time, weight upload time, and measured peak against fit's.

    python benchmarks/phone_memory.py --backend dawn --json docs/benchmarks/X.json
    python benchmarks/phone_memory.py --preset tiny --size 64 --backend wgpu-native   # a quick check

Prints tables and writes JSON."""

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
sys.path.insert(0, str(REPO / "benchmarks"))

PAPER_BUDGET = 2_093_000_000


def resident_run(model: Path, precision: str, size: int, reps: int, warmup: int) -> dict:
    import engine
    from engine.fit import fit_plan

    pipe = engine.load_pipeline(model, precision=precision, executor="plan")
    ex = pipe.plan_executor(size, size)
    t0 = time.perf_counter()
    times = ex.time_stage("unet_step", reps, warmup)
    fit = fit_plan(ex.plan, pipe.caps)
    out = {"precision": precision, "dtype": ex.plan["dtype"], "vae_dtype": ex.plan["vae_dtype"],
           "profile": ex.plan["profile"]["name"], "unet_step_ms": times, "unet_step_median_ms": statistics.median(times),
           "peak_gpu_bytes": ex.peak_bytes, "fit_peak_gpu_bytes": fit.peak_gpu_bytes, "timing_s": time.perf_counter() - t0}
    pipe.close()
    return out


def phone_run(model: Path, adapter: str, size: int, steps: int, reps: int) -> dict:
    from engine.device import ADAPTERS_DIR, caps_from_dict, get_gpu
    from engine.fit import fit_plan
    from engine.models.config import load_model_config
    from engine.plan import record_plan_within
    from engine.plan_exec import PlanExecutor
    from engine.tokenizer import CLIPTokenizer

    phone = caps_from_dict(json.loads((ADAPTERS_DIR / adapter).read_text()))
    gpu = get_gpu()
    config = load_model_config(model)
    plan = record_plan_within(config, phone, PAPER_BUDGET, model_dir=model, precision="fp16", height=size, width=size,
                              steps=steps, scheduler="pndm", model_name=model.name)
    fit = fit_plan(plan, phone, PAPER_BUDGET)
    ex = PlanExecutor(plan, model, gpu, budget_bytes=PAPER_BUDGET)
    import numpy as np

    ids = np.asarray(CLIPTokenizer(model / "tokenizer")(["", "a lighthouse on a cliff at dusk"]), dtype=np.uint32)
    rng = np.random.default_rng(0)
    shape = tuple(plan["inputs"]["noise"]["shape"])
    totals, uploads = [], []
    for _ in range(reps):
        latents = rng.standard_normal(shape, dtype=np.float32)
        noise = [rng.standard_normal(shape, dtype=np.float32) for _ in range(plan["inputs"]["noise"]["count"])]
        t0 = time.perf_counter()
        ex.generate(ids, latents, noise)
        totals.append((time.perf_counter() - t0) * 1e3)
        uploads.append(getattr(ex, "upload_ms", 0.0))
    return {"adapter_file": adapter, "profile": plan["profile"]["name"], "dtype": plan["dtype"],
            "vae_dtype": plan["vae_dtype"], "scratch_divisor": plan["scratch_divisor"], "residency": ex.residency,
            "steps": steps, "generation_ms": totals, "generation_median_ms": statistics.median(totals),
            "weight_upload_ms": uploads, "peak_gpu_bytes": ex.peak_bytes, "fit_peak_gpu_bytes": fit.peak_gpu_bytes,
            "fits": fit.fits, "reasons": fit.reasons, "warnings": plan["warnings"],
            "unet_dispatches": sum(c["op"] == "dispatch" for c in plan["stages"]["unet_step"]["commands"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sd14", choices=["tiny", "sd14"])
    parser.add_argument("--model", type=Path, help="a model folder (fp16 weights) instead of making the preset's")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gen-reps", type=int, default=2)
    parser.add_argument("--phones", nargs="*", default=["adreno-7xx-128mib-chrome.json", "mali-g78-chrome.json"])
    parser.add_argument("--precisions", nargs="*", default=["f16-storage", "fp32"])
    parser.add_argument("--backend", default="dawn", choices=["wgpu-native", "dawn"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.backend == "dawn":
        from model_args import use_dawn

        use_dawn()
    from engine.device import get_gpu
    from engine.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = args.model or make_model(args.preset, 0, Path(tmp) / args.preset, dtype="fp16")
        made_s = time.perf_counter() - t0
        caps = get_gpu().caps
        resident = [resident_run(model, p, args.size, args.reps, args.warmup) for p in args.precisions]
        phones = [phone_run(model, a, args.size, args.steps, args.gen_reps) for a in args.phones]
    result = {"date": time.strftime("%Y-%m-%d"), "adapter": caps.device, "driver": caps.description,
              "backend": args.backend, "shader_f16": caps.has_f16, "model": str(args.model or args.preset),
              "size": args.size, "model_made_s": made_s, "resident": resident, "phones": phones}
    print(f"\n{caps.device} ({args.backend}, shader-f16: {caps.has_f16}), {args.size}x{args.size}, batch 2 (CFG)")
    print("| precision | element type | profile | UNet step ms, median (min-max) | peak GPU bytes | fit's |")
    print("|---|---|---|---|---|---|")
    for r in resident:
        t = r["unet_step_ms"]
        print(f"| {r['precision']} | {r['dtype']} (VAE {r['vae_dtype']}) | {r['profile']} | {r['unet_step_median_ms']:.1f} "
              f"({min(t):.1f}-{max(t):.1f}) | {r['peak_gpu_bytes']:,} | {r['fit_peak_gpu_bytes']:,} |")
    if phones:
        print(f"\nphones' plans (budget {PAPER_BUDGET:,} bytes) executed here, {args.steps}-step generations")
        print("| adapter file | profile | types | scratch / | generation ms, median | weight upload ms | peak GPU bytes "
              "| fit's |")
        print("|---|---|---|---|---|---|---|---|")
    for r in phones:
        print(f"| {r['adapter_file']} | {r['profile']} | {r['dtype']}/{r['vae_dtype']} | {r['scratch_divisor']} | "
              f"{r['generation_median_ms']:.0f} | {statistics.median(r['weight_upload_ms']):.0f} | "
              f"{r['peak_gpu_bytes']:,} | {r['fit_peak_gpu_bytes']:,} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
