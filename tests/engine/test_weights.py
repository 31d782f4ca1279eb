"""Weight loading: every layout diffusers writes loads, every broken file is refused naming
the file (and the tensor), and single-file checkpoints round-trip and are recognised."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.errors import ModelError, UnsupportedModelError
from engine.make_model import preset_configs, write_model
from engine.models.config import load_model_config
from engine.models.params import param_shapes
from engine.models.sd14 import SD14_TEXT_ENCODER, SD14_UNET, SD14_VAE
from engine.weights.loader import load_component, read_header
from engine.weights.single_file import load_single_file, to_single_file

COMPONENTS = ("text_encoder", "unet", "vae")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """(config, {component: blueprint}, {component: weights}) of the tiny model."""
    cfg = load_model_config(tiny_model_dir)
    blueprints = {c: param_shapes(c, getattr(cfg, c)) for c in COMPONENTS}
    weights = {c: load_component(tiny_model_dir, c, blueprints[c]) for c in COMPONENTS}
    return cfg, blueprints, weights


@pytest.fixture
def vae_dir(tiny_model_dir, tmp_path) -> Path:
    """A writable copy of the tiny model's vae/ folder, inside a model folder."""
    shutil.copytree(tiny_model_dir / "vae", tmp_path / "vae")
    return tmp_path


def _vae_file(root: Path) -> Path:
    return root / "vae" / "diffusion_pytorch_model.safetensors"


def test_loads_in_blueprint_order_as_float32(tiny):
    _, blueprints, weights = tiny
    for c in COMPONENTS:
        assert list(weights[c]) == list(blueprints[c])
        assert all(
            a.dtype == np.float32 and a.shape == blueprints[c][k] for k, a in weights[c].items()
        )


def test_fp16_variant_file_is_found_and_preferred_when_asked(tiny, vae_dir):
    _, blueprints, weights = tiny
    half = {k: a.astype(np.float16) for k, a in weights["vae"].items()}
    save_file(half, str(vae_dir / "vae" / "diffusion_pytorch_model.fp16.safetensors"))
    assert (
        load_component(vae_dir, "vae", blueprints["vae"])["quant_conv.weight"].dtype == np.float32
    )
    got = load_component(vae_dir, "vae", blueprints["vae"], variant="fp16")
    assert all(a.dtype == np.float16 for a in got.values())
    _vae_file(vae_dir).unlink()  # an fp16-only download loads without asking for the variant
    got = load_component(vae_dir, "vae", blueprints["vae"])
    np.testing.assert_array_equal(got["decoder.conv_out.weight"], half["decoder.conv_out.weight"])


def test_sharded_files_with_index(tiny, vae_dir):
    _, blueprints, weights = tiny
    _vae_file(vae_dir).unlink()
    keys = list(weights["vae"])
    shards = {
        "part-00001-of-00002.safetensors": keys[::2],
        "part-00002-of-00002.safetensors": keys[1::2],
    }
    weight_map = {}
    for name, ks in shards.items():
        save_file({k: weights["vae"][k] for k in ks}, str(vae_dir / "vae" / name))
        weight_map.update(dict.fromkeys(ks, name))
    index = vae_dir / "vae" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    got = load_component(vae_dir, "vae", blueprints["vae"])
    assert all(np.array_equal(got[k], weights["vae"][k]) for k in keys)

    (vae_dir / "vae" / "part-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match=r"index\.json: lists shard 'part-00002-of-00002"):
        load_component(vae_dir, "vae", blueprints["vae"])


def _write_bf16(path: Path, bits: dict[str, np.ndarray]) -> None:
    """A safetensors file of BF16 tensors given as their uint16 bit patterns (numpy has no
    bfloat16, so safetensors.numpy cannot write one)."""
    header, offset, chunks = {}, 0, []
    for k, b in bits.items():
        header[k] = {
            "dtype": "BF16",
            "shape": list(b.shape),
            "data_offsets": [offset, offset + b.nbytes],
        }
        offset += b.nbytes
        chunks.append(b.astype("<u2").tobytes())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(chunks))


def test_bfloat16_is_widened_exactly(tiny, vae_dir):
    _, blueprints, weights = tiny
    bits = {k: (a.view(np.uint32) >> 16).astype(np.uint16) for k, a in weights["vae"].items()}
    _write_bf16(_vae_file(vae_dir), bits)
    got = load_component(vae_dir, "vae", blueprints["vae"])
    for k, a in got.items():
        assert a.dtype == np.float32 and a.shape == blueprints["vae"][k]
        np.testing.assert_array_equal(a.view(np.uint32), bits[k].astype(np.uint32) << 16)
        np.testing.assert_allclose(a, weights["vae"][k], rtol=2**-7)


