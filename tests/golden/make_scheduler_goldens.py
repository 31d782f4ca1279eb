"""Record diffusers' scheduler outputs as the golden data of tests/engine/test_schedulers.py.

Regenerate (from the repository root, in the venv that has torch and diffusers; the test
suite itself never imports torch):

    /work/venv-gold/bin/python tests/golden/make_scheduler_goldens.py

Recorded with torch 2.13.0+cpu, diffusers 0.42.1, numpy 2.4.6 (the script stores the
versions it ran with under "meta/versions").

For each config variant, scheduler and case it stores, under "<variant>/<scheduler>/<case>/":
the timesteps, init_noise_sigma, the starting sample, and the trajectory of a pipeline-style
loop (scale_model_input result, model output fed in, step result) for every timestep. Model
outputs are random float32, not a UNet: the point is the scheduler arithmetic. Each
scheduler is built the way a diffusers user switches schedulers,
``XScheduler.from_config(PNDMScheduler.from_config(file_config).config)``, so defaults
propagate exactly as they do from a model's scheduler_config.json.

Euler ancestral's noise comes from diffusers' randn_tensor, patched here to return
``rng.standard_normal(shape, dtype=float32)`` from ``np.random.default_rng(noise_seed)``:
the draws the engine makes from the Generator the test passes to step().
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import diffusers
import diffusers.schedulers.scheduling_euler_ancestral_discrete as euler_ancestral_module
import numpy as np
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
)

OUT = Path(__file__).with_name("schedulers.npz")
SHAPE = (1, 4, 4, 6)  # a tiny latent: (B, C, H, W), H != W to catch transposes

# CompVis/stable-diffusion-v1-4 scheduler/scheduler_config.json as shipped: no
# timestep_spacing and no prediction_type, so the other classes use their own defaults
SD14_FILE = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.7.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# the same with the two keys written out, as newer diffusers save it
SD14 = {**SD14_FILE, "prediction_type": "epsilon", "timestep_spacing": "leading"}

CLASSES = {
    "pndm": PNDMScheduler,
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_ancestral": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,
}
ALL = tuple(CLASSES)

IMG2IMG = {"steps": 10, "strength": 0.6}

# variant -> (config, schedulers, cases); a case is "steps<n>", "img2img" or "add_noise"
VARIANTS = {
    "sd14": (SD14, ALL, ("steps1", "steps2", "steps5", "steps20", "img2img", "add_noise")),
    "sd14_file": (SD14_FILE, ALL, ("steps5", "steps20", "img2img", "add_noise")),
    "trailing": ({**SD14, "timestep_spacing": "trailing"}, ALL, ("steps5",)),
    "linspace": ({**SD14, "timestep_spacing": "linspace"}, ALL, ("steps5",)),
    "pndm_prk": ({**SD14, "skip_prk_steps": False}, ("pndm",), ("steps5", "steps20")),
    "ddim_clip": (
        {k: v for k, v in SD14.items() if k != "clip_sample"},
        ("ddim",),
        ("steps5", "img2img"),
    ),
}


class PatchedNoise:
    """Stands in for diffusers' randn_tensor so ancestral noise comes from a numpy Generator."""

    def __init__(self) -> None:
        self.rng: np.random.Generator | None = None
        self.calls = 0

    def __call__(self, shape, generator=None, device=None, dtype=None, layout=None):
        self.calls += 1
        draw = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        return torch.from_numpy(draw).to(dtype=dtype or torch.float32)


def seed_of(*parts: str) -> int:
    return zlib.crc32("/".join(parts).encode())


def build(name: str, config: dict):
    pipeline_scheduler = PNDMScheduler.from_config(config)
    return CLASSES[name].from_config(pipeline_scheduler.config)


