"""Model blueprints: the typed, validated configuration of an SD 1.x model read from disk.

This module owns the meaning of the JSON files of a diffusers-layout model (model_index.json,
text_encoder/config.json, unet/config.json, vae/config.json, scheduler/scheduler_config.json):
it turns them into frozen dataclasses with every default and every "this key really means
that" rule of diffusers/transformers already applied, so the forward-pass code never looks at
a raw dict. Whatever the engine cannot run (SDXL, SD 2.x v-prediction, inpainting, LCM, exotic
blocks...) is refused here, at the boundary, with the key, its value and what is supported.
Weights live elsewhere (engine.weights); parameter names and shapes in engine.models.params.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from engine.errors import ModelError, UnsupportedModelError
from engine.models.sd14 import SD14_UNET

SUPPORTED = "supported: the SD 1.x family (UNet2DConditionModel + CLIPTextModel + AutoencoderKL)"

# ---------------------------------------------------------------------------------------------
# small readers that name the file and key on every failure


def _bad(source: Path, key: str, value: Any, expected: str) -> ModelError:
    return ModelError(f"{source}: key {key!r} is {value!r}; expected {expected}")


def _unsupported(source: Path, key: str, value: Any, family: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{source}: {key}={value!r} means {family}, which this engine does not run; {SUPPORTED}"
    )


def _int(d: dict, key: str, default: Any, source: Path, minimum: int = 1) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _bad(source, key, v, f"an integer >= {minimum}")
    return v


def _float(d: dict, key: str, default: Any, source: Path) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(source, key, v, "a number")
    return float(v)


def _bool(d: dict, key: str, default: bool, source: Path) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise _bad(source, key, v, "true or false")
    return v


def _opt_int(d: dict, key: str, default: int | None, source: Path) -> int | None:
    v = d.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(source, key, v, "an integer or null")
    return v


def _str_tuple(d: dict, key: str, default: Any, source: Path) -> tuple[str, ...]:
    v = d.get(key, default)
    if not isinstance(v, list | tuple) or not v or not all(isinstance(s, str) for s in v):
        raise _bad(source, key, v, "a non-empty list of block type names")
    return tuple(v)


def _int_tuple(d: dict, key: str, default: Any, source: Path) -> tuple[int, ...]:
    v = d.get(key, default)
    if (
        not isinstance(v, list | tuple)
        or not v
        or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
    ):
        raise _bad(source, key, v, "a non-empty list of positive integers")
    return tuple(v)


def _per_block(d: dict, key: str, default: Any, n: int, source: Path) -> tuple[int, ...]:
    """diffusers accepts an int (same for every block) or one value per down block."""
    v = d.get(key, default)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return (v,) * n
    if (
        isinstance(v, list | tuple)
        and len(v) == n
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
    ):
        return tuple(v)
    raise _bad(source, key, v, f"a positive integer or a list of {n} of them (one per block)")


def _sample_size(d: dict, key: str, default: Any, source: Path) -> int | tuple[int, int]:
    v = d.get(key, default)
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if isinstance(v, list | tuple) and len(v) == 2 and all(isinstance(x, int) and x > 0 for x in v):
        return (v[0], v[1])
    raise _bad(source, key, v, "a positive integer or [height, width]")


def _check_kind(d: Any, source: Path, key: str, expected: str, requirement: str) -> None:
    """Refuse a config file that is not a JSON object, or whose ``key`` names another kind of
    network than ``expected`` (absent counts as expected); ``requirement`` says what is run."""
    if not isinstance(d, dict):
        raise ModelError(f"{source}: expected a JSON object, got {type(d).__name__}")
    found = d.get(key, expected)
    if found != expected:
        raise UnsupportedModelError(f"{source}: {key}={found!r}; {requirement}; {SUPPORTED}")


def _refuse_unless(d: dict, source: Path, key: str, allowed: Any, what: str) -> None:
    """Refuse a key whose value turns on a feature outside SD 1.x (absent counts as allowed).

    ``allowed`` is the feature-off value, or a tuple of them when several spell "off".
    """
    ok = allowed if isinstance(allowed, tuple) else (allowed,)
    # compare types too: JSON 0 must not pass for false, nor 1 for true
    if key in d and not any(type(d[key]) is type(a) and d[key] == a for a in ok):
        raise UnsupportedModelError(
            f"{source}: {key}={d[key]!r} turns on {what}, which this engine does not implement "
            f"(it needs {key}={ok[0]!r}); {SUPPORTED}"
        )


def _check_groups(source: Path, groups: int, channels: tuple[int, ...], key: str) -> None:
    for c in channels:
        if c % groups:
            raise ModelError(
                f"{source}: norm_num_groups={groups} does not divide {key} entry {c}; "
                "GroupNorm needs channels divisible by the group count"
            )


# ---------------------------------------------------------------------------------------------
# text encoder


@dataclass(frozen=True)
class CLIPTextConfig:
    """transformers' CLIPTextConfig, as far as a CLIPTextModel forward pass needs it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int
    hidden_act: str  # "quick_gelu" (every SD 1.x) or "gelu" (SD 2.x's OpenCLIP); kept as data
    layer_norm_eps: float
    # As written in the file; SD 1.4 still says bos 0 / eos 2 / pad 1, which are NOT the ids
    # its tokenizer produces (49406 / 49407): take token ids from the tokenizer, never from here.
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, source: Path) -> CLIPTextConfig:
        _check_kind(d, source, "model_type", "clip_text_model",
                    "the text encoder must be a CLIPTextModel (model_type 'clip_text_model')")
        archs = d.get("architectures")
        if archs and any(a != "CLIPTextModel" for a in archs):
            raise UnsupportedModelError(
                f"{source}: architectures={archs!r}; only CLIPTextModel text encoders are run "
                f"(CLIPTextModelWithProjection belongs to SDXL); {SUPPORTED}"
            )
        # Defaults are transformers' CLIPTextConfig defaults, used when a key is absent.
        hidden = _int(d, "hidden_size", 512, source)
        heads = _int(d, "num_attention_heads", 8, source)
        if hidden % heads:
            raise ModelError(
                f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads}"
            )
        act = d.get("hidden_act", "quick_gelu")
        if act not in ("quick_gelu", "gelu"):
            raise UnsupportedModelError(
                f"{source}: hidden_act={act!r}; CLIP text encoders use 'quick_gelu' (SD 1.x) "
                f"or 'gelu' (SD 2.x); {SUPPORTED}"
            )
        return cls(
            vocab_size=_int(d, "vocab_size", 49408, source),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size", 2048, source),
            num_hidden_layers=_int(d, "num_hidden_layers", 12, source),
            num_attention_heads=heads,
            max_position_embeddings=_int(d, "max_position_embeddings", 77, source),
            hidden_act=act,
            layer_norm_eps=_float(d, "layer_norm_eps", 1e-5, source),
            bos_token_id=_opt_int(d, "bos_token_id", 49406, source),
            eos_token_id=_opt_int(d, "eos_token_id", 49407, source),
            pad_token_id=_opt_int(d, "pad_token_id", 1, source),
        )


