"""Synthetic Stable Diffusion models: complete diffusers-layout folders with random weights.

This module owns producing the models that tests, goldens and benchmarks run on when real
weights are neither needed nor allowed: every file a real SD 1.x download has (model_index,
configs, scheduler config, tokenizer folder, safetensors weights), written deterministically
from a seed, so diffusers' StableDiffusionPipeline.from_pretrained loads it with no missing or
unexpected keys and the engine can be compared with it number for number.

Presets: "tiny" (a UNet of 32/64 channels, a 2-layer text encoder, a 4-level VAE of 8-32
channels; seconds to run anywhere) and "sd14" (SD 1.4's exact architecture, 1.07 G
parameters, 4.3 GB in fp32), streamed to disk one tensor at a time so memory stays at the
largest tensor.

Weights: with rng = np.random.default_rng(seed), tensors are drawn in blueprint order
(text_encoder, unet, vae) as float32 and rounded to float16 for dtype="fp16", so both dtypes of
one seed are the same model. Matrices and kernels ~ N(0, 1/fan_in), which keeps each layer's
output at unit scale; norm scales ~ 1 + N(0, 0.02^2); biases ~ N(0, 0.02^2). Residual streams
still grow with depth, but every network ends in a normalization before its output layer, so
outputs stay O(1).

The tokenizer is a real byte-level CLIP BPE: the 256 byte symbols, their "</w>" word-final
forms, merges learned from an embedded English sample (padded with synthetic merges to reach
SD 1.4's 49408 entries for "sd14"), then <|startoftext|> and <|endoftext|>.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import InputError
from engine.models.config import (
    CLIPTextConfig,
    ModelConfig,
    UNetConfig,
    VAEConfig,
)
from engine.models.params import clip_param_shapes, unet_param_shapes, vae_param_shapes
from engine.models.sd14 import SD14_SCHEDULER, SD14_TEXT_ENCODER, SD14_UNET, SD14_VAE
from engine.tokenizer import END_OF_WORD, build_clip_bpe
from engine.weights.loader import write_safetensors

PRESETS = ("tiny", "sd14")
DTYPES = {"fp32": np.float32, "fp16": np.float16}
DIFFUSERS_VERSION = "0.42.1"  # the version the goldens were made and checked with
BOS, EOS = "<|startoftext|>", "<|endoftext|>"

# The text the tokenizer's merges are learned from: prompt-like English, written for this
# project. Changing it changes every synthetic model's vocabulary (and the goldens).
SAMPLE_TEXT = """
A photograph of an astronaut riding a horse on the moon, highly detailed, sharp focus.
An oil painting of a quiet harbour at sunset, with fishing boats and seagulls over the water.
A portrait of an old man with a grey beard, soft light from a window, studio photography.
The city at night in the rain: neon signs, wet streets, reflections and people with umbrellas.
A watercolor sketch of a small house in the mountains, pine trees, snow and a winding river.
A cute cat sitting on a stack of books in a library, warm light, cinematic, depth of field.
Concept art of a castle on a cliff above the sea, dramatic clouds, trending on an art station.
A bowl of fresh fruit on a wooden table: apples, oranges, grapes and a lemon, still life.
A red sports car driving through the desert at noon, dust, motion blur, wide angle lens.
A forest path in autumn with golden leaves, morning fog and beams of light between the trees.
An illustration of a robot reading a newspaper in a cafe, vintage poster style, pastel colors.
The surface of a distant planet with two suns, strange rocks and a spaceship landing slowly.
A close up of a flower with drops of water on its petals, macro photography, bright colors.
A medieval market with merchants, horses, baskets of bread and children playing in the square.
A lighthouse standing alone on a rocky island during a storm, waves crashing, dark sky.
A cozy kitchen in the morning, coffee on the stove, sunlight on the floor, a dog asleep nearby.
A painting in the style of the impressionists: a garden with a pond, water lilies and a bridge.
A group of friends laughing around a campfire under the stars, long exposure, the milky way.
A futuristic train crossing a bridge over a canyon, clean design, silver and blue, high speed.
An ancient temple covered in vines in the jungle, statues of stone, birds and a hidden door.
The quick brown fox jumps over the lazy dog; she sells sea shells by the sea shore.
It's a beautiful day, isn't it? We'll walk to the river and they're going to meet us there.
Numbers and signs: 1, 2, 3, 10, 42, 100 percent, 3.14, #1, (best quality), [detailed], 8k.
"""

_TINY_VOCAB = 1000  # 512 byte symbols + 486 learned merges + 2 special tokens


# ---------------------------------------------------------------------------------------------
# tokenizer


def byte_symbols() -> list[str]:
    """The printable character byte-level BPE uses for each byte value 0..255.

    Bytes that are visible Latin-1 characters stand for themselves; the others (controls,
    space, soft hyphen...) are shifted to code points from 256 up, in byte order, so that
    every byte has a visible, non-space symbol. This is the table tokenizers' ByteLevel uses.
    """
    visible = set(range(ord("!"), ord("~") + 1))
    visible |= set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shifted = [], 0
    for b in range(256):
        if b in visible:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _sample_words() -> Counter:
    """Words of the sample text as BPE sees them: byte symbols, the last one marked '</w>'."""
    bytes_only = build_clip_bpe({"a": 0}, [], "a")
    normalized = bytes_only.normalizer.normalize_str(SAMPLE_TEXT)
    words = Counter()
    for piece, _ in bytes_only.pre_tokenizer.pre_tokenize_str(normalized):
        symbols = list(piece)
        symbols[-1] += END_OF_WORD
        words[tuple(symbols)] += 1
    return words


def learn_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A CLIP-style BPE vocabulary of exactly `vocab_size` entries, and its merges.

    Merges are learned greedily from the sample: the most frequent adjacent pair wins, ties go
    to the alphabetically first pair (so the result never depends on dict order). When the
    sample runs out of pairs, synthetic merges (each vocabulary prefix joined with one byte
    symbol) fill the rest, so large vocabularies get real-looking sizes and ids.
    """
    base = byte_symbols()
    tokens = base + [s + END_OF_WORD for s in base]
    n_target = vocab_size - 2  # the two special tokens go last, as in CLIP
    if n_target < len(tokens):
        raise InputError(
            f"vocab_size={vocab_size}; a byte-level BPE needs at least {len(tokens) + 2}"
        )
    known = set(tokens)
    merges: list[tuple[str, str]] = []

    words = _sample_words()
    while len(tokens) < n_target:
        pairs: Counter = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:], strict=False):
                pairs[a, b] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(best)
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        new_words: Counter = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words

    # Synthetic merges: prefix tokens (not word-final) in id order, joined with each symbol.
    prefix_index = 0
    while len(tokens) < n_target:
        prefix = [t for t in tokens if not t.endswith(END_OF_WORD)][prefix_index]
        for s in tokens[: 2 * len(base)]:
            if len(tokens) >= n_target:
                break
            if prefix + s not in known:
                merges.append((prefix, s))
                known.add(prefix + s)
                tokens.append(prefix + s)
        prefix_index += 1

    tokens += [BOS, EOS]
    return {t: i for i, t in enumerate(tokens)}, merges


