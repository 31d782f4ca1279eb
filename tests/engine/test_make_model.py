"""Synthetic models: deterministic from the seed, exactly the blueprint's tensors, both
dtypes, and SD 1.4's real parameter counts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from engine.errors import InputError
from engine.make_model import make_model, preset_configs
from engine.models.config import CLIPTextConfig, UNetConfig, VAEConfig, load_model_config
from engine.models.params import (
    clip_param_shapes,
    param_shapes,
    unet_param_shapes,
    vae_param_shapes,
)
from engine.tokenizer import CLIPTokenizer
from engine.weights.loader import load_component, read_header

WEIGHT_FILES = {
    "text_encoder": "text_encoder/model.safetensors",
    "unet": "unet/diffusion_pytorch_model.safetensors",
    "vae": "vae/diffusion_pytorch_model.safetensors",
}


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_same_seed_gives_identical_bytes(tiny_model_dir, tmp_path):
    again = make_model("tiny", 0, tmp_path / "again")
    assert _files(again) == _files(tiny_model_dir)


def test_other_seed_changes_only_the_weights(tiny_model_dir, tmp_path):
    other = _files(make_model("tiny", 1, tmp_path / "other"))
    ref = _files(tiny_model_dir)
    assert other.keys() == ref.keys()
    for name in ref:
        if name.endswith(".safetensors"):
            assert other[name] != ref[name], name
        else:
            assert other[name] == ref[name], name


@pytest.mark.parametrize("component", ["text_encoder", "unet", "vae"])
def test_files_hold_exactly_the_blueprint(tiny_model_dir, component):
    cfg = load_model_config(tiny_model_dir)
    blueprint = param_shapes(component, getattr(cfg, component))
    header = read_header(tiny_model_dir / WEIGHT_FILES[component])
    assert {k: v.shape for k, v in header.tensors.items()} == blueprint
    assert {v.dtype for v in header.tensors.values()} == {"F32"}
    assert header.metadata == {"format": "pt"}


def test_weights_follow_the_init_scheme(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    w = load_component(tiny_model_dir, "unet", unet_param_shapes(cfg.unet))
    conv = w["down_blocks.1.resnets.0.conv1.weight"]  # (64, 32, 3, 3): fan_in 288
    assert conv.std() == pytest.approx(1 / math.sqrt(288), rel=0.05)
    norm = w["down_blocks.1.resnets.0.norm1.weight"]
    assert abs(norm.mean() - 1) < 0.01 and norm.std() < 0.05
    assert np.abs(w["conv_in.bias"]).max() < 0.1
    assert all(np.isfinite(a).all() for a in w.values())


def test_fp16_is_the_fp32_model_rounded(tiny_model_dir, tmp_path):
    half = make_model("tiny", 0, tmp_path / "half", dtype="fp16")
    cfg = load_model_config(half)
    for component in ("text_encoder", "unet", "vae"):
        blueprint = param_shapes(component, getattr(cfg, component))
        w16 = load_component(half, component, blueprint)
        w32 = load_component(tiny_model_dir, component, blueprint)
        for key, a in w16.items():
            assert a.dtype == np.float16, key
            np.testing.assert_array_equal(a, w32[key].astype(np.float16))
    assert (
        json.loads((half / "text_encoder" / "config.json").read_text())["torch_dtype"] == "float16"
    )


def test_tokenizer_matches_the_text_encoder(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    tok = CLIPTokenizer(cfg.tokenizer_dir)
    assert tok.vocab_size == cfg.text_encoder.vocab_size == 1000
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (998, 999, 999)
    assert cfg.text_encoder.bos_token_id == 998 and cfg.text_encoder.eos_token_id == 999


def test_model_index_is_a_plain_sd_pipeline(tiny_model_dir):
    index = json.loads((tiny_model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["safety_checker"] == [None, None] and index["feature_extractor"] == [None, None]
    unet = json.loads((tiny_model_dir / "unet" / "config.json").read_text())
    assert unet["_class_name"] == "UNet2DConditionModel" and "_diffusers_version" in unet


def test_sd14_blueprint_has_the_real_parameter_counts():
    # Known sizes of SD 1.4: UNet 859.5 M, VAE 83.7 M, CLIP ViT-L/14 text tower 123.1 M.
    cfgs = preset_configs("sd14")
    src = Path("sd14")
    counts = [
        sum(math.prod(s) for s in f(c.from_dict(cfgs[k], src)).values())
        for f, c, k in (
            (unet_param_shapes, UNetConfig, "unet"),
            (vae_param_shapes, VAEConfig, "vae"),
            (clip_param_shapes, CLIPTextConfig, "text_encoder"),
        )
    ]
    assert counts == [859_520_964, 83_653_863, 123_060_480]


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(InputError, match="'sd15'.*tiny, sd14"):
        make_model("sd15", 0, tmp_path)
    with pytest.raises(InputError, match="'bf16'"):
        make_model("tiny", 0, tmp_path, dtype="bf16")
