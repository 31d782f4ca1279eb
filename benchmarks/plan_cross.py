"""One engine plan, two WebGPU implementations: write a plan (the first backend's adapter decides
it), run its generation with fixed inputs through each backend in its own process, and compare
the images and latents. Different shader compilers (Tint for Dawn, naga for wgpu-native) may
round differently, so this reports the difference rather than expecting equal bits.

    python benchmarks/plan_cross.py --preset sd14 --precision fp32 --backends dawn wgpu-native \\
        --json docs/benchmarks/X.json

Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _run(backend: str, plan_path: Path, model: Path, out: Path, make: dict | None) -> None:
    """In this process: (make the plan for this backend's adapter, then) run it, save outputs."""
    if backend == "dawn":
        from model_args import use_dawn

        use_dawn()
    import numpy as np

    from engine.device import get_gpu
    from engine.models.config import load_model_config
    from engine.plan import load_plan, record_plan, write_plan
    from engine.plan_exec import PlanExecutor
    from engine.tokenizer import CLIPTokenizer

    gpu = get_gpu()
    if make is not None:
        config = load_model_config(model)
        write_plan(record_plan(config, gpu.caps, model_dir=model, **make), plan_path)
    plan = load_plan(plan_path)
    missing = set(plan["requires"]["features"]) - set(gpu.caps.features)
    if missing:
        raise SystemExit(f"{backend}: the plan needs {missing}")
    ex = PlanExecutor(plan, model, gpu)
    config = load_model_config(model)
    ids = CLIPTokenizer(config.tokenizer_dir)(["", "a lighthouse on a cliff at dusk"])
    shape = tuple(plan["inputs"]["latents"]["shape"])
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal(shape, dtype=np.float32) * np.float32(plan["loop"]["init_noise_sigma"])
    noise = [rng.standard_normal(shape, dtype=np.float32) for _ in range(plan["inputs"]["noise"]["count"])]
    t0 = time.perf_counter()
    outputs = ex.generate(ids, x0, noise)
    seconds = time.perf_counter() - t0
    np.savez(out, **outputs, seconds=seconds, adapter=np.array(gpu.caps.device), backend=np.array(backend))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "sd14"])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--backends", nargs=2, default=["dawn", "wgpu-native"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)  # backend plan model out
    parser.add_argument("--make", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        backend, plan, model, out = args.child
        _run(backend, Path(plan), Path(model), Path(out), json.loads(args.make) if args.make else None)
        return

    import numpy as np

    from engine.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model or make_model(args.preset, 0, tmp / args.preset, dtype="fp32")
        plan = tmp / "plan.json"
        make = {"precision": args.precision, "steps": args.steps, "scheduler": "pndm"}
        outs = []
        for i, backend in enumerate(args.backends):
            out = tmp / f"{backend}.npz"
            cmd = [sys.executable, __file__, "--child", backend, str(plan), str(model), str(out)]
            if i == 0:
                cmd += ["--make", json.dumps(make)]
            subprocess.run(cmd, check=True)
            outs.append(dict(np.load(out)))
        doc = json.loads(plan.read_text())
    a, b = outs
    img_a, img_b = (np.clip(o["image"][0] / 2 + 0.5, 0, 1) for o in (a, b))
    mse = float(np.mean((img_a - img_b) ** 2))
    result = {
        "date": time.strftime("%Y-%m-%d"), "plan_sha256": doc["sha256"], "dtype": doc["dtype"],
        "size": doc["height"], "steps": args.steps, "profile": doc["profile"]["name"],
        "backends": args.backends, "adapters": [str(o["adapter"]) for o in outs],
        "seconds": [float(o["seconds"]) for o in outs],
        "bit_equal": bool(np.array_equal(a["latents"], b["latents"]) and np.array_equal(a["image"], b["image"])),
        "latents_rel_err": float(np.linalg.norm(a["latents"] - b["latents"]) / np.linalg.norm(b["latents"])),
        "image_psnr_db": float("inf") if mse == 0 else float(10 * np.log10(1 / mse)),
    }
    print(f"\nplan {doc['sha256'][:12]} ({doc['dtype']}, {doc['height']}x{doc['width']}, {args.steps} steps pndm, "
          f"profile {doc['profile']['name']}) on {result['adapters'][0]}")
    print("| backend | generation s |\n|---|---|")
    for name, s in zip(args.backends, result["seconds"], strict=True):
        print(f"| {name} | {s:.2f} |")
    print(f"bit-equal: {result['bit_equal']}; latents relative error {result['latents_rel_err']:.2e}; "
          f"image PSNR {result['image_psnr_db']:.1f} dB")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