# ---------------------------------------------------------------------------------------------
# UNet

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCK = "UNetMidBlock2DCrossAttn"

# UNet keys that switch on machinery the SD 1.x forward pass does not have, with the only value
# it accepts and the feature's name for the message. Absent keys take diffusers' default, which
# is always the accepted value.
_UNET_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("center_input_sample", False, "input centering"),
    ("act_fn", "silu", "a non-SiLU activation"),
    ("mid_block_scale_factor", (1, 1.0), "a mid-block output scale"),
    ("encoder_hid_dim", None, "an encoder hidden-state projection (Kandinsky-style)"),
    ("encoder_hid_dim_type", None, "an encoder hidden-state projection (Kandinsky-style)"),
    ("dual_cross_attention", False, "dual cross-attention (Versatile Diffusion)"),
    ("class_embed_type", None, "class embeddings (SD upscaler / unCLIP)"),
    ("num_class_embeds", None, "class embeddings"),
    ("addition_time_embed_dim", None, "added time embeddings (SDXL)"),
    ("projection_class_embeddings_input_dim", None, "projected class embeddings (SDXL/unCLIP)"),
    ("class_embeddings_concat", False, "concatenated class embeddings"),
    ("resnet_time_scale_shift", "default", "scale-shift time conditioning"),
    ("resnet_skip_time_act", False, "skip-time-activation resnets"),
    ("resnet_out_scale_factor", (1.0, 1), "scaled resnet outputs"),
    ("time_embedding_type", "positional", "non-sinusoidal time embeddings"),
    ("time_embedding_dim", None, "a custom time-embedding width"),
    ("time_embedding_act_fn", None, "an extra time-embedding activation"),
    ("timestep_post_act", None, "a post-activation on the time embedding"),
    ("time_cond_proj_dim", None, "guidance-embedding conditioning (LCM)"),
    ("conv_in_kernel", 3, "a non-3x3 input convolution"),
    ("conv_out_kernel", 3, "a non-3x3 output convolution"),
    ("attention_type", "default", "gated/GLIGEN attention"),
    ("cross_attention_norm", None, "normalized cross-attention inputs"),
    ("reverse_transformer_layers_per_block", None, "an asymmetric transformer depth"),
    ("mid_block_only_cross_attention", (None, False), "a cross-attention-only mid block"),
)