def test_text_encoder_saved_without_text_model_prefix(tiny, tmp_path):
    # transformers >= 5.6 saves CLIPTextModel as "embeddings...", not "text_model.embeddings..."
    _, blueprints, weights = tiny
    (tmp_path / "text_encoder").mkdir()
    flat = {k.removeprefix("text_model."): a for k, a in weights["text_encoder"].items()}
    flat["embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    save_file(flat, str(tmp_path / "text_encoder" / "model.safetensors"))
    got = load_component(tmp_path, "text_encoder", blueprints["text_encoder"])
    assert list(got) == list(blueprints["text_encoder"])


def test_extra_keys_are_ignored(tiny, vae_dir):
    _, blueprints, weights = tiny
    save_file(
        {**weights["vae"], "encoder.extra.position_ids": np.arange(4)}, str(_vae_file(vae_dir))
    )
    assert load_component(vae_dir, "vae", blueprints["vae"]).keys() == blueprints["vae"].keys()


def test_missing_key_names_file_and_key(tiny, vae_dir):
    _, blueprints, weights = tiny
    partial = dict(weights["vae"])
    del partial["decoder.mid_block.attentions.0.to_k.weight"]
    save_file(partial, str(_vae_file(vae_dir)))
    with pytest.raises(ModelError) as e:
        load_component(vae_dir, "vae", blueprints["vae"])
    assert str(_vae_file(vae_dir)) in str(e.value)
    assert "decoder.mid_block.attentions.0.to_k.weight" in str(e.value)


def test_wrong_shape_names_file_key_and_shapes(tiny, vae_dir):
    _, blueprints, weights = tiny
    bad = dict(weights["vae"])
    bad["quant_conv.weight"] = np.zeros((8, 8), np.float32)
    save_file(bad, str(_vae_file(vae_dir)))
    with pytest.raises(
        ModelError,
        match=r"diffusion_pytorch_model\.safetensors: tensor 'quant_conv\.weight' has shape \[8, 8\], expected \[8, 8, 1, 1\]",
    ):
        load_component(vae_dir, "vae", blueprints["vae"])


def test_truncated_file_is_named(tiny, vae_dir):
    _, blueprints, _ = tiny
    path = _vae_file(vae_dir)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelError, match=rf"{path}: tensor .* truncated"):
        load_component(vae_dir, "vae", blueprints["vae"])
    path.write_bytes(b"\x07\x00")
    with pytest.raises(ModelError, match=rf"{path}: 2 bytes, too short"):
        load_component(vae_dir, "vae", blueprints["vae"])


def test_corrupt_header_is_named(tiny, vae_dir):
    _, blueprints, _ = tiny
    path = _vae_file(vae_dir)
    path.write_bytes((16).to_bytes(8, "little") + b"{not json at all" + b"\0" * 64)
    with pytest.raises(ModelError, match=rf"{path}: corrupt safetensors header"):
        load_component(vae_dir, "vae", blueprints["vae"])


def test_pickle_only_component_is_refused(tiny, tmp_path):
    _, blueprints, _ = tiny
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "diffusion_pytorch_model.bin").write_bytes(b"\x80\x02pickle")
    with pytest.raises(ModelError) as e:
        load_component(tmp_path, "unet", blueprints["unet"])
    msg = str(e.value)
    assert "unet" in msg and "diffusion_pytorch_model.bin" in msg and "safetensors" in msg


def test_missing_files_are_named(tiny, tmp_path):
    _, blueprints, _ = tiny
    with pytest.raises(ModelError, match=rf"{tmp_path / 'unet'}: component folder missing"):
        load_component(tmp_path, "unet", blueprints["unet"])
    (tmp_path / "unet").mkdir()
    with pytest.raises(
        ModelError, match=r"no weights found; expected diffusion_pytorch_model\.safetensors"
    ):
        load_component(tmp_path, "unet", blueprints["unet"])


# ---------------------------------------------------------------------------------------------
# single-file checkpoints


