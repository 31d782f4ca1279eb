"""3-step generations of diffusers' StableDiffusionPipeline on the tiny model, for the engine's
executors (native, a replayed plan, a browser page) to be checked against: PNDM, DDIM and Euler,
guidance 7.5, 64x64, the initial latents given (seed TXT2IMG_SEED's first numpy draw, as the
engine takes them).

    /work/venv-gold/bin/python tests/golden/make_3step_goldens.py

Made with torch 2.13.0+cpu, diffusers 0.42.1, transformers 5.23.0 (printed and stored in the npz),
with make_goldens.py's numpy noise in place of randn_tensor. Output:
tests/golden/tiny_model_3step.npz: txt2img3_{name}_image (1, 64, 64, 3) in [0, 1] and
txt2img3_{name}_latents (1, 4, 8, 8), plus the prompt, the seed and the initial latents.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_goldens as mg  # noqa: E402  (the model, the noise and the versions come from there)

OUT = mg.ROOT / "tests" / "golden" / "tiny_model_3step.npz"
STEPS = 3
SCHEDULERS = ("pndm", "ddim", "euler")


def main() -> None:
    torch, diffusers = mg.torch, mg.diffusers
    torch.set_grad_enabled(False)
    versions = {"torch": torch.__version__, "diffusers": diffusers.__version__,
                "transformers": mg.transformers.__version__, "numpy": np.__version__}
    print("versions:", versions)
    first = np.random.default_rng(mg.TXT2IMG_SEED).standard_normal((1, 4, 8, 8), dtype=np.float32)
    g = {"versions": np.array(json.dumps(versions)), "model_seed": np.array(mg.MODEL_SEED),
         "txt2img3_seed": np.array(mg.TXT2IMG_SEED), "txt2img3_prompt": np.array(mg.PROMPT),
         "txt2img3_latents_in": first, "txt2img3_steps": np.array(STEPS)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = mg.make_model("tiny", mg.MODEL_SEED, Path(tmp) / "tiny")
        pipe = mg.StableDiffusionPipeline.from_pretrained(model_dir, safety_checker=None,
                                                          requires_safety_checker=False, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        noise = mg.NumpyNoise()
        mg.patch_randn(noise)
        base = pipe.scheduler.config
        schedulers = {"pndm": pipe.scheduler, "ddim": mg.DDIMScheduler.from_config(base),
                      "euler": mg.EulerDiscreteScheduler.from_config(base)}
        for name in SCHEDULERS:
            p = mg.StableDiffusionPipeline(**{**pipe.components, "scheduler": schedulers[name]},
                                           requires_safety_checker=False)
            p.set_progress_bar_config(disable=True)
            outs = {}
            for output_type in ("np", "latent"):
                noise.reset(mg.TXT2IMG_SEED)
                outs[output_type] = p(prompt=mg.PROMPT, negative_prompt="", guidance_scale=7.5,
                                      num_inference_steps=STEPS, height=64, width=64,
                                      latents=torch.from_numpy(first), output_type=output_type).images
            g[f"txt2img3_{name}_image"] = np.asarray(outs["np"], dtype=np.float32)
            g[f"txt2img3_{name}_latents"] = outs["latent"].numpy()
            print(f"{name}: timesteps {p.scheduler.timesteps.tolist()}, image std {g[f'txt2img3_{name}_image'].std():.4f}")
    np.savez_compressed(OUT, **g)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
