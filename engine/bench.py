"""The paper's ablation table on any adapter: UNet CFG-step latency, peak GPU memory and
(optionally) whole-generation latency as the optimized kernels are switched on one group at
a time, on top of the reference kernels, ending with a tuned profile when one is given.

Each row is a kernel selection built from the adapter's shipped profile (so "flash attention
where the profile selects it" means exactly that profile's rules); weights are loaded once and
the selection swapped between rows. Medians over the repetitions; spread is (min, max).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .kernels import Rule
from .profiles import Profile, auto_profile, resolve_profile


@dataclass
class AblationRow:
    name: str
    rules: int
    unet_step_ms: dict
    peak_gpu_bytes: int
    end_to_end_ms: float | None = None
    kernel_ms: dict = field(default_factory=dict)


def ablation_profiles(caps, tuned=None) -> list[Profile]:
    base = auto_profile(caps)

    def of(*ops_):
        return [r for r in base.rules if r.op in ops_]

    fused = of("group_norm", "geglu", "activation")
    rows = [
        Profile("reference", []),
        Profile("+ fused group norm and GELU", fused),
        Profile("+ tiled matmul", fused + of("linear")),
        Profile("+ partially fused softmax", fused + of("linear") + [Rule("attention", "partial_softmax")]),
        Profile(f"+ flash attention where {base.name} selects it", fused + of("linear", "attention")),
        Profile("+ Winograd (and tiled conv)", fused + of("linear", "attention", "conv2d")),
    ]
    if tuned is not None:
        t = resolve_profile(tuned, caps)
        rows.append(Profile(f"tuned profile ({t.name})", t.rules))
    return rows


def _median(samples) -> dict:
    return {"median": round(statistics.median(samples), 3), "min": round(min(samples), 3),
            "max": round(max(samples), 3), "n": len(samples)}


def run_ablation(pipe, height: int, width: int, reps: int = 5, warmup: int = 1, e2e_steps: int = 0,
                 tuned=None, progress=None) -> list[AblationRow]:
    rt = pipe.rt
    f = pipe.vae_scale_factor
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, pipe.latent_channels, height // f, width // f), dtype=np.float32)
    ctx_np = rng.standard_normal((2, 77, pipe.config.unet.cross_attention_dim), dtype=np.float32)
    profiles = ablation_profiles(pipe.gpu.caps, tuned)
    rows = []
    for i, prof in enumerate(profiles):
        if progress:
            progress(i, len(profiles), prof.name)
        pipe.set_profile(prof)
        rt.reset_peak()
        ctx = rt.upload(ctx_np, pipe.dtype)
        for _ in range(warmup):
            pipe._unet(sample, 981, ctx)
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            pipe._unet(sample, 981, ctx)  # reads the result back: waits for the GPU
            samples.append((time.perf_counter() - t0) * 1e3)
        e2e = None
        if e2e_steps:
            r = pipe.generate("a photograph of an astronaut riding a horse", steps=e2e_steps,
                              height=height, width=width, seed=0)
            e2e = r.timings["total_ms"]
        kernel_ms = {}
        if i == len(profiles) - 1 and pipe.gpu.caps.has_timestamps:
            rt.set_profiling(True)
            rt.take_kernel_times()
            pipe._unet(sample, 981, ctx)
            kernel_ms = {k: round(v.total_ms, 3) for k, v in sorted(
                rt.take_kernel_times().items(), key=lambda kv: -kv[1].total_ms)}
            rt.set_profiling(False)
        rows.append(AblationRow(prof.name, len(prof.rules), _median(samples), rt.peak_bytes, e2e, kernel_ms))
    if progress:
        progress(len(profiles), len(profiles), "done")
    return rows


def rows_as_json(rows: list[AblationRow]) -> list[dict]:
    return [asdict(r) for r in rows]