def _added_token(content: str) -> dict[str, Any]:
    return {
        "content": content,
        "lstrip": False,
        "normalized": True,
        "rstrip": False,
        "single_word": False,
    }


def write_tokenizer(folder: Path, vocab_size: int) -> dict[str, int]:
    """Write vocab.json, merges.txt, special_tokens_map.json, tokenizer_config.json as SD 1.4
    has them; returns the vocabulary."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = learn_vocab(vocab_size)
    (folder / "vocab.json").write_text(
        json.dumps(vocab, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    specials = {
        "bos_token": _added_token(BOS),
        "eos_token": _added_token(EOS),
        "pad_token": EOS,
        "unk_token": _added_token(EOS),
    }
    _write_json(folder / "special_tokens_map.json", specials)
    config = {
        "add_prefix_space": False,
        "do_lower_case": True,
        "errors": "replace",
        "model_max_length": 77,
        "tokenizer_class": "CLIPTokenizer",
        **{
            k: ({"__type": "AddedToken", **v} if isinstance(v, dict) else v)
            for k, v in specials.items()
        },
    }
    _write_json(folder / "tokenizer_config.json", config)
    return vocab


# ---------------------------------------------------------------------------------------------
# configs


def preset_configs(preset: str) -> dict[str, dict[str, Any]]:
    """The JSON config of each component for a preset, as written to disk."""
    if preset == "sd14":
        return {
            "text_encoder": dict(SD14_TEXT_ENCODER),
            "unet": dict(SD14_UNET),
            "vae": dict(SD14_VAE),
            "scheduler": dict(SD14_SCHEDULER),
        }
    if preset == "tiny":
        vocab, _ = learn_vocab(_TINY_VOCAB)
        text = dict(
            SD14_TEXT_ENCODER,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=32,
            vocab_size=_TINY_VOCAB,
            bos_token_id=vocab[BOS],
            eos_token_id=vocab[EOS],
            pad_token_id=vocab[EOS],
        )
        del text["_name_or_path"]
        unet = dict(
            SD14_UNET,
            _diffusers_version=DIFFUSERS_VERSION,
            block_out_channels=[32, 64],
            layers_per_block=2,
            down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
            up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
            cross_attention_dim=32,
            attention_head_dim=4,
            norm_num_groups=8,
            sample_size=8,
        )
        vae = dict(
            SD14_VAE,
            _diffusers_version=DIFFUSERS_VERSION,
            block_out_channels=[8, 16, 32, 32],
            layers_per_block=1,
            norm_num_groups=4,
            latent_channels=4,
            sample_size=64,
            scaling_factor=0.18215,
        )
        return {"text_encoder": text, "unet": unet, "vae": vae, "scheduler": dict(SD14_SCHEDULER)}
    raise InputError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")



def preset_model_config(preset: str) -> ModelConfig:
    """A preset's ModelConfig, without writing any weights (explain, tune, memory estimates)."""
    c, src = preset_configs(preset), Path(f"<preset {preset}>")
    return ModelConfig(
        source=src,
        text_encoder=CLIPTextConfig.from_dict(c["text_encoder"], src),
        unet=UNetConfig.from_dict(c["unet"], src),
        vae=VAEConfig.from_dict(c["vae"], src),
        scheduler=c["scheduler"],
        tokenizer_dir=None,
    )