@dataclass(frozen=True)
class UNetConfig:
    """diffusers' UNet2DConditionModel config, resolved to one value per down block.

    Per-block tuples are indexed by down block (0 = highest resolution); up block i uses entry
    ``n_blocks - 1 - i``, as diffusers reverses them.
    """

    in_channels: int
    out_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: tuple[int, ...]  # resnets per down block; up blocks have one more
    down_block_types: tuple[str, ...]
    up_block_types: tuple[str, ...]
    mid_block_type: str
    cross_attention_dim: int
    # Heads per block. SD 1.x configs say attention_head_dim: 8 and leave num_attention_heads
    # null; diffusers then uses attention_head_dim AS THE NUMBER OF HEADS (a historical
    # misnomer), so SD 1.4 has 8 heads of 40/80/160 channels. This tuple is that resolved count.
    num_attention_heads: tuple[int, ...]
    norm_num_groups: int
    norm_eps: float  # resnets and conv_norm_out; the transformers' GroupNorm is always 1e-6
    use_linear_projection: bool  # proj_in/proj_out are Linear (SD 2.x) rather than 1x1 convs
    transformer_layers_per_block: tuple[int, ...]
    flip_sin_to_cos: bool
    freq_shift: int
    sample_size: int | tuple[int, int]
    downsample_padding: int
    upcast_attention: bool  # compute attention scores in fp32 (SD 2.1); a no-op in fp32
    only_cross_attention: tuple[bool, ...]  # always all False: True is refused

    @property
    def time_embed_dim(self) -> int:
        return 4 * self.block_out_channels[0]

    @property
    def n_blocks(self) -> int:
        return len(self.block_out_channels)

    def head_dim(self, block: int) -> int:
        return self.block_out_channels[block] // self.num_attention_heads[block]

    @classmethod
    def from_dict(cls, d: dict, source: Path) -> UNetConfig:
        _check_kind(d, source, "_class_name", "UNet2DConditionModel", "expected UNet2DConditionModel")
        if d.get("addition_embed_type") == "text_time":
            raise _unsupported(source, "addition_embed_type", "text_time", "SDXL")
        _refuse_unless(d, source, "addition_embed_type", None, "added embeddings")
        for key, allowed, what in _UNET_REFUSED:
            _refuse_unless(d, source, key, allowed, what)
        if d.get("num_attention_heads") is not None:
            # diffusers itself raises on this key (its naming issue #2011); mirror it rather
            # than guess which meaning the author intended.
            raise ModelError(
                f"{source}: num_attention_heads={d['num_attention_heads']!r} is set; diffusers "
                "refuses this key for UNet2DConditionModel. Put the head count in "
                "attention_head_dim (which diffusers reads as the number of heads) and set "
                "num_attention_heads to null"
            )

        down = _str_tuple(d, "down_block_types", list(SD14_UNET["down_block_types"]), source)
        up = _str_tuple(d, "up_block_types", list(SD14_UNET["up_block_types"]), source)
        for key, types, allowed in (
            ("down_block_types", down, DOWN_BLOCKS),
            ("up_block_types", up, UP_BLOCKS),
        ):
            for t in types:
                if t not in allowed:
                    raise UnsupportedModelError(
                        f"{source}: {key} contains {t!r}; the engine implements "
                        f"{' and '.join(allowed)}; {SUPPORTED}"
                    )
        mid = d.get("mid_block_type", MID_BLOCK)
        if mid != MID_BLOCK:
            raise UnsupportedModelError(
                f"{source}: mid_block_type={mid!r}; the engine implements {MID_BLOCK}; {SUPPORTED}"
            )
        channels = _int_tuple(d, "block_out_channels", [320, 640, 1280, 1280], source)
        n = len(channels)
        if len(down) != n or len(up) != n:
            raise ModelError(
                f"{source}: {len(down)} down_block_types, {len(up)} up_block_types and "
                f"{len(channels)} block_out_channels; all three need one entry per block"
            )
        in_channels = _int(d, "in_channels", 4, source)
        if in_channels == 9:
            raise _unsupported(source, "in_channels", 9, "an SD inpainting UNet")

        cross = d.get("cross_attention_dim", 1280)
        if isinstance(cross, bool) or not isinstance(cross, int) or cross <= 0:
            raise UnsupportedModelError(
                f"{source}: cross_attention_dim={cross!r}; expected one positive integer "
                f"(per-block values are not SD 1.x); {SUPPORTED}"
            )

        heads = _per_block(d, "attention_head_dim", 8, n, source)
        for i, (c, h) in enumerate(zip(channels, heads, strict=True)):
            if c % h:
                raise ModelError(
                    f"{source}: block {i} has {c} channels, not divisible by its {h} attention "
                    "heads (attention_head_dim, which diffusers reads as the head count)"
                )

        tlayers = d.get("transformer_layers_per_block", 1)
        if isinstance(tlayers, list | tuple) and any(isinstance(x, list | tuple) for x in tlayers):
            raise UnsupportedModelError(
                f"{source}: transformer_layers_per_block={tlayers!r} varies inside a block "
                f"(SDXL refiner style); {SUPPORTED}"
            )

        only_cross = d.get("only_cross_attention", False)
        only_cross_t = (only_cross,) * n if isinstance(only_cross, bool) else tuple(only_cross)
        if len(only_cross_t) != n or not all(isinstance(x, bool) for x in only_cross_t):
            raise _bad(source, "only_cross_attention", only_cross, f"a bool or {n} bools")
        if any(only_cross_t):
            raise UnsupportedModelError(
                f"{source}: only_cross_attention={only_cross!r} replaces self-attention by "
                f"cross-attention, which this engine does not implement; {SUPPORTED}"
            )

        groups_v = d.get("norm_num_groups", 32)
        if groups_v is None:
            raise UnsupportedModelError(
                f"{source}: norm_num_groups=null removes the output GroupNorm; {SUPPORTED}"
            )
        groups = _int(d, "norm_num_groups", 32, source)
        _check_groups(source, groups, channels, "block_out_channels")

        return cls(
            in_channels=in_channels,
            out_channels=_int(d, "out_channels", 4, source),
            block_out_channels=channels,
            layers_per_block=_per_block(d, "layers_per_block", 2, n, source),
            down_block_types=down,
            up_block_types=up,
            mid_block_type=mid,
            cross_attention_dim=cross,
            num_attention_heads=heads,
            norm_num_groups=groups,
            norm_eps=_float(d, "norm_eps", 1e-5, source),
            use_linear_projection=_bool(d, "use_linear_projection", False, source),
            transformer_layers_per_block=_per_block(
                d, "transformer_layers_per_block", 1, n, source
            ),
            flip_sin_to_cos=_bool(d, "flip_sin_to_cos", True, source),
            freq_shift=_int(d, "freq_shift", 0, source, minimum=0),
            sample_size=_sample_size(d, "sample_size", 64, source),
            downsample_padding=_int(d, "downsample_padding", 1, source, minimum=0),
            upcast_attention=_bool(d, "upcast_attention", False, source),
            only_cross_attention=only_cross_t,
        )


