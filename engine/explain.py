"""Which kernel variant runs where, and why: the models are run on a shape-only GPU context (no
weights, no GPU work), so every (op, shape) of a model is known in milliseconds, even for SD
1.4 on a CPU adapter. `explain` reports the selection's decisions; `trace_calls` gives the
tuner one example call of each distinct (op, shape)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .gpu import Tensor, TraceContext
from .kernels import Selection, decision_key
from .models import params
from .models.clip import CLIPTextEncoder
from .models.common import GPUWeights
from .models.unet import UNet2DCondition
from .models.vae import AutoencoderKL
from .ops import Ops


@dataclass
class ExplainRow:
    network: str
    op: str
    shape: dict
    variant: str
    calls: int
    why: str


def _shape_weights(rt: TraceContext, shapes: dict[str, tuple], dtype: str) -> GPUWeights:
    return GPUWeights.of_tensors({k: rt.empty(s, dtype) for k, s in shapes.items()}, dtype)


NETWORKS = ("text_encoder", "unet", "vae_decoder")  # what trace_calls runs, in order


def trace_calls(config, selection: Selection, caps, dtype: str, height: int, width: int, batch: int = 2,
                vae_dtype: str | None = None, networks: set[str] | None = None):
    """Run text encoder, UNet (batch `batch`) and VAE decoder (or those of them in `networks`) on
    shapes alone, each on Ops with the scratch bounds a pipeline gives it, the VAE in `vae_dtype`
    (default: the native pipeline's rule). Returns [(network, [(op, shape, args), ...])]."""
    f = config.vae.vae_scale_factor
    h, w = height // f, width // f
    from .pipeline import _vae_dtype, scratch_scale

    rt = TraceContext(caps)
    out = []
    for network in (n for n in NETWORKS if not networks or n in networks):
        # the VAE in the element type the native pipeline runs it in (f32 for a force_upcast VAE
        # in f16-storage)
        net_dtype = (vae_dtype or _vae_dtype(config, dtype, decodes_again=True)) if network == "vae_decoder" else dtype
        ops = Ops(rt, None, selection, net_dtype, scratch_scale=scratch_scale(network))
        ops.calls = []
        if network == "text_encoder":
            cfg = config.text_encoder
            CLIPTextEncoder(cfg, _shape_weights(rt, params.clip_param_shapes(cfg), dtype), ops)(rt.empty((batch, 77), "u32"))
        elif network == "unet":
            cfg = config.unet
            UNet2DCondition(cfg, _shape_weights(rt, params.unet_param_shapes(cfg), dtype), ops)(
                rt.empty((batch, cfg.in_channels, h, w), dtype),
                rt.empty((batch, cfg.block_out_channels[0]), dtype),
                rt.empty((batch, 77, cfg.cross_attention_dim), dtype),
            )
        else:
            cfg = config.vae
            AutoencoderKL(cfg, _shape_weights(rt, params.vae_param_shapes(cfg), net_dtype), ops).decode(
                rt.empty((1, cfg.latent_channels, h, w), net_dtype)
            )
        out.append((network, ops.calls))
    return out


def call_dtype(args: tuple, dtype: str) -> str:
    """A call's own element type (its first float tensor's): a VAE in f32 in a pipeline of halves."""
    return next((a.dtype for a in args if isinstance(a, Tensor) and a.dtype != "u32"), dtype)


def explain(config, selection: Selection, caps, dtype: str, height: int, width: int) -> list[ExplainRow]:
    rows = []
    for network, calls in trace_calls(config, selection, caps, dtype, height, width):
        counts = Counter(decision_key(op, shape, call_dtype(args, dtype)) for op, shape, args, _ in calls)
        for key, n in counts.items():
            d = selection.decisions[key]
            rows.append(ExplainRow(network, d.op, d.shape, d.variant, n, d.why))
    return rows


def distinct_calls(config, caps, dtype: str, height: int, width: int, networks: set[str] | None = None,
                   vae_dtype: str | None = None) -> list[tuple[str, dict, tuple, int, dict]]:
    """One example (op, shape, args, scratch scale, epilogue) per distinct (op, shape) of the
    whole model (or of `networks` among text_encoder, unet and vae_decoder; the VAE in
    `vae_dtype`, default the pipeline's rule): the scale is the Ops scratch_scale of the network the call is from, which
    decides how a Winograd or im2col convolution is chunked (so the tuner times the chunks a
    pipeline runs); the epilogue what the product's caller has done after it (Ops.calls)."""
    from .pipeline import scratch_scale

    seen = {}
    for network, calls in trace_calls(config, Selection(frozenset(caps.features)), caps, dtype, height, width,
                                      vae_dtype=vae_dtype, networks=networks):
        for op, shape, args, epilogue in calls:
            seen.setdefault((op, tuple(sorted(shape.items()))), (op, shape, args, scratch_scale(network), epilogue))
    return list(seen.values())


def random_like(rt, args: tuple, rng: np.random.Generator) -> tuple:
    """Real GPU tensors of the traced argument shapes (fresh random values), scalars kept."""
    real = []
    for a in args:
        if isinstance(a, Tensor):
            if a.dtype == "u32":
                real.append(rt.upload(rng.integers(0, 100, a.shape).astype(np.uint32), "u32"))
            else:
                scale = 1.0 / np.sqrt(max(a.shape[-1], 1))
                real.append(rt.upload((rng.standard_normal(a.shape) * scale).astype(np.float32), a.dtype))
        else:
            real.append(a)
    return tuple(real)
