"""Original (CompVis/LDM) single-file SD 1.x checkpoints, to and from the diffusers layout.

This module owns the name mapping between the one-file checkpoints people download
("sd-v1-4.safetensors": model.diffusion_model.* for the UNet, first_stage_model.* for the VAE,
cond_stage_model.transformer.* for the CLIP text encoder) and the three diffusers components
the engine's blueprints describe, plus recognising checkpoints it must refuse (SD 2.x's
OpenCLIP text encoder, SDXL's conditioner, inpainting UNets). Such files carry no configs:
the architecture is read off the tensor shapes, and what shapes cannot tell (head counts,
GroupNorm groups, scaling factor, scheduler) is SD 1.4's. Files written by to_single_file
also store their diffusers configs in the safetensors metadata, so non-SD-1.4 shapes (the
tiny test model) round-trip exactly.

The mapping is generated from the blueprint for the given config rather than listed, so it
follows any depth and width. Everything is name-for-name except the VAE mid-block attention,
whose q/k/v/proj_out are 1x1 convolutions in LDM, (C, C, 1, 1), and Linear layers, (C, C), in
diffusers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import MappingProxyType

import numpy as np

from engine.errors import ModelError, UnsupportedModelError
from engine.models.config import (
    SUPPORTED,
    CLIPTextConfig,
    ModelConfig,
    UNetConfig,
    VAEConfig,
    check_scheduler_config,
    load_model_config,
    read_json,
)
from engine.models.params import clip_param_shapes, unet_param_shapes, vae_param_shapes
from engine.models.sd14 import SD14_SCHEDULER, SD14_TEXT_ENCODER, SD14_UNET, SD14_VAE
from engine.weights.loader import (
    PICKLE_SUFFIXES,
    TensorFile,
    check_shapes,
    component_tensors,
    load_component,
    numpy_dtype,
    read_header,
    write_safetensors,
)

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
CLIP_PREFIX = "cond_stage_model.transformer."
CONFIG_METADATA_KEY = "diffusers_configs"  # JSON of the four configs, written by to_single_file
COMPONENTS = ("text_encoder", "unet", "vae")

_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_RESNET = {"conv_shortcut": "nin_shortcut"}
_VAE_ATTENTION = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}


# ---------------------------------------------------------------------------------------------
# module-prefix maps: diffusers module path -> (LDM module path, renames of its children)


def _unet_modules(cfg: UNetConfig) -> dict[str, tuple[str, dict[str, str]]]:
    m: dict[str, tuple[str, dict[str, str]]] = {
        "conv_in": ("input_blocks.0.0", {}),
        "time_embedding.linear_1": ("time_embed.0", {}),
        "time_embedding.linear_2": ("time_embed.2", {}),
        "conv_norm_out": ("out.0", {}),
        "conv_out": ("out.2", {}),
        "mid_block.resnets.0": ("middle_block.0", _UNET_RESNET),
        "mid_block.attentions.0": ("middle_block.1", {}),
        "mid_block.resnets.1": ("middle_block.2", _UNET_RESNET),
    }
    n = cfg.n_blocks
    # LDM numbers the down path's modules in one flat list: each resnet (+ its attention) is
    # one entry, each downsampler another, after conv_in at index 0.
    k = 1
    for i in range(n):
        for j in range(cfg.layers_per_block[i]):
            m[f"down_blocks.{i}.resnets.{j}"] = (f"input_blocks.{k}.0", _UNET_RESNET)
            m[f"down_blocks.{i}.attentions.{j}"] = (f"input_blocks.{k}.1", {})
            k += 1
        if i < n - 1:
            m[f"down_blocks.{i}.downsamplers.0.conv"] = (f"input_blocks.{k}.0.op", {})
            k += 1
    # The up path's upsampler shares the flat entry of its block's last resnet, after the
    # attention when there is one.
    k = 0
    for i, kind in enumerate(cfg.up_block_types):
        n_layers = cfg.layers_per_block[n - 1 - i] + 1
        for j in range(n_layers):
            m[f"up_blocks.{i}.resnets.{j}"] = (f"output_blocks.{k}.0", _UNET_RESNET)
            m[f"up_blocks.{i}.attentions.{j}"] = (f"output_blocks.{k}.1", {})
            if j == n_layers - 1 and i < n - 1:
                slot = 2 if kind == "CrossAttnUpBlock2D" else 1
                m[f"up_blocks.{i}.upsamplers.0.conv"] = (f"output_blocks.{k}.{slot}.conv", {})
            k += 1
    return m


def _vae_modules(cfg: VAEConfig) -> dict[str, tuple[str, dict[str, str]]]:
    m: dict[str, tuple[str, dict[str, str]]] = {
        "quant_conv": ("quant_conv", {}),
        "post_quant_conv": ("post_quant_conv", {}),
    }
    n = len(cfg.block_out_channels)
    for part in ("encoder", "decoder"):
        m[f"{part}.conv_in"] = (f"{part}.conv_in", {})
        m[f"{part}.conv_out"] = (f"{part}.conv_out", {})
        m[f"{part}.conv_norm_out"] = (f"{part}.norm_out", {})
        m[f"{part}.mid_block.resnets.0"] = (f"{part}.mid.block_1", _VAE_RESNET)
        m[f"{part}.mid_block.resnets.1"] = (f"{part}.mid.block_2", _VAE_RESNET)
        m[f"{part}.mid_block.attentions.0"] = (f"{part}.mid.attn_1", _VAE_ATTENTION)
    for i in range(n):
        for j in range(cfg.layers_per_block):
            m[f"encoder.down_blocks.{i}.resnets.{j}"] = (f"encoder.down.{i}.block.{j}", _VAE_RESNET)
        m[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = (
            f"encoder.down.{i}.downsample.conv",
            {},
        )
        # LDM numbers decoder levels by resolution (0 = full size); diffusers in run order.
        for j in range(cfg.layers_per_block + 1):
            m[f"decoder.up_blocks.{i}.resnets.{j}"] = (
                f"decoder.up.{n - 1 - i}.block.{j}",
                _VAE_RESNET,
            )
        m[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = (
            f"decoder.up.{n - 1 - i}.upsample.conv",
            {},
        )
    return m


def _translate(key: str, modules: dict[str, tuple[str, dict[str, str]]]) -> str:
    """diffusers key -> LDM key (without the component prefix), via the longest module match."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if module in modules:
            ldm_module, renames = modules[module]
            child = ".".join(parts[cut:-1])
            child = renames.get(child, child)
            return ".".join(p for p in (ldm_module, child, parts[-1]) if p)
    raise KeyError(f"no LDM name for diffusers key {key!r}")


