"""Peak GPU memory of a whole generation, from shapes alone: the pipeline runs on a
TraceContext (engine/gpu.py), which allocates from the same buffer pool and counts
weights the same way as the GPU context but does no GPU work, so an SD 1.4 512x512 estimate
takes seconds on any machine. The numbers are the GPU context's own accounting (weights plus
every pool buffer); they leave out what the driver adds (uniform buffers, command buffers,
pipelines, allocation granularity).

    python benchmarks/memory_estimate.py --preset sd14 --precision fp16 --json est.json
    python benchmarks/memory_estimate.py --model /path/to/diffusers/folder --adapter this

The adapter's kernel selection matters (materialised attention scores are the largest
activations), so the estimate is for an adapter: `h100` (NVIDIA H100, Vulkan, its features
and the shipped profile that matches it), `this` (the machine's own adapter), or a JSON file
of DeviceCaps fields.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.device import DeviceCaps  # noqa: E402
from engine.gpu import DTYPES, _align  # noqa: E402
from engine.pipeline import RESIDENCIES, STAGE_WEIGHTS, Pipeline  # noqa: E402

MIB = 2**20

# NVIDIA H100 80GB HBM3 under Vulkan, as wgpu-native reports it (the limits that matter here:
# the binding size bounds how attention scores are split; buffers are never near the others).
H100 = DeviceCaps(
    vendor="nvidia", architecture="", device="NVIDIA H100 80GB HBM3", description="580.159.04",
    adapter_type="DiscreteGPU", backend="Vulkan", vendor_id=0x10DE, device_id=0x2330,
    features=frozenset({"shader-f16", "timestamp-query", "subgroup"}),
    limits={"max-storage-buffer-binding-size": 2**32 - 1, "max-buffer-size": 2**40,
            "max-compute-workgroups-per-dimension": 65535, "max-compute-workgroup-storage-size": 49152,
            "max-compute-invocations-per-workgroup": 1024, "max-storage-buffers-per-shader-stage": 16},
)


def config_for(model: Path | None, preset: str | None):
    """A ModelConfig from a diffusers folder, or a preset's without writing any weights."""
    from engine.make_model import preset_model_config
    from engine.models.config import load_model_config

    if model is not None:
        return load_model_config(model)
    return preset_model_config(preset)


def caps_for(adapter: str) -> DeviceCaps:
    if adapter == "h100":
        return H100
    if adapter == "this":
        from engine.device import get_gpu

        return get_gpu().caps
    doc = json.loads(Path(adapter).read_text())
    return DeviceCaps(**{**doc, "features": frozenset(doc.get("features", ()))})


def estimate(config, caps, precision: str, residency: str, height: int, width: int, profile=None,
             steps: int = 2, img2img: bool = False) -> dict:
    """The accounting of one generation (guidance on) traced on shapes. Two steps suffice: the
    pool reaches its steady state in the first step and every later step allocates alike."""
    pipe = Pipeline.shape_only(config, caps, precision, residency, profile)
    weights = {}
    for stage, state in _stage_shapes(pipe).items():
        dtype = pipe.vae_dtype if stage.startswith("vae") else pipe.dtype
        weights[stage] = sum(_align(max(math.prod(s) * DTYPES[dtype]().itemsize, 4)) for s in state)
    init = None
    if img2img:
        import numpy as np

        init = np.zeros((height, width, 3), np.uint8)
    r = pipe.generate("", steps=steps, height=height, width=width, init_image=init)
    return {
        "precision": pipe.precision, "vae_precision": "fp16" if pipe.vae_dtype == "f16" else "fp32",
        "residency": residency, "height": height, "width": width, "adapter": caps.device,
        "peak_gpu_bytes": r.peak_gpu_bytes,
        "stage_peak_gpu_bytes": r.stage_peak_gpu_bytes,
        "weights_bytes": weights,
        "pool_buffers_created": pipe.rt.pool.created,
    }


def _stage_shapes(pipe) -> dict[str, list[tuple]]:
    from engine.models import params

    shapes = {"text_encoder": params.clip_param_shapes(pipe.config.text_encoder),
              "unet": params.unet_param_shapes(pipe.config.unet),
              "vae": params.vae_param_shapes(pipe.config.vae)}
    out = {}
    for stage, (network, wanted) in STAGE_WEIGHTS.items():
        out[stage] = [s for k, s in shapes[network].items() if wanted(k)]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=("tiny", "sd14"), default=None)
    src.add_argument("--model", type=Path, default=None, help="diffusers model folder (configs only are read)")
    ap.add_argument("--precision", choices=("fp32", "fp16"), default="fp16")
    ap.add_argument("--residency", choices=(*RESIDENCIES, "both"), default="both")
    ap.add_argument("--resolution", type=int, default=None, help="image side (default: the model's native size)")
    ap.add_argument("--adapter", default="h100", help="h100, this, or a JSON file of DeviceCaps fields")
    ap.add_argument("--profile", default=None, help="kernel profile (default: the adapter's auto profile)")
    ap.add_argument("--json", type=Path, default=None, help="write the estimates here")
    args = ap.parse_args(argv)
    config = config_for(args.model, args.preset or ("sd14" if args.model is None else None))
    side = args.resolution or config.native_size[0]
    caps = caps_for(args.adapter)
    profile = args.profile
    if profile and profile.endswith(".json"):  # a document, so no other profile needs to parse
        profile = json.loads(Path(profile).read_text())
    residencies = RESIDENCIES if args.residency == "both" else (args.residency,)
    rows = [estimate(config, caps, args.precision, r, side, side, profile) for r in residencies]
    print(f"{config.source}, {side}x{side}, {rows[0]['precision']} (VAE {rows[0]['vae_precision']}), "
          f"on {caps.device}; MiB")
    w = rows[0]["weights_bytes"]
    print("weights: " + ", ".join(f"{k} {v / MIB:.0f}" for k, v in w.items()))
    print(f"{'residency':<10} {'text encoder':>13} {'UNet context':>13} {'UNet loop':>10} {'VAE decode':>11} "
          f"{'peak':>8}")
    for r in rows:
        s = r["stage_peak_gpu_bytes"]
        print(f"{r['residency']:<10} {s['text_encoder'] / MIB:>13.1f} {s.get('unet_context', 0) / MIB:>13.1f} "
              f"{s['unet'] / MIB:>10.1f} {s['vae_decode'] / MIB:>11.1f} {r['peak_gpu_bytes'] / MIB:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