# ---------------------------------------------------------------------------------------------
# VAE


@dataclass(frozen=True)
class VAEConfig:
    """diffusers' AutoencoderKL config. Every VAE GroupNorm uses eps 1e-6 (fixed in diffusers)."""

    in_channels: int
    out_channels: int
    latent_channels: int
    block_out_channels: tuple[int, ...]
    layers_per_block: int  # resnets per encoder block; decoder blocks have one more
    norm_num_groups: int
    scaling_factor: float  # latents = scaling_factor * encoder sample; decode(z / scaling_factor)
    down_block_types: tuple[str, ...]
    up_block_types: tuple[str, ...]
    sample_size: int | tuple[int, int]
    force_upcast: bool  # diffusers runs this VAE in fp32 even in an fp16 pipeline
    mid_block_add_attention: bool
    use_quant_conv: bool
    use_post_quant_conv: bool

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along each axis (8 for SD 1.x)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_dict(cls, d: dict, source: Path) -> VAEConfig:
        _check_kind(d, source, "_class_name", "AutoencoderKL", "expected AutoencoderKL")
        _refuse_unless(d, source, "act_fn", "silu", "a non-SiLU activation")
        _refuse_unless(d, source, "shift_factor", None, "a latent shift (SD3/Flux VAEs)")
        _refuse_unless(d, source, "latents_mean", None, "per-channel latent statistics")
        _refuse_unless(d, source, "latents_std", None, "per-channel latent statistics")
        # Defaults are AutoencoderKL.__init__'s: SD 1.4's file relies on them for
        # norm_num_groups and scaling_factor.
        channels = _int_tuple(d, "block_out_channels", [64], source)
        down = _str_tuple(d, "down_block_types", ["DownEncoderBlock2D"], source)
        up = _str_tuple(d, "up_block_types", ["UpDecoderBlock2D"], source)
        for key, types, allowed in (
            ("down_block_types", down, "DownEncoderBlock2D"),
            ("up_block_types", up, "UpDecoderBlock2D"),
        ):
            if any(t != allowed for t in types):
                raise UnsupportedModelError(
                    f"{source}: {key}={list(types)!r}; the engine implements only {allowed}; "
                    f"{SUPPORTED}"
                )
        if len(down) != len(channels) or len(up) != len(channels):
            raise ModelError(
                f"{source}: {len(down)} down_block_types, {len(up)} up_block_types and "
                f"{len(channels)} block_out_channels; all three need one entry per block"
            )
        groups = _int(d, "norm_num_groups", 32, source)
        _check_groups(source, groups, channels, "block_out_channels")
        return cls(
            in_channels=_int(d, "in_channels", 3, source),
            out_channels=_int(d, "out_channels", 3, source),
            latent_channels=_int(d, "latent_channels", 4, source),
            block_out_channels=channels,
            layers_per_block=_int(d, "layers_per_block", 1, source),
            norm_num_groups=groups,
            scaling_factor=_float(d, "scaling_factor", 0.18215, source),
            down_block_types=down,
            up_block_types=up,
            sample_size=_sample_size(d, "sample_size", 32, source),
            force_upcast=_bool(d, "force_upcast", True, source),
            mid_block_add_attention=_bool(d, "mid_block_add_attention", True, source),
            use_quant_conv=_bool(d, "use_quant_conv", True, source),
            use_post_quant_conv=_bool(d, "use_post_quant_conv", True, source),
        )