def ldm_names(component: str, cfg) -> dict[str, str]:
    """{diffusers key: LDM checkpoint key} for every parameter of one component."""
    if component == "text_encoder":
        return {k: CLIP_PREFIX + k for k in clip_param_shapes(cfg)}
    if component == "unet":
        modules = _unet_modules(cfg)
        return {k: UNET_PREFIX + _translate(k, modules) for k in unet_param_shapes(cfg)}
    if component == "vae":
        modules = _vae_modules(cfg)
        return {k: VAE_PREFIX + _translate(k, modules) for k in vae_param_shapes(cfg)}
    raise ValueError(f"unknown component {component!r}")


def _is_vae_attention_matrix(diffusers_key: str) -> bool:
    return ".mid_block.attentions." in diffusers_key and diffusers_key.endswith(
        ("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight")
    )


# ---------------------------------------------------------------------------------------------
# reading: detect the family, infer the configs, map the weights


def _refuse_families(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    keys = shapes.keys()
    if any(k.startswith("conditioner.embedders.") for k in keys):
        raise UnsupportedModelError(
            f"{path}: has conditioner.embedders.* keys, the text encoders of SDXL; {SUPPORTED}"
        )
    if any(k.startswith("cond_stage_model.model.") for k in keys):
        raise UnsupportedModelError(
            f"{path}: has cond_stage_model.model.* keys, the OpenCLIP text encoder of SD 2.x; "
            f"{SUPPORTED}"
        )
    if not any(k.startswith(UNET_PREFIX) for k in keys):
        raise ModelError(
            f"{path}: no {UNET_PREFIX}* keys, so not an original SD single-file checkpoint "
            "(a diffusers component file belongs in a diffusers-layout folder)"
        )
    conv_in = shapes.get(UNET_PREFIX + "input_blocks.0.0.weight")
    if conv_in is not None and len(conv_in) == 4 and conv_in[1] == 9:
        raise UnsupportedModelError(
            f"{path}: the UNet takes 9 input channels, an SD inpainting model; {SUPPORTED}"
        )
    for k, s in shapes.items():
        if k.startswith(UNET_PREFIX) and k.endswith("attn2.to_k.weight") and s[-1] == 1024:
            raise UnsupportedModelError(
                f"{path}: cross-attention over 1024-wide text features ({k}), i.e. SD 2.x; "
                f"{SUPPORTED}"
            )
    for prefix, what in ((VAE_PREFIX, "VAE"), (CLIP_PREFIX, "CLIP text encoder")):
        if not any(k.startswith(prefix) for k in keys):
            raise ModelError(
                f"{path}: no {prefix}* keys; the checkpoint lacks its {what}. A full SD 1.x "
                "checkpoint (UNet + VAE + text encoder) is needed"
            )


def _count(shapes, pattern: str) -> int:
    """How many distinct integers fill the {} in pattern among the keys."""
    rx = re.compile(re.escape(pattern).replace(r"\{\}", r"(\d+)") + r"\.")
    return len({m.group(1) for k in shapes if (m := rx.match(k))})


def _infer_unet(s: dict[str, tuple[int, ...]]) -> dict:
    p = UNET_PREFIX
    d = dict(SD14_UNET)
    conv_in = s[p + "input_blocks.0.0.weight"]
    d["in_channels"] = conv_in[1]
    d["out_channels"] = s[p + "out.2.weight"][0]
    channels, layers, attn, depth = [], [], [], []
    level_resnets, level_attn, level_depth, level_ch = 0, False, 1, conv_in[0]
    k = 1
    while any(key.startswith(f"{p}input_blocks.{k}.") for key in s):
        if f"{p}input_blocks.{k}.0.op.weight" in s:  # a downsampler closes the level
            channels.append(level_ch)
            layers.append(level_resnets)
            attn.append(level_attn)
            depth.append(level_depth)
            level_resnets, level_attn, level_depth = 0, False, 1
        else:
            level_resnets += 1
            level_ch = s[f"{p}input_blocks.{k}.0.out_layers.3.weight"][0]
            if f"{p}input_blocks.{k}.1.proj_in.weight" in s:
                level_attn = True
                level_depth = _count(s, f"{p}input_blocks.{k}.1.transformer_blocks.{{}}")
        k += 1
    channels.append(level_ch)
    layers.append(level_resnets)
    attn.append(level_attn)
    depth.append(level_depth)
    depth[-1] = max(_count(s, f"{p}middle_block.1.transformer_blocks.{{}}"), 1)

    n = len(channels)
    d["block_out_channels"] = channels
    d["layers_per_block"] = layers[0] if len(set(layers)) == 1 else layers
    d["down_block_types"] = ["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in attn]
    d["up_block_types"] = [
        "CrossAttnUpBlock2D" if attn[n - 1 - i] else "UpBlock2D" for i in range(n)
    ]
    d["transformer_layers_per_block"] = depth[0] if len(set(depth)) == 1 else depth
    to_k = s.get(p + "middle_block.1.transformer_blocks.0.attn2.to_k.weight")
    if to_k is not None:
        d["cross_attention_dim"] = to_k[1]
    proj_in = s.get(p + "middle_block.1.proj_in.weight")
    d["use_linear_projection"] = proj_in is not None and len(proj_in) == 2
    return d


def _infer_vae(s: dict[str, tuple[int, ...]]) -> dict:
    p = VAE_PREFIX
    d = dict(SD14_VAE)
    n = _count(s, p + "encoder.down.{}")
    d["in_channels"] = s[p + "encoder.conv_in.weight"][1]
    d["out_channels"] = s[p + "decoder.conv_out.weight"][0]
    d["latent_channels"] = s[p + "decoder.conv_in.weight"][1]
    d["block_out_channels"] = [s[f"{p}encoder.down.{i}.block.0.conv2.weight"][0] for i in range(n)]
    d["layers_per_block"] = _count(s, p + "encoder.down.0.block.{}")
    d["down_block_types"] = ["DownEncoderBlock2D"] * n
    d["up_block_types"] = ["UpDecoderBlock2D"] * n
    d["mid_block_add_attention"] = p + "encoder.mid.attn_1.q.weight" in s
    d["use_quant_conv"] = p + "quant_conv.weight" in s
    d["use_post_quant_conv"] = p + "post_quant_conv.weight" in s
    return d


def _infer_text_encoder(s: dict[str, tuple[int, ...]], root: str) -> dict:
    d = dict(SD14_TEXT_ENCODER)
    vocab, hidden = s[root + "embeddings.token_embedding.weight"]
    d["vocab_size"], d["hidden_size"] = vocab, hidden
    d["max_position_embeddings"] = s[root + "embeddings.position_embedding.weight"][0]
    d["num_hidden_layers"] = _count(s, root + "encoder.layers.{}")
    d["intermediate_size"] = s[root + "encoder.layers.0.mlp.fc1.weight"][0]
    d["num_attention_heads"] = max(hidden // 64, 1)  # CLIP text towers use 64-wide heads
    return d


def _clip_root(shapes) -> str:
    """Where the CLIP text model's own names start; checkpoints saved with old transformers
    versions lack the "text_model." level."""
    root = CLIP_PREFIX + "text_model."
    return root if any(k.startswith(root) for k in shapes) else CLIP_PREFIX


def load_single_file(path: Path | str) -> tuple[ModelConfig, dict[str, dict[str, np.ndarray]]]:
    """Read an SD 1.x single-file checkpoint.

    Returns (config, {"text_encoder": ..., "unet": ..., "vae": ...}) where each state dict
    uses the diffusers/transformers keys of engine.models.params, arrays as stored (float32
    or float16; bfloat16 widened to float32). config.tokenizer_dir is None: the checkpoint
    has no vocabulary, so the caller supplies an SD 1.x tokenizer folder.
    """
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelError(
            f"{path}: pickle checkpoints are refused because loading them can run arbitrary "
            "code; convert it to .safetensors first"
        )
    header = read_header(path)
    shapes = {k: v.shape for k, v in header.tensors.items()}
    _refuse_families(path, shapes)
    clip_root = _clip_root(shapes)

    def file_key(ldm: str) -> str:
        # ldm_names spells the text encoder with "text_model."; map to this file's spelling
        return (
            clip_root + ldm[len(CLIP_PREFIX + "text_model.") :]
            if ldm.startswith(CLIP_PREFIX)
            else ldm
        )

    stored = header.metadata.get(CONFIG_METADATA_KEY)
    if stored is not None:
        try:
            raw = json.loads(stored)
            raw_cfgs = {c: raw[c] for c in (*COMPONENTS, "scheduler")}
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"{path}: corrupt {CONFIG_METADATA_KEY!r} metadata ({e})") from None
    else:
        try:
            raw_cfgs = {
                "text_encoder": _infer_text_encoder(shapes, clip_root),
                "unet": _infer_unet(shapes),
                "vae": _infer_vae(shapes),
                "scheduler": dict(SD14_SCHEDULER),
            }
        except KeyError as e:
            raise ModelError(
                f"{path}: tensor {e} is missing; cannot read the architecture"
            ) from None

    config = ModelConfig(
        source=path,
        text_encoder=CLIPTextConfig.from_dict(raw_cfgs["text_encoder"], path),
        unet=UNetConfig.from_dict(raw_cfgs["unet"], path),
        vae=VAEConfig.from_dict(raw_cfgs["vae"], path),
        scheduler=MappingProxyType(check_scheduler_config(dict(raw_cfgs["scheduler"]), path)),
        tokenizer_dir=None,
    ).check_consistency()

    weights: dict[str, dict[str, np.ndarray]] = {}
    with TensorFile(header) as f:
        for component in COMPONENTS:
            cfg = _component_config(config, component)
            blueprint = _blueprint(component, cfg)
            names = ldm_names(component, cfg)
            expected, found = {}, {}
            for key, ldm in names.items():
                info = header.tensors.get(file_key(ldm))
                shape = blueprint[key]
                # LDM's VAE attention matrices are 1x1 convs; some converters squeezed them
                # to 2-D already, so accept that too.
                if _is_vae_attention_matrix(key) and not (info and len(info.shape) == 2):
                    shape = shape + (1, 1)
                expected[ldm] = shape
                if info is not None:
                    found[ldm] = (info.shape, info.dtype, path)
            check_shapes(expected, found, component)
            weights[component] = {
                key: f.get(file_key(ldm)).reshape(blueprint[key]) for key, ldm in names.items()
            }
    return config, weights


def _component_config(config: ModelConfig, component: str):
    return {"text_encoder": config.text_encoder, "unet": config.unet, "vae": config.vae}[component]


def _blueprint(component: str, cfg) -> dict[str, tuple[int, ...]]:
    return {
        "text_encoder": clip_param_shapes,
        "unet": unet_param_shapes,
        "vae": vae_param_shapes,
    }[component](cfg)


# ---------------------------------------------------------------------------------------------
# writing


def to_single_file(model_dir: Path | str, out_path: Path | str, embed_configs: bool = True) -> Path:
    """Write a diffusers-layout SD 1.x model as one original-layout .safetensors checkpoint.

    Tensors keep their stored dtype (bfloat16 becomes float32); the VAE attention matrices
    become (C, C, 1, 1) as in the original checkpoints; position_ids is included, as SD 1.4's
    file has it. With embed_configs the diffusers configs go into the metadata so that
    load_single_file restores architectures other than SD 1.4's exactly; without, the file
    is like a downloaded one and its architecture is inferred from the shapes.
    """
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    raw_configs = {
        "text_encoder": read_json(model_dir / "text_encoder" / "config.json"),
        "unet": read_json(model_dir / "unet" / "config.json"),
        "vae": read_json(model_dir / "vae" / "config.json"),
        "scheduler": dict(config.scheduler),
    }

    positions = config.text_encoder.max_position_embeddings
    position_ids = CLIP_PREFIX + "text_model.embeddings.position_ids"
    # int64 first: with the 8-byte tensor at offset 0 every later tensor stays aligned.
    specs: dict[str, tuple[tuple[int, ...], type]] = {position_ids: ((1, positions), np.int64)}
    sources: dict[str, tuple[str, str]] = {}  # LDM key -> (component, diffusers key)
    for component in COMPONENTS:
        cfg = _component_config(config, component)
        blueprint = _blueprint(component, cfg)
        stored = component_tensors(model_dir, component)
        for key, ldm in ldm_names(component, cfg).items():
            shape = blueprint[key] + ((1, 1) if _is_vae_attention_matrix(key) else ())
            dtype = (
                numpy_dtype(stored[key][0].tensors[stored[key][1]].dtype)
                if key in stored
                else np.float32
            )
            specs[ldm] = (shape, dtype)
            sources[ldm] = (component, key)

    # One component in memory at a time (SD 1.4's UNet alone is 3.4 GB in fp32): specs list
    # the components in order, and the writer asks for tensors in that order.
    loaded: dict[str, dict[str, np.ndarray]] = {}

    def make(ldm: str) -> np.ndarray:
        if ldm == position_ids:
            return np.arange(positions, dtype=np.int64)[None]
        component, key = sources[ldm]
        if component not in loaded:
            loaded.clear()
            cfg = _component_config(config, component)
            loaded[component] = load_component(model_dir, component, _blueprint(component, cfg))
        return loaded[component][key].reshape(specs[ldm][0])

    metadata = (
        {CONFIG_METADATA_KEY: json.dumps(raw_configs, sort_keys=True)} if embed_configs else {}
    )
    write_safetensors(out_path, specs, make, metadata=metadata)
    return Path(out_path)
