"""Golden outputs of diffusers/transformers on the project's tiny synthetic SD model.

Regenerate (needs torch, diffusers, transformers; the project's own venv has none of them):

    /work/venv-gold/bin/python tests/golden/make_goldens.py [--sd14]

(--sd14 also writes the full-size "sd14" preset in fp16, 2.1 GB, and repeats the loading and
single-file checks on it; about a minute. It adds nothing to the npz.)

Made with torch 2.13.0+cpu, diffusers 0.42.1, transformers 5.23.0, tokenizers 0.23.3,
numpy 2.4.6 (the script prints the versions it ran with and stores them in the npz). Output:
tests/golden/tiny_model.npz, every array float32 unless named otherwise.

The model is engine.make_model("tiny", seed=0) written to a temporary folder, loaded by
diffusers in float32 on the CPU. Randomness contract with the engine: all noise comes from
ONE np.random.default_rng(seed), drawn as rng.standard_normal(shape, dtype=np.float32) in the
order diffusers calls randn_tensor (txt2img: the initial latents, then one draw per step for
ancestral samplers; img2img: the VAE posterior sample, then the add_noise noise). The script
replaces randn_tensor in every diffusers module that imported it to do exactly that, and
records the seed and the shapes drawn.

Besides the goldens it checks, and prints: that diffusers and transformers load every
component with no missing/unexpected keys; that to_single_file's checkpoint converted back by
diffusers' own LDM converters (an independent mapping) gives exactly the tiny model's weights;
and the output scales of each network (they should be O(1)).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import diffusers  # noqa: E402
import tokenizers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from diffusers.loaders import single_file_utils  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import CLIPTextModel, CLIPTokenizer  # noqa: E402

from engine.make_model import make_model  # noqa: E402
from engine.weights.single_file import to_single_file  # noqa: E402

OUT = ROOT / "tests" / "golden" / "tiny_model.npz"
MODEL_SEED = 0
TXT2IMG_SEED = 1234
IMG2IMG_SEED = 42
PROMPT = "a photograph of an astronaut riding a horse"

PROMPTS = [
    "",
    PROMPT,
    "a castle on a hill with many towers, " * 14 + "the end",  # > 77 tokens: truncated
    "Hello, world!!! (masterpiece:1.2) -- it's [very] good... #1 @home 3.14 don't WE'LL",
    "café naïve résumé 東京 🚀 Ünïcödé ß ﬁne Å",  # NFC-composed, CJK, emoji, ligature
    "A PhotoGraph Of The MOON",
    "  lots   of\tspace \n newlines\r\n  ",
    "a <|endoftext|> b <|startoftext|>c <|ENDOFTEXT|> d<|endoftext|>e",
]


class NumpyNoise:
    """Stands in for diffusers' randn_tensor: draws from one numpy Generator, records shapes."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.shapes: list[tuple[int, ...]] = []
        self.first: np.ndarray | None = None

    def reset(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.shapes = []
        self.first = None

    def __call__(self, shape, generator=None, device=None, dtype=None, layout=None):
        a = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        if self.first is None:
            self.first = a.copy()
        self.shapes.append(tuple(shape))
        return torch.from_numpy(a).to(device=device or "cpu", dtype=dtype or torch.float32)


def patch_randn(noise: NumpyNoise) -> list[str]:
    """Replace randn_tensor wherever diffusers imported it by name (modules keep their own
    reference, so patching diffusers.utils.torch_utils alone is not enough)."""
    from diffusers.utils import torch_utils

    original = torch_utils.randn_tensor
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("diffusers") and getattr(module, "randn_tensor", None) is original:
            module.randn_tensor = noise
            patched.append(name)
    return patched


def init_image() -> np.ndarray:
    """A deterministic 64x64 RGB picture (1, 64, 64, 3) uint8: gradients and a disc."""
    y, x = np.mgrid[0:64, 0:64].astype(np.float32)
    r = x / 63
    g = y / 63
    b = ((x - 40) ** 2 + (y - 24) ** 2 < 15**2).astype(np.float32) * 0.8 + 0.1
    rgb = np.stack([r, g, b], axis=-1)
    return np.round(rgb * 255).astype(np.uint8)[None]


def check_loading(model_dir: Path) -> None:
    for cls, sub in (
        (UNet2DConditionModel, "unet"),
        (AutoencoderKL, "vae"),
        (CLIPTextModel, "text_encoder"),
    ):
        _, info = cls.from_pretrained(model_dir, subfolder=sub, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
        print(f"load {sub}: {'clean' if not problems else problems}")
        assert not problems, problems


def check_single_file(model_dir: Path, tmp: Path) -> None:
    """to_single_file, then diffusers' LDM converters, must give back the model's weights."""
    ckpt_path = to_single_file(model_dir, tmp / f"{model_dir.name}_ldm.safetensors")
    ckpt = load_file(str(ckpt_path))
    print(
        f"single-file {model_dir.name}: diffusers infers model type "
        f"{single_file_utils.infer_diffusers_model_type(ckpt)!r}"
    )
    unet_cfg = json.loads((model_dir / "unet" / "config.json").read_text())
    vae_cfg = json.loads((model_dir / "vae" / "config.json").read_text())
    converted = {
        "unet": single_file_utils.convert_ldm_unet_checkpoint(ckpt, unet_cfg),
        "vae": single_file_utils.convert_ldm_vae_checkpoint(ckpt, vae_cfg),
        "text_encoder": single_file_utils.convert_ldm_clip_checkpoint(ckpt),
    }
    files = {
        "unet": "unet/diffusion_pytorch_model.safetensors",
        "vae": "vae/diffusion_pytorch_model.safetensors",
        "text_encoder": "text_encoder/model.safetensors",
    }
    for comp, got in converted.items():
        want = load_file(str(model_dir / files[comp]))
        got = {k: v for k, v in got.items() if not k.endswith("position_ids")}
        same_keys = set(got) == set(want)
        same_values = same_keys and all(torch.equal(got[k], want[k]) for k in want)
        print(
            f"single-file cross-check {model_dir.name} {comp}: {len(got)} tensors via diffusers' "
            f"converter, keys {'identical' if same_keys else 'DIFFER'}, values "
            f"{'bit-identical' if same_values else 'DIFFER'}"
        )
        if not same_keys:
            print("  only in converted:", sorted(set(got) - set(want))[:5])
            print("  only in model:", sorted(set(want) - set(got))[:5])
        assert same_values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sd14", action="store_true", help="also check the full-size sd14 preset")
    opts = ap.parse_args()
    torch.set_grad_enabled(False)
    versions = {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
    }
    print("versions:", versions)
    g: dict[str, np.ndarray] = {
        "versions": np.array(json.dumps(versions)),
        "model_seed": np.array(MODEL_SEED),
    }

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = make_model("tiny", MODEL_SEED, tmp / "tiny")
        check_loading(model_dir)
        check_single_file(model_dir, tmp)

        pipe = StableDiffusionPipeline.from_pretrained(
            model_dir, safety_checker=None, requires_safety_checker=False, dtype=torch.float32
        )
        pipe.set_progress_bar_config(disable=True)
        noise = NumpyNoise()
        print("randn_tensor patched in:", ", ".join(patch_randn(noise)))

        # 1. tokenizer (transformers' CLIPTokenizer, called the way SD pipelines call it)
        tok = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")
        ids = tok(
            PROMPTS,
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="np",
        ).input_ids.astype(np.int64)
        g["tok_prompts"] = np.array(PROMPTS)
        g["tok_ids"] = ids  # (8, 77) int64
        print("tokenizer: long prompt has", len(tok(PROMPTS[2]).input_ids), "ids before truncation")

        # 2. text encoder on two prompts
        te_ids = ids[[1, 2]]
        hidden = pipe.text_encoder(torch.from_numpy(te_ids)).last_hidden_state.numpy()
        g["te_input_ids"] = te_ids  # (2, 77) int64
        g["te_last_hidden_state"] = hidden  # (2, 77, 32)
        print(f"text encoder last_hidden_state std {hidden.std():.4f}")

        # 3. UNet noise prediction, even and odd latent sizes
        rng = np.random.default_rng(7)
        sample = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
        timesteps = np.array([999, 10], dtype=np.int64)
        ehs = rng.standard_normal((2, 77, 32), dtype=np.float32)
        odd = rng.standard_normal((2, 4, 5, 7), dtype=np.float32)

        def unet(x: np.ndarray) -> np.ndarray:
            return pipe.unet(
                torch.from_numpy(x),
                torch.from_numpy(timesteps),
                encoder_hidden_states=torch.from_numpy(ehs),
            ).sample.numpy()

        g["unet_sample"], g["unet_timesteps"], g["unet_encoder_hidden_states"] = (
            sample,
            timesteps,
            ehs,
        )
        g["unet_out"] = unet(sample)
        g["unet_odd_sample"] = odd
        g["unet_odd_out"] = unet(odd)
        print(
            f"unet out std {g['unet_out'].std():.4f}, odd-size out std {g['unet_odd_out'].std():.4f}"
        )

        # 4. VAE decode of latents, and encoder moments of an image
        sf = pipe.vae.config.scaling_factor
        z = rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
        image = pipe.vae.decode(torch.from_numpy(z) / sf).sample.numpy()
        g["vae_dec_latents"], g["vae_dec_image"] = (
            z,
            image,
        )  # image = decode(z / sf), (1, 3, 64, 64)
        x = rng.uniform(-1, 1, size=(1, 3, 64, 64)).astype(np.float32)
        dist = pipe.vae.encode(torch.from_numpy(x)).latent_dist
        g["vae_enc_image"] = x
        g["vae_enc_mean"] = dist.mean.numpy()  # (1, 4, 8, 8)
        g["vae_enc_logvar"] = dist.logvar.numpy()  # clamped to [-30, 20] as diffusers does
        print(
            f"vae decode std {image.std():.4f} (|x|>1: {(np.abs(image) > 1).mean():.1%}), "
            f"encode mean std {g['vae_enc_mean'].std():.4f}, logvar mean {g['vae_enc_logvar'].mean():.4f}"
        )

        # 5. txt2img, 2 steps, each scheduler
        base_config = pipe.scheduler.config
        schedulers = {
            "pndm": pipe.scheduler,
            "ddim": DDIMScheduler.from_config(base_config),
            "euler": EulerDiscreteScheduler.from_config(base_config),
            "euler_ancestral": EulerAncestralDiscreteScheduler.from_config(base_config),
            "dpmpp_2m": DPMSolverMultistepScheduler.from_config(base_config),
        }
        expected_first = np.random.default_rng(TXT2IMG_SEED).standard_normal(
            (1, 4, 8, 8), dtype=np.float32
        )
        g["txt2img_seed"] = np.array(TXT2IMG_SEED)
        g["txt2img_prompt"] = np.array(PROMPT)
        g["txt2img_initial_noise"] = expected_first  # first draw: latents before init_noise_sigma
        args = dict(
            prompt=PROMPT,
            negative_prompt="",
            guidance_scale=7.5,
            num_inference_steps=2,
            height=64,
            width=64,
        )
        for name, sched in schedulers.items():
            p = StableDiffusionPipeline(
                **{**pipe.components, "scheduler": sched}, requires_safety_checker=False
            )
            p.set_progress_bar_config(disable=True)
            outs = {}
            for output_type in ("np", "latent"):
                noise.reset(TXT2IMG_SEED)
                outs[output_type] = p(**args, output_type=output_type).images
                assert np.array_equal(noise.first, expected_first)
                draws = list(noise.shapes)
            img = np.asarray(outs["np"], dtype=np.float32)
            lat = outs["latent"].numpy()
            g[f"txt2img_{name}_image"] = img  # (1, 64, 64, 3) in [0, 1]
            g[f"txt2img_{name}_latents"] = lat  # (1, 4, 8, 8), before the VAE
            g[f"txt2img_{name}_timesteps"] = p.scheduler.timesteps.numpy()
            g[f"txt2img_{name}_draws"] = np.array([len(draws)])
            g[f"txt2img_{name}_scheduler_config"] = np.array(json.dumps(dict(p.scheduler.config)))
            print(
                f"txt2img {name}: timesteps {p.scheduler.timesteps.tolist()}, {len(draws)} noise "
                f"draws, image mean {img.mean():.4f} std {img.std():.4f}, latents std {lat.std():.4f}"
            )

        # classifier-free guidance inputs: [uncond, cond] as the pipeline batches them
        cond, uncond = pipe.encode_prompt(PROMPT, "cpu", 1, True, "")
        g["txt2img_prompt_embeds"] = torch.cat([uncond, cond]).numpy()  # (2, 77, 32)

        # 6. img2img, DDIM, 4 steps at strength 0.5 (so 2 run)
        i2i = StableDiffusionImg2ImgPipeline(
            **{**pipe.components, "scheduler": DDIMScheduler.from_config(base_config)},
            requires_safety_checker=False,
        )
        i2i.set_progress_bar_config(disable=True)
        init_u8 = init_image()
        init = init_u8.astype(np.float32) / np.float32(255)
        i2i_args = dict(
            prompt=PROMPT,
            image=init,
            strength=0.5,
            num_inference_steps=4,
            guidance_scale=7.5,
            negative_prompt="",
        )
        outs = {}
        for output_type in ("np", "latent"):
            noise.reset(IMG2IMG_SEED)
            outs[output_type] = i2i(**i2i_args, output_type=output_type).images
            draws = list(noise.shapes)
        g["img2img_seed"] = np.array(IMG2IMG_SEED)
        g["img2img_init_image_u8"] = init_u8  # (1, 64, 64, 3) uint8; the pipeline got u8 / 255
        g["img2img_image"] = np.asarray(outs["np"], dtype=np.float32)
        g["img2img_latents"] = outs["latent"].numpy()
        i2i.scheduler.set_timesteps(i2i_args["num_inference_steps"])
        used, _ = i2i.get_timesteps(i2i_args["num_inference_steps"], i2i_args["strength"], "cpu")
        g["img2img_timesteps"] = used.numpy()  # the steps run; add_noise uses the first
        g["img2img_draws"] = np.array([len(draws)])
        g["img2img_scheduler_config"] = np.array(json.dumps(dict(i2i.scheduler.config)))
        print(
            f"img2img ddim: {len(draws)} noise draws {draws}, image mean "
            f"{g['img2img_image'].mean():.4f} std {g['img2img_image'].std():.4f}"
        )

    if opts.sd14:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            sd14 = make_model("sd14", MODEL_SEED, tmp / "sd14", dtype="fp16")
            check_loading(sd14)
            check_single_file(sd14, tmp)

    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **g)
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB, {len(g)} arrays)")


if __name__ == "__main__":
    main()