def test_single_file_round_trip(tiny, tiny_model_dir, tmp_path):
    cfg, _, weights = tiny
    path = to_single_file(tiny_model_dir, tmp_path / "tiny.safetensors")
    keys = read_header(path).tensors
    assert "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight" in keys
    assert keys["first_stage_model.decoder.mid.attn_1.q.weight"].shape == (32, 32, 1, 1)
    assert "cond_stage_model.transformer.text_model.final_layer_norm.bias" in keys
    got_cfg, got = load_single_file(path)
    assert (got_cfg.unet, got_cfg.vae, got_cfg.text_encoder) == (
        cfg.unet,
        cfg.vae,
        cfg.text_encoder,
    )
    assert got_cfg.tokenizer_dir is None and dict(got_cfg.scheduler) == dict(cfg.scheduler)
    for c in COMPONENTS:
        assert list(got[c]) == list(weights[c])
        for k, a in weights[c].items():
            assert got[c][k].dtype == a.dtype
            np.testing.assert_array_equal(got[c][k], a, err_msg=k)


def test_single_file_without_configs_infers_an_sd1_architecture(tmp_path):
    """A small model whose non-shape settings are SD 1.4's (8 heads, 32 groups, 64-wide CLIP
    heads), written like a downloaded checkpoint: the shapes alone must give its configs."""
    cfgs = preset_configs("tiny")
    cfgs["text_encoder"] = dict(
        SD14_TEXT_ENCODER, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=1, vocab_size=cfgs["text_encoder"]["vocab_size"],
    )  # fmt: skip
    cfgs["unet"] = dict(
        SD14_UNET, block_out_channels=[64, 128], layers_per_block=1, cross_attention_dim=64,
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    )  # fmt: skip
    cfgs["vae"] = dict(
        SD14_VAE, block_out_channels=[32, 64], layers_per_block=1,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
    )  # fmt: skip
    model = write_model(cfgs, 3, tmp_path / "mini")
    path = to_single_file(model, tmp_path / "mini.safetensors", embed_configs=False)
    assert read_header(path).metadata == {"format": "pt"}
    ref = load_model_config(model)
    got_cfg, got = load_single_file(path)
    assert (got_cfg.unet, got_cfg.vae, got_cfg.text_encoder) == (
        ref.unet,
        ref.vae,
        ref.text_encoder,
    )
    unet = load_component(model, "unet", param_shapes("unet", ref.unet))
    for k, a in unet.items():
        np.testing.assert_array_equal(got["unet"][k], a, err_msg=k)


def _stub(path: Path, extra: dict[str, np.ndarray]) -> Path:
    tensors = {"model.diffusion_model.input_blocks.0.0.weight": np.zeros((8, 4, 3, 3), np.float32)}
    save_file({**tensors, **extra}, str(path))
    return path


def test_sd2_single_file_is_refused(tmp_path):
    path = _stub(
        tmp_path / "v2.safetensors",
        {"cond_stage_model.model.ln_final.weight": np.ones(4, np.float32)},
    )
    with pytest.raises(
        UnsupportedModelError, match=r"v2\.safetensors.*OpenCLIP text encoder of SD 2\.x.*SD 1\.x"
    ):
        load_single_file(path)


def test_sdxl_single_file_is_refused(tmp_path):
    extra = {"conditioner.embedders.1.model.ln_final.weight": np.ones(4, np.float32)}
    path = _stub(tmp_path / "xl.safetensors", extra)
    with pytest.raises(UnsupportedModelError, match=r"xl\.safetensors.*SDXL"):
        load_single_file(path)


def test_inpainting_and_incomplete_single_files_are_refused(tmp_path):
    path = tmp_path / "inpaint.safetensors"
    save_file(
        {"model.diffusion_model.input_blocks.0.0.weight": np.zeros((8, 9, 3, 3), np.float32)},
        str(path),
    )
    with pytest.raises(UnsupportedModelError, match="9 input channels"):
        load_single_file(path)
    with pytest.raises(ModelError, match=r"no first_stage_model\.\* keys"):
        load_single_file(_stub(tmp_path / "unet_only.safetensors", {}))
    not_sd = tmp_path / "other.safetensors"
    save_file({"down_blocks.0.resnets.0.conv1.weight": np.zeros((2, 2), np.float32)}, str(not_sd))
    with pytest.raises(ModelError, match=r"no model\.diffusion_model\.\* keys"):
        load_single_file(not_sd)


def test_pickle_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "sd-v1-4.ckpt"
    ckpt.write_bytes(b"PK\x03\x04")
    with pytest.raises(
        ModelError, match=r"sd-v1-4\.ckpt: pickle checkpoints are refused.*safetensors"
    ):
        load_single_file(ckpt)
