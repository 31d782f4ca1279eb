"""Model configs: both presets parse, diffusers' defaults and head-count rule are applied, and
every model the engine cannot run is refused with the key, its value and what is supported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.errors import ModelError, UnsupportedModelError
from engine.make_model import preset_configs
from engine.models.config import (
    CLIPTextConfig,
    UNetConfig,
    VAEConfig,
    check_scheduler_config,
    load_model_config,
)
from engine.models.sd14 import SD14_UNET, SD14_VAE

SRC = Path("unet/config.json")


def test_sd14_preset_resolves_like_diffusers():
    cfgs = preset_configs("sd14")
    unet = UNetConfig.from_dict(cfgs["unet"], SRC)
    # SD 1.x's "attention_head_dim: 8" is the number of heads (diffusers issue #2011)
    assert unet.num_attention_heads == (8, 8, 8, 8)
    assert [unet.head_dim(i) for i in range(4)] == [40, 80, 160, 160]
    assert unet.layers_per_block == (2, 2, 2, 2)
    assert unet.transformer_layers_per_block == (1, 1, 1, 1)
    assert unet.time_embed_dim == 1280 and unet.norm_eps == 1e-5 and unet.norm_num_groups == 32
    assert not unet.use_linear_projection and not unet.upcast_attention
    vae = VAEConfig.from_dict(cfgs["vae"], Path("vae/config.json"))
    # SD 1.4's vae/config.json omits these; AutoencoderKL's defaults apply
    assert vae.norm_num_groups == 32 and vae.scaling_factor == 0.18215
    assert vae.vae_scale_factor == 8 and vae.force_upcast and vae.mid_block_add_attention
    te = CLIPTextConfig.from_dict(cfgs["text_encoder"], Path("text_encoder/config.json"))
    assert (te.hidden_size, te.num_attention_heads, te.head_dim) == (768, 12, 64)
    assert te.hidden_act == "quick_gelu" and te.vocab_size == 49408


def test_tiny_model_dir_loads(tiny_model_dir):
    cfg = load_model_config(tiny_model_dir)
    assert cfg.unet.num_attention_heads == (4, 4)
    assert cfg.unet.block_out_channels == (32, 64)
    assert cfg.unet.down_block_types == ("CrossAttnDownBlock2D", "DownBlock2D")
    assert cfg.vae.block_out_channels == (8, 16, 32, 32) and cfg.vae.norm_num_groups == 4
    assert cfg.vae_scale_factor == 8
    assert cfg.text_encoder.hidden_size == 32 and cfg.text_encoder.intermediate_size == 37
    assert cfg.scheduler["_class_name"] == "PNDMScheduler"
    assert cfg.tokenizer_dir == tiny_model_dir / "tokenizer"


def test_per_block_heads_and_sd2_style_keys_are_data():
    d = dict(
        SD14_UNET,
        attention_head_dim=[5, 10, 20, 20],
        use_linear_projection=True,
        upcast_attention=True,
        cross_attention_dim=1024,
        transformer_layers_per_block=[1, 2, 1, 3],
    )
    unet = UNetConfig.from_dict(d, SRC)
    assert unet.num_attention_heads == (5, 10, 20, 20)
    assert unet.head_dim(0) == 64 and unet.use_linear_projection and unet.upcast_attention
    assert unet.transformer_layers_per_block == (1, 2, 1, 3)
    gelu = CLIPTextConfig.from_dict(
        {"hidden_act": "gelu", "hidden_size": 1024, "num_attention_heads": 16}, SRC
    )
    assert gelu.hidden_act == "gelu"


def test_num_attention_heads_is_refused_like_diffusers():
    with pytest.raises(ModelError, match="attention_head_dim"):
        UNetConfig.from_dict(dict(SD14_UNET, num_attention_heads=8), SRC)


def test_sd2_v_prediction_is_refused():
    with pytest.raises(UnsupportedModelError) as e:
        check_scheduler_config({"prediction_type": "v_prediction"}, Path("s.json"))
    assert "SD 2.x v-prediction" in str(e.value) and "SD 1.x" in str(e.value)
    assert "s.json" in str(e.value)


def test_sdxl_unet_is_refused():
    d = dict(SD14_UNET, addition_embed_type="text_time", addition_time_embed_dim=256)
    with pytest.raises(UnsupportedModelError, match=r"addition_embed_type.*SDXL.*SD 1\.x"):
        UNetConfig.from_dict(d, SRC)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("class_embed_type", "projection"),
        ("time_cond_proj_dim", 256),
        ("resnet_time_scale_shift", "scale_shift"),
        ("conv_in_kernel", 7),
        ("attention_type", "gated"),
        ("dual_cross_attention", True),
        ("encoder_hid_dim", 1024),
        ("time_embedding_type", "fourier"),
        ("center_input_sample", True),
        ("only_cross_attention", True),
        ("mid_block_type", "UNetMidBlock2DSimpleCrossAttn"),
        ("in_channels", 9),
    ],
)
def test_unet_features_outside_sd1_are_refused_naming_the_key(key, value):
    with pytest.raises(UnsupportedModelError) as e:
        UNetConfig.from_dict(dict(SD14_UNET, **{key: value}), SRC)
    msg = str(e.value)
    assert key in msg and str(SRC) in msg and "SD 1.x" in msg


def test_default_valued_keys_are_accepted():
    d = dict(
        SD14_UNET,
        class_embed_type=None,
        resnet_time_scale_shift="default",
        mid_block_only_cross_attention=None,
        mid_block_scale_factor=1.0,
        attention_type="default",
        dropout=0.0,
        addition_embed_type_num_heads=64,
    )
    assert UNetConfig.from_dict(d, SRC).num_attention_heads == (8, 8, 8, 8)


def test_unknown_block_type_is_named():
    d = dict(
        SD14_UNET,
        down_block_types=["SimpleCrossAttnDownBlock2D"] + SD14_UNET["down_block_types"][1:],
    )
    with pytest.raises(UnsupportedModelError, match="SimpleCrossAttnDownBlock2D"):
        UNetConfig.from_dict(d, SRC)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"block_out_channels": [320, 640, 1280]}, "one entry per block"),
        ({"attention_head_dim": 7}, "not divisible"),
        ({"norm_num_groups": 48}, "norm_num_groups=48"),
        ({"layers_per_block": "two"}, "layers_per_block"),
        ({"cross_attention_dim": [768, 768, 768, 768]}, "cross_attention_dim"),
    ],
)
def test_bad_unet_values_are_named(change, needle):
    with pytest.raises(ModelError, match=needle):
        UNetConfig.from_dict(dict(SD14_UNET, **change), SRC)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"_class_name": "AutoencoderTiny"}, "AutoencoderTiny"),
        ({"shift_factor": 0.1159}, "shift_factor"),
        ({"up_block_types": ["UpDecoderBlock2D"] * 3 + ["AttnUpDecoderBlock2D"]}, "up_block_types"),
    ],
)
def test_vae_outside_sd1_is_refused(change, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        VAEConfig.from_dict(dict(SD14_VAE, **change), Path("vae/config.json"))


def test_text_encoder_refusals():
    with pytest.raises(UnsupportedModelError, match="relu"):
        CLIPTextConfig.from_dict({"hidden_act": "relu"}, SRC)
    with pytest.raises(UnsupportedModelError, match="CLIPTextModelWithProjection"):
        CLIPTextConfig.from_dict({"architectures": ["CLIPTextModelWithProjection"]}, SRC)


def _copy_configs(src: Path, dst: Path) -> Path:
    """A model folder with the configs and tokenizer of src, and no weights."""
    for rel in (
        "model_index.json",
        "unet/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "scheduler/scheduler_config.json",
    ):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / rel, dst / rel)
    shutil.copytree(src / "tokenizer", dst / "tokenizer")
    return dst


def _edit(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def test_sdxl_model_index_is_refused(tiny_model_dir, tmp_path):
    m = _copy_configs(tiny_model_dir, tmp_path / "m")
    _edit(m / "model_index.json", text_encoder_2=["transformers", "CLIPTextModelWithProjection"])
    with pytest.raises(UnsupportedModelError, match=r"model_index\.json.*SDXL"):
        load_model_config(m)


def test_v_prediction_model_dir_is_refused(tiny_model_dir, tmp_path):
    m = _copy_configs(tiny_model_dir, tmp_path / "m")
    _edit(m / "scheduler" / "scheduler_config.json", prediction_type="v_prediction")
    with pytest.raises(
        UnsupportedModelError, match=r"scheduler_config\.json.*SD 2\.x v-prediction"
    ):
        load_model_config(m)


def test_missing_and_corrupt_config_files_are_named(tiny_model_dir, tmp_path):
    m = _copy_configs(tiny_model_dir, tmp_path / "m")
    (m / "unet" / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"unet/config\.json: not valid JSON"):
        load_model_config(m)
    (m / "unet" / "config.json").unlink()
    with pytest.raises(ModelError, match=r"unet/config\.json: file not found"):
        load_model_config(m)
    with pytest.raises(ModelError, match="not a directory"):
        load_model_config(tmp_path / "nowhere")


def test_components_must_agree(tiny_model_dir, tmp_path):
    m = _copy_configs(tiny_model_dir, tmp_path / "m")
    _edit(m / "unet" / "config.json", cross_attention_dim=64)
    with pytest.raises(ModelError, match="cross_attention_dim=64.*hidden_size=32"):
        load_model_config(m)
