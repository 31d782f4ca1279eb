"""The engine with and without WebGPU's run-time checks: the same generation in each, compared
bit for bit, each in its own process (FARM_SHADER_CHECKS=1 keeps the checks; the default on
wgpu-native compiles the engine's kernels without them: engine.device.GPU.shader_module).

    python3 benchmarks/shader_checks.py --model /tmp/sd14 --steps 2 --json checks.json

Prints the largest difference of the final latents (relative to their largest magnitude) and
of the images, and each run's stage times; exit 1 when the latents differ by more than the
kernel tests' tolerance (fp32 2e-5, fp16 1e-2). Where every index is in bounds only rounding can
differ: the compiler may contract or reorder a loop's arithmetic once its index clamps are gone
(on lavapipe the `flash` kernel moves in its last bit; the GEMM core, Winograd, flash_packed
and group norm give the same bits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = {"fp32": 2e-5, "fp16": 1e-2}  # the kernel tests' (relative to the largest magnitude)


def child(args) -> int:
    sys.path.insert(0, str(ROOT))
    import engine
    from engine.device import get_gpu

    pipe = engine.load_pipeline(args.model, precision=args.precision)
    result = pipe.generate("a lighthouse on a cliff at dusk", steps=args.steps, seed=7, height=args.size,
                           width=args.size)
    np.savez(args.out, latents=result.latents, image=result.image)
    print(json.dumps({"unchecked": get_gpu().unchecked, "timings": result.timings}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--precision", default="fp16", choices=["fp32", "fp16"])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, checks in (("checked", "1"), ("unchecked", "0")):
            out = Path(tmp) / f"{mode}.npz"
            cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--precision", args.precision,
                   "--steps", str(args.steps), "--size", str(args.size), "--out", str(out)]
            done = subprocess.run(cmd, env={**os.environ, "FARM_SHADER_CHECKS": checks}, capture_output=True,
                                  text=True, check=False)
            if done.returncode:
                print(done.stdout + done.stderr, file=sys.stderr)
                return 4
            runs[mode] = {**json.loads(done.stdout.strip().splitlines()[-1]), **dict(np.load(out))}
    a, b = runs["checked"], runs["unchecked"]
    report = {
        "model": str(args.model), "precision": args.precision, "steps": args.steps, "size": args.size,
        "unchecked_flags": [a["unchecked"], b["unchecked"]],
        "latents_max_abs_diff": float(np.abs(a["latents"] - b["latents"]).max()),
        "latents_max_rel_diff": float(np.abs(a["latents"] - b["latents"]).max() / max(np.abs(a["latents"]).max(), 1e-6)),
        "tolerance": TOLERANCE[args.precision],
        "image_max_abs_diff": int(np.abs(a["image"].astype(int) - b["image"].astype(int)).max()),
        "timings": {"checked": a["timings"], "unchecked": b["timings"]},
    }
    report["bit_equal"] = report["latents_max_abs_diff"] == 0 and report["image_max_abs_diff"] == 0
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["latents_max_rel_diff"] <= report["tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
