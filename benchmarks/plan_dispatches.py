"""Where a plan stage's GPU time goes, call by call: every dispatch of one stage (the UNet step by
default) timed with GPU timestamps, grouped by kernel, pipeline and parameters (the same shape
run by the same kernel and setting), with the shape each group's parameters name.

    python benchmarks/plan_dispatches.py --model DIR --precision fp16 --profile tuned.json \\
        [--stage unet_step] [--reps 5] [--top 40] [--backend dawn] --json out.json

The roofline (`farm engine bench`) adds kernels up by family; this names the calls inside one,
e.g. which of the 168 linear products of an SD 1.4 step take its 16 ms. Timings are per-dispatch
passes (each dispatch timed alone), so small kernels read somewhat slower than in a replay.
--backend dawn runs it through Dawn (what Chrome runs; fp16 is then f16-storage where Dawn offers
no shader-f16). Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The first uniform words of the kernels whose shape this script names (their WGSL Params).
PARAM_NAMES = {
    "linear": ("M", "N", "K", "flags", "a_batch", "b_batch", "c_batch", "act", "batch"),
    "linear_reduce": ("M", "N", "K", "flags", "a_batch", "b_batch", "c_batch", "act", "batch"),
    "conv2d_winograd_gemm": ("M", "N", "K", "flags", "a_batch", "b_batch", "c_batch", "act", "batch"),
    "conv2d_winograd_gemm_reduce": ("M", "N", "K", "flags", "a_batch", "b_batch", "c_batch", "act", "batch"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--precision", choices=["fp32", "fp16"], default="fp16")
    ap.add_argument("--profile", default="auto")
    ap.add_argument("--stage", default="unet_step")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--backend", default="wgpu-native", choices=["wgpu-native", "dawn"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.backend == "dawn":
        from model_args import use_dawn

        use_dawn()

    import numpy as np

    from engine.device import get_gpu
    from engine.models.config import load_model_config
    from engine.plan import record_plan
    from engine.plan_exec import PlanExecutor

    gpu = get_gpu()
    config = load_model_config(args.model)
    h, w = config.native_size
    # the decoder in the element type the native plan executor runs it in (f16 in fp16)
    plan = record_plan(config, gpu.caps, model_dir=args.model, precision=args.precision, height=h, width=w,
                       steps=1, scheduler="euler", profile=args.profile, decodes_again=True)
    ex = PlanExecutor(plan, args.model, gpu, residency="resident")
    if args.stage == "unet_step":  # the keys and values (and kept filters) the step reads
        ctx = plan["stages"]["unet_context"]["inputs"]["context"]["shape"]
        ex.run("unet_context", {"context": np.zeros(tuple(ctx), np.float32)})
    raw = [c for c in plan["stages"][args.stage]["commands"] if c["op"] == "dispatch"]
    ex.kernel_times(args.stage, 1, each=True)  # warm-up
    totals = ex.kernel_times(args.stage, args.reps, each=True)
    if totals is None:
        print("this adapter has no timestamp-query", file=sys.stderr)
        return 2
    groups: dict[tuple, dict] = {}
    for i, c in enumerate(raw):
        pipe = plan["pipelines"][c["pipeline"]]
        raw_uniform = base64.b64decode(plan["uniforms"][c["uniform"]])
        words = struct.unpack(f"<{len(raw_uniform) // 4}I", raw_uniform)
        key = (c["label"], c["pipeline"], c["uniform"], tuple(c["groups"]))
        g = groups.setdefault(key, {"label": c["label"], "shader": pipe["shader"], "constants": pipe["constants"],
                                    "params": dict(zip(PARAM_NAMES.get(c["label"], ()), words, strict=False))
                                    or list(words[:8]), "groups": c["groups"], "calls": 0, "ms": 0.0})
        g["calls"] += 1
        g["ms"] += totals[str(i)]["total_ms"] / args.reps
    rows = sorted(groups.values(), key=lambda g: -g["ms"])
    total = sum(g["ms"] for g in rows)
    print(f"{gpu.caps.device} ({args.backend}, {plan['dtype']}): stage {args.stage}, {len(raw)} dispatches, {total:.2f} GPU ms a run "
          f"(medians not taken: means of {args.reps} runs, each dispatch in a pass of its own)")
    print(f"{'ms':>7} {'calls':>5} {'us/call':>8}  kernel, parameters, constants")
    for g in rows[:args.top]:
        print(f"{g['ms']:7.3f} {g['calls']:5d} {1e3 * g['ms'] / g['calls']:8.1f}  {g['label']} {g['params']} "
              f"{g['constants']} groups {g['groups']}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": dt.date.today().isoformat(), "adapter": gpu.caps.device, "driver": gpu.caps.description,
            "backend": args.backend, "dtype": plan["dtype"], "model": str(args.model), "precision": args.precision, "profile": plan["profile"]["name"],
            "stage": args.stage, "reps": args.reps, "total_ms": total, "groups": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