def run_loop(scheduler, timesteps, sample, rng_inputs, noise: PatchedNoise, out: dict) -> None:
    model_inputs, model_outputs, prev_samples = [], [], []
    for t in timesteps:
        model_inputs.append(scheduler.scale_model_input(sample, t).numpy().copy())
        eps = torch.from_numpy(rng_inputs.standard_normal(SHAPE, dtype=np.float32))
        sample = scheduler.step(eps, t, sample, return_dict=False)[0]
        model_outputs.append(eps.numpy().copy())
        prev_samples.append(sample.numpy().copy())
    out["model_input"] = np.stack(model_inputs)
    out["model_output"] = np.stack(model_outputs)
    out["prev_sample"] = np.stack(prev_samples)
    out["noise_draws"] = np.int64(noise.calls)


def record_case(name: str, config: dict, case: str, key: str, noise: PatchedNoise) -> dict:
    rng_inputs = np.random.default_rng(seed_of(key, "inputs"))
    noise_seed = seed_of(key, "noise")
    noise.rng, noise.calls = np.random.default_rng(noise_seed), 0
    scheduler = build(name, config)
    out: dict = {"noise_seed": np.int64(noise_seed)}

    if case.startswith("steps"):
        scheduler.set_timesteps(int(case.removeprefix("steps")))
        out["timesteps"] = scheduler.timesteps.numpy().copy()
        out["init_noise_sigma"] = np.float64(float(scheduler.init_noise_sigma))
        latents = torch.from_numpy(rng_inputs.standard_normal(SHAPE, dtype=np.float32))
        sample = latents * scheduler.init_noise_sigma  # as StableDiffusionPipeline.prepare_latents
        out["sample0"] = sample.numpy().copy()
        run_loop(scheduler, scheduler.timesteps, sample, rng_inputs, noise, out)

    elif case == "img2img":
        # StableDiffusionImg2ImgPipeline: set_timesteps, get_timesteps, add_noise, loop
        steps, strength = IMG2IMG["steps"], IMG2IMG["strength"]
        scheduler.set_timesteps(steps)
        init_timestep = min(int(steps * strength), steps)
        t_start = max(steps - init_timestep, 0)
        timesteps = scheduler.timesteps[t_start * scheduler.order :]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(t_start * scheduler.order)
        original = torch.from_numpy(rng_inputs.standard_normal(SHAPE, dtype=np.float32))
        image_noise = torch.from_numpy(rng_inputs.standard_normal(SHAPE, dtype=np.float32))
        sample = scheduler.add_noise(original, image_noise, timesteps[:1].repeat(SHAPE[0]))
        out.update(
            steps=np.int64(steps),
            strength=np.float64(strength),
            timesteps=timesteps.numpy().copy(),
            original=original.numpy(),
            image_noise=image_noise.numpy(),
            sample0=sample.numpy().copy(),
        )
        run_loop(scheduler, timesteps, sample, rng_inputs, noise, out)

    elif case == "add_noise":
        # a batch of three samples, each at its own timestep of a fresh 20-step schedule
        scheduler.set_timesteps(20)
        picked = scheduler.timesteps[[0, 7, 19]]
        batch = (3, *SHAPE[1:])
        original = torch.from_numpy(rng_inputs.standard_normal(batch, dtype=np.float32))
        image_noise = torch.from_numpy(rng_inputs.standard_normal(batch, dtype=np.float32))
        noisy = scheduler.add_noise(original, image_noise, picked)
        out.update(
            steps=np.int64(20),
            timesteps=picked.numpy().copy(),
            original=original.numpy(),
            image_noise=image_noise.numpy(),
            noisy=noisy.numpy(),
        )
    else:
        raise ValueError(f"unknown case {case!r}")
    return out


def main() -> None:
    noise = PatchedNoise()
    euler_ancestral_module.randn_tensor = noise
    arrays: dict[str, np.ndarray] = {
        "meta/versions": np.array(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "diffusers": diffusers.__version__,
                    "numpy": np.__version__,
                    "python": sys.version.split()[0],
                }
            )
        ),
        "meta/shape": np.array(SHAPE, dtype=np.int64),
    }
    for variant, (config, names, cases) in VARIANTS.items():
        arrays[f"config/{variant}"] = np.array(json.dumps(config))
        for name in names:
            for case in cases:
                key = f"{variant}/{name}/{case}"
                for field, value in record_case(name, config, case, key, noise).items():
                    arrays[f"{key}/{field}"] = value
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
