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
    # from the end-to-end generation: peak of text_encoder / unet / vae_decode
    stage_peak_gpu_bytes: dict = field(default_factory=dict)
    vae_decode_ms: dict | None = None  # one latent to one image, when timed
    # the last row's UNet step per op family against the adapter's measured peaks (engine.roofline)
    roofline: dict = field(default_factory=dict)


FLASH_VARIANTS = ("flash", "flash_gemm")  # the score matrix never stored
PAPER_FLASH = Rule("attention", "flash", (("dh", 40), ("causal", 0)), why="the paper: flash for head dim 40")
TFLITE_WINOGRAD = Rule(
    "conv2d", "winograd", (("k", 3), ("stride", 1), ("cin", (64, None)), ("cout", (64, None)), ("tiles", (32, None))),
    why="TFLite GPU's default rule",
)


def ablation_profiles(caps, tuned=None, profiles_only: bool = False) -> list[Profile]:
    """The paper's rows, cumulative. Flash goes where the adapter's family profile puts it (the
    paper's head-dim-40 rule when the family has none); Winograd by TFLite GPU's default rule.
    The last row is the tuned profile given, or the shipped one tuned for this exact GPU.
    `profiles_only`: just the profile the adapter gets today, then the tuned one given (a
    before/after of a profile in one run)."""
    if profiles_only:
        shipped = auto_profile(caps)
        rows = [Profile(f"shipped profile ({shipped.name})", shipped.rules)]
        if tuned is not None:
            chosen = resolve_profile(tuned, caps)
            rows.append(Profile(f"given profile ({chosen.name})", chosen.rules, measurements=chosen.measurements))
        return rows
    family = auto_profile(caps, tuned=False)
    flash = [r for r in family.rules if r.op == "attention" and r.variant in FLASH_VARIANTS] or [PAPER_FLASH]
    gn = [Rule("group_norm", "fused")]
    mm = gn + [Rule("linear", "tiled")]
    pfs = mm + [Rule("attention", "partial_softmax")]
    rows = [
        Profile("reference", []),
        Profile("+ fused group norm (GELU/GEGLU is one dispatch in every row)", gn),
        Profile("+ tiled matmul", mm),
        Profile("+ partially fused softmax", pfs),
        Profile(f"+ flash attention where {family.name} selects it", mm + flash + pfs[-1:]),
        Profile("+ Winograd (TFLite's rule)", mm + flash + pfs[-1:] + [TFLITE_WINOGRAD]),
    ]
    chosen = resolve_profile(tuned, caps) if tuned is not None else auto_profile(caps)
    if chosen.measurements:
        rows.append(Profile(f"tuned profile ({chosen.name})", chosen.rules))
    return rows


def _median(samples) -> dict:
    return {"median": round(statistics.median(samples), 3), "min": round(min(samples), 3),
            "max": round(max(samples), 3), "n": len(samples)}


def run_ablation(pipe, height: int, width: int, reps: int = 5, warmup: int = 1, e2e_steps: int = 0,
                 tuned=None, progress=None, vae: bool = False, profiles_only: bool = False) -> list[AblationRow]:
    """The rows, and for the last one the per-kernel times and the roofline where the adapter
    has timestamps. `vae` also times the VAE decode of one latent in every row."""
    from . import roofline as rl

    rt = pipe.rt
    f = pipe.vae_scale_factor
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, pipe.latent_channels, height // f, width // f), dtype=np.float32)
    ctx_np = rng.standard_normal((2, 77, pipe.config.unet.cross_attention_dim), dtype=np.float32)
    profiles = ablation_profiles(pipe.gpu.caps, tuned, profiles_only)
    rows = []
    for i, prof in enumerate(profiles):
        if progress:
            progress(i, len(profiles), prof.name)
        pipe.set_profile(prof)
        rt.reset_peak()
        samples, kernel_ms = [], {}
        with pipe.weights_on_gpu("unet", "unet_context"):  # a staged pipeline uploads the UNet once per row
            # the context's keys and values projected once, as a generation does
            ctx = pipe.context_kv(rt.upload(ctx_np, pipe.dtype))
            for _ in range(warmup):
                pipe._unet(sample, 981, ctx)
            for _ in range(reps):
                t0 = time.perf_counter()
                pipe._unet(sample, 981, ctx)  # reads the result back: waits for the GPU
                samples.append((time.perf_counter() - t0) * 1e3)
            roof = {}
            if i == len(profiles) - 1 and pipe.gpu.caps.has_timestamps:
                rt.set_profiling(True)
                rt.take_times()
                rt.take_work()
                pipe._unet(sample, 981, ctx)
                by_label, by_op = rt.take_times()
                work = rt.take_work()
                rt.set_profiling(False)
                kernel_ms = {k: round(v.total_ms, 3) for k, v in sorted(by_label.items(), key=lambda kv: -kv[1].total_ms)}
                peaks = rl.measure_peaks(pipe.gpu, rt)
                roof = {"peaks": asdict(peaks), "dtype": pipe.dtype,
                        "rows": rl.rows_as_json(rl.roofline(by_op, work, peaks, pipe.dtype))}
            del ctx
        vae_ms = None
        if vae:
            latent = rng.standard_normal((1, pipe.latent_channels, height // f, width // f), dtype=np.float32)
            with pipe.weights_on_gpu("vae_decoder"):
                z = rt.upload(latent, "f32")
                for _ in range(warmup):
                    pipe._decode(z)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    pipe._decode(z)  # reads the image back: waits for the GPU
                    times.append((time.perf_counter() - t0) * 1e3)
                vae_ms = _median(times)
        e2e, stage_peaks = None, {}
        if e2e_steps:
            r = pipe.generate("a photograph of an astronaut riding a horse", steps=e2e_steps,
                              height=height, width=width, seed=0)
            e2e, stage_peaks = r.timings["total_ms"], r.stage_peak_gpu_bytes
        rows.append(AblationRow(prof.name, len(prof.rules), _median(samples), rt.peak_bytes, e2e, kernel_ms,
                                stage_peaks, vae_ms, roof))
    if progress:
        progress(len(profiles), len(profiles), "done")
    return rows


def rows_as_json(rows: list[AblationRow]) -> list[dict]:
    return [asdict(r) for r in rows]