def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


# ---------------------------------------------------------------------------------------------
# weights


def init_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One parameter's random float32 values (the scheme is in the module docstring)."""
    if name.endswith("token_embedding.weight"):
        return rng.standard_normal(shape, dtype=np.float32)
    if name.endswith("position_embedding.weight"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.5)
    if name.endswith(".bias"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if len(shape) == 1:  # GroupNorm / LayerNorm scale
        return np.float32(1) + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    fan_in = math.prod(shape[1:])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1 / math.sqrt(fan_in))


def make_model(preset: str, seed: int, out_dir: Path | str, dtype: str = "fp32") -> Path:
    """Write a complete diffusers-layout SD model of a preset to out_dir; returns out_dir.

    Same (preset, seed, dtype) -> byte-identical files.
    """
    return write_model(preset_configs(preset), seed, out_dir, dtype)


def write_model(
    configs: dict[str, dict[str, Any]], seed: int, out_dir: Path | str, dtype: str = "fp32"
) -> Path:
    """Write a model from raw JSON configs ({"text_encoder", "unet", "vae", "scheduler"}).

    The tokenizer gets as many entries as the text encoder's vocab_size.
    """
    if dtype not in DTYPES:
        raise InputError(f"dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(
        out / "model_index.json",
        {
            "_class_name": "StableDiffusionPipeline",
            "_diffusers_version": DIFFUSERS_VERSION,
            "feature_extractor": [None, None],
            "requires_safety_checker": False,
            "safety_checker": [None, None],
            "scheduler": ["diffusers", "PNDMScheduler"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "CLIPTokenizer"],
            "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
    )
    text_cfg = dict(
        configs["text_encoder"], torch_dtype="float16" if dtype == "fp16" else "float32"
    )
    _write_json(out / "text_encoder" / "config.json", text_cfg)
    _write_json(out / "unet" / "config.json", configs["unet"])
    _write_json(out / "vae" / "config.json", configs["vae"])
    _write_json(out / "scheduler" / "scheduler_config.json", configs["scheduler"])
    write_tokenizer(out / "tokenizer", configs["text_encoder"]["vocab_size"])

    src = out / "<config>"
    blueprints = {
        "text_encoder": clip_param_shapes(CLIPTextConfig.from_dict(configs["text_encoder"], src)),
        "unet": unet_param_shapes(UNetConfig.from_dict(configs["unet"], src)),
        "vae": vae_param_shapes(VAEConfig.from_dict(configs["vae"], src)),
    }
    files = {
        "text_encoder": "model.safetensors",
        "unet": "diffusion_pytorch_model.safetensors",
        "vae": "diffusion_pytorch_model.safetensors",
    }
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype]
    for component in ("text_encoder", "unet", "vae"):
        shapes = blueprints[component]
        write_safetensors(
            out / component / files[component],
            {name: (shape, np_dtype) for name, shape in shapes.items()},
            lambda name, shapes=shapes: init_tensor(rng, name, shapes[name]),
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a random-weight SD model (diffusers layout).")
    ap.add_argument("preset", choices=PRESETS)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    args = ap.parse_args(argv)
    print(make_model(args.preset, args.seed, args.out_dir, args.dtype))


if __name__ == "__main__":
    main()