# ---------------------------------------------------------------------------------------------
# scheduler and the whole model


def check_scheduler_config(d: dict, source: Path) -> dict:
    """Refuse scheduler configs whose prediction target the SD 1.x pipeline cannot use."""
    if not isinstance(d, dict):
        raise ModelError(f"{source}: expected a JSON object, got {type(d).__name__}")
    pred = d.get("prediction_type", "epsilon")
    if pred == "v_prediction":
        raise _unsupported(source, "prediction_type", pred, "SD 2.x v-prediction")
    if pred != "epsilon":
        raise UnsupportedModelError(
            f"{source}: prediction_type={pred!r}; only 'epsilon' (noise prediction) is "
            f"supported; {SUPPORTED}"
        )
    return d


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a model before touching its weights."""

    source: Path  # the model directory, or the single-file checkpoint it came from
    text_encoder: CLIPTextConfig
    unet: UNetConfig
    vae: VAEConfig
    scheduler: MappingProxyType  # scheduler_config.json as read (read-only view)
    # tokenizer/ folder; None for a single-file checkpoint, which carries no vocabulary
    tokenizer_dir: Path | None
    pipeline_class: str = "StableDiffusionPipeline"

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.vae_scale_factor

    @property
    def native_size(self) -> tuple[int, int]:
        """(height, width) in pixels the UNet was configured for."""
        s = self.unet.sample_size
        h, w = (s, s) if isinstance(s, int) else s
        return h * self.vae_scale_factor, w * self.vae_scale_factor

    def check_consistency(self) -> ModelConfig:
        """Cross-component shape agreements the forward pass relies on."""
        te, unet, vae = self.text_encoder, self.unet, self.vae
        if unet.cross_attention_dim != te.hidden_size:
            raise ModelError(
                f"{self.source}: unet cross_attention_dim={unet.cross_attention_dim} but the "
                f"text encoder hidden_size={te.hidden_size}; they must be equal"
            )
        if unet.in_channels != vae.latent_channels or unet.out_channels != vae.latent_channels:
            raise ModelError(
                f"{self.source}: unet in/out_channels={unet.in_channels}/{unet.out_channels} "
                f"but vae latent_channels={vae.latent_channels}; they must be equal"
            )
        return self


def read_json(path: Path) -> Any:
    """Read a JSON file, turning absence and corruption into a ModelError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelError(f"{path}: file not found (a diffusers-layout model needs it)") from None
    except OSError as e:
        raise ModelError(f"{path}: cannot read: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from None


_EXPECTED_COMPONENTS = {
    "unet": ("diffusers", "UNet2DConditionModel"),
    "vae": ("diffusers", "AutoencoderKL"),
    "text_encoder": ("transformers", "CLIPTextModel"),
    "tokenizer": ("transformers", "CLIPTokenizer"),
}


def _check_model_index(index: Any, source: Path) -> str:
    if not isinstance(index, dict):
        raise ModelError(f"{source}: expected a JSON object, got {type(index).__name__}")
    pipeline = index.get("_class_name", "")
    if "text_encoder_2" in index or "tokenizer_2" in index:
        raise _unsupported(source, "text_encoder_2", index.get("text_encoder_2"), "SDXL")
    if "XL" in str(pipeline):
        raise _unsupported(source, "_class_name", pipeline, "SDXL")
    if not str(pipeline).startswith("StableDiffusion"):
        raise UnsupportedModelError(
            f"{source}: _class_name={pipeline!r} is not a Stable Diffusion pipeline; {SUPPORTED}"
        )
    for comp, (lib, cls) in _EXPECTED_COMPONENTS.items():
        entry = index.get(comp)
        if entry is None:
            raise ModelError(f"{source}: no {comp!r} entry; an SD 1.x model needs {lib}.{cls}")
        if not (isinstance(entry, list) and len(entry) == 2):
            raise _bad(source, comp, entry, f'["{lib}", "{cls}"]')
        # tokenizer classes: the fast variant is the same tokenizer
        if entry[1] != cls and not (comp == "tokenizer" and entry[1] == "CLIPTokenizerFast"):
            raise UnsupportedModelError(
                f"{source}: {comp} is {entry[1]!r}; expected {cls}; {SUPPORTED}"
            )
    return str(pipeline)


def load_model_config(model_dir: Path | str) -> ModelConfig:
    """Read and validate every config of a diffusers-layout SD 1.x model directory."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory; expected a diffusers-layout model folder")
    index_path = model_dir / "model_index.json"
    pipeline = _check_model_index(read_json(index_path), index_path)

    te_path = model_dir / "text_encoder" / "config.json"
    unet_path = model_dir / "unet" / "config.json"
    vae_path = model_dir / "vae" / "config.json"
    sched_path = model_dir / "scheduler" / "scheduler_config.json"
    # UNet first: its config says SDXL/inpainting most plainly.
    unet = UNetConfig.from_dict(read_json(unet_path), unet_path)
    text_encoder = CLIPTextConfig.from_dict(read_json(te_path), te_path)
    vae = VAEConfig.from_dict(read_json(vae_path), vae_path)
    scheduler = check_scheduler_config(read_json(sched_path), sched_path)

    tokenizer_dir = model_dir / "tokenizer"
    if not tokenizer_dir.is_dir():
        raise ModelError(f"{tokenizer_dir}: missing; expected vocab.json and merges.txt there")
    return ModelConfig(
        source=model_dir,
        text_encoder=text_encoder,
        unet=unet,
        vae=vae,
        scheduler=MappingProxyType(dict(scheduler)),
        tokenizer_dir=tokenizer_dir,
        pipeline_class=pipeline,
    ).check_consistency()
