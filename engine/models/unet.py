"""UNet2DConditionModel for SD 1.x, built from its config: time embedding, the down path
(ResNet blocks, cross-attention transformers, strided-conv downsamplers), the mid block, the
up path with skip concatenation and nearest upsampling, and the output head.

Notation: B batch, C channels, (H, W) latent size, T = H*W tokens, Tc text tokens.
"""

from __future__ import annotations

import math

import numpy as np

from ..gpu import Tensor
from ..ops import Ops, Prepared
from .common import GPUWeights, attention_block, key_value, resnet_block

TRANSFORMER_NORM_EPS = 1e-6  # Transformer2DModel's GroupNorm; the ResNets use cfg.norm_eps
BLOCK_LN_EPS = 1e-5  # BasicTransformerBlock's LayerNorms


def timestep_embedding(t: np.ndarray, dim: int, flip_sin_to_cos: bool, shift: float) -> np.ndarray:
    """Sinusoidal embedding of timesteps t (B,) -> (B, dim) float32, as diffusers computes it.

    On the host, in float32 like the reference: t reaches 999, where a GPU's fast sin() of
    a large argument is not accurate enough for a 1e-4 comparison.
    """
    half = dim // 2
    exponent = (-math.log(10000.0) * np.arange(half, dtype=np.float32) / np.float32(half - shift)).astype(
        np.float32
    )
    freqs = np.exp(exponent).astype(np.float32)
    args = t.astype(np.float32)[:, None] * freqs[None, :]  # (B, half)
    emb = np.concatenate([np.sin(args), np.cos(args)], axis=-1).astype(np.float32)
    if flip_sin_to_cos:
        emb = np.concatenate([emb[:, half:], emb[:, :half]], axis=-1)
    if dim % 2:
        emb = np.pad(emb, ((0, 0), (0, 1)))
    return emb


def is_context_projection(name: str) -> bool:
    """Whether a UNet parameter projects the text context to a cross-attention's keys or values
    (what UNet2DCondition.context_kv reads, and a denoising step does not)."""
    return ".attn2.to_k." in name or ".attn2.to_v." in name


class ContextKV(dict):
    """Every cross-attention's keys and values of one text context, by the attention's parameter
    prefix: (k, v), each (B, Tc, C). The context is the same at every denoising step, so a
    generation projects it once (UNet2DCondition.context_kv) instead of once a step (SD 1.4: 32
    products of 154 rows, about 1.1 ms of a 48 ms step on an H100).

    `prepared`: what the generation's steps derive from the weights once (Ops.prepare: the
    transformed filters of convolutions a profile runs as winograd_2x2 with PRETRANSFORM)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prepared: Prepared | None = Prepared()  # None: nothing kept (a staged pipeline's)


class UNet2DCondition:
    def __init__(self, cfg, weights: GPUWeights, ops: Ops):
        self.cfg = cfg
        self.w = weights
        self.ops = ops

    def _transformers(self):
        """(parameter prefix, layers) of each Transformer2DModel, in the order a step runs them."""
        cfg = self.cfg
        for i, kind in enumerate(cfg.down_block_types):
            if kind.startswith("CrossAttn"):
                for layer in range(cfg.layers_per_block[i]):
                    yield f"down_blocks.{i}.attentions.{layer}.", cfg.transformer_layers_per_block[i]
        yield "mid_block.attentions.0.", cfg.transformer_layers_per_block[-1]
        layers_up = list(reversed(cfg.transformer_layers_per_block))
        resnets_up = [n + 1 for n in reversed(cfg.layers_per_block)]
        for i, kind in enumerate(cfg.up_block_types):
            if kind.startswith("CrossAttn"):
                for layer in range(resnets_up[i]):
                    yield f"up_blocks.{i}.attentions.{layer}.", layers_up[i]

    def context_kv(self, ctx: Tensor) -> ContextKV:
        """The keys and values of every cross-attention for the text context ctx (B, Tc, Cctx)."""
        kv = ContextKV()
        for p, layers in self._transformers():
            for j in range(layers):
                a = f"{p}transformer_blocks.{j}.attn2."
                kv[a] = key_value(self.ops, self.w, a, ctx)
        return kv

    def _transformer(self, p: str, x: Tensor, kv: ContextKV, heads: int, layers: int) -> Tensor:
        """Transformer2DModel: x (B, C, H, W), the context's keys and values -> (B, C, H, W)."""
        ops, w = self.ops, self.w
        b, c, hh, ww = x.shape
        h = ops.group_norm(x, w[p + "norm.weight"], w[p + "norm.bias"], self.cfg.norm_num_groups, TRANSFORMER_NORM_EPS)
        h = ops.transpose(h.reshape(b, c, hh * ww))  # (B, T, C)
        # proj_in/out are 1x1 convolutions or linears; on the token layout both are a linear.
        h = ops.linear(h, w[p + "proj_in.weight"], w[p + "proj_in.bias"])
        for j in range(layers):
            bp = f"{p}transformer_blocks.{j}."
            n = ops.layer_norm(h, w[bp + "norm1.weight"], w[bp + "norm1.bias"], BLOCK_LN_EPS)
            h = attention_block(ops, w, bp + "attn1.", n, None, heads, residual=h)
            n = ops.layer_norm(h, w[bp + "norm2.weight"], w[bp + "norm2.bias"], BLOCK_LN_EPS)
            h = attention_block(ops, w, bp + "attn2.", n, None, heads, residual=h, kv=kv[bp + "attn2."])
            n = ops.layer_norm(h, w[bp + "norm3.weight"], w[bp + "norm3.bias"], BLOCK_LN_EPS)
            f = ops.linear_geglu(n, w[bp + "ff.net.0.proj.weight"], w[bp + "ff.net.0.proj.bias"])
            h = ops.linear(f, w[bp + "ff.net.2.weight"], w[bp + "ff.net.2.bias"], residual=h)
        return ops.linear_to_channels(h, w[p + "proj_out.weight"], w[p + "proj_out.bias"], x)  # (B, C, H, W)

    def __call__(self, sample: Tensor, temb_sin: Tensor, ctx: Tensor | ContextKV) -> Tensor:
        """sample (B, Cin, H, W), temb_sin (B, C0) sinusoidal embedding, ctx (B, Tc, Cctx) or its
        context_kv (what a denoising loop passes: projected once for all its steps)."""
        kv = ctx if isinstance(ctx, ContextKV) else self.context_kv(ctx)
        with self.ops.preparing(kv.prepared):
            return self._forward(sample, temb_sin, kv)

    def _forward(self, sample: Tensor, temb_sin: Tensor, kv: ContextKV) -> Tensor:
        cfg, ops, w = self.cfg, self.ops, self.w
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        n_blocks = len(cfg.block_out_channels)

        # 1. time embedding, SiLU'd once for every ResNet's projection
        temb = ops.linear(temb_sin, w["time_embedding.linear_1.weight"], w["time_embedding.linear_1.bias"])
        temb = ops.linear(ops.silu(temb), w["time_embedding.linear_2.weight"], w["time_embedding.linear_2.bias"])
        temb = ops.silu(temb)  # (B, 4*C0)

        # 2. down path, keeping every block output for the skips
        x = ops.conv2d(sample, w["conv_in.weight"], w["conv_in.bias"], padding=1)
        skips = [x]
        for i, kind in enumerate(cfg.down_block_types):
            for layer in range(cfg.layers_per_block[i]):
                x = resnet_block(ops, w, f"down_blocks.{i}.resnets.{layer}.", x, temb, groups, eps)
                if kind.startswith("CrossAttn"):
                    x = self._transformer(
                        f"down_blocks.{i}.attentions.{layer}.", x, kv,
                        cfg.num_attention_heads[i], cfg.transformer_layers_per_block[i],
                    )
                skips.append(x)
            if i < n_blocks - 1:
                p = f"down_blocks.{i}.downsamplers.0.conv."
                x = ops.conv2d(x, w[p + "weight"], w[p + "bias"], stride=2, padding=cfg.downsample_padding)
                skips.append(x)

        # 3. mid block
        x = resnet_block(ops, w, "mid_block.resnets.0.", x, temb, groups, eps)
        x = self._transformer(
            "mid_block.attentions.0.", x, kv, cfg.num_attention_heads[-1], cfg.transformer_layers_per_block[-1]
        )
        x = resnet_block(ops, w, "mid_block.resnets.1.", x, temb, groups, eps)

        # 4. up path: concatenate skips, upsample to the next skip's size (odd sizes included)
        heads_up = list(reversed(cfg.num_attention_heads))
        layers_up = list(reversed(cfg.transformer_layers_per_block))
        resnets_up = [n + 1 for n in reversed(cfg.layers_per_block)]
        for i, kind in enumerate(cfg.up_block_types):
            for layer in range(resnets_up[i]):
                x = ops.concat_channels(x, skips.pop())
                x = resnet_block(ops, w, f"up_blocks.{i}.resnets.{layer}.", x, temb, groups, eps)
                if kind.startswith("CrossAttn"):
                    x = self._transformer(f"up_blocks.{i}.attentions.{layer}.", x, kv, heads_up[i], layers_up[i])
            if i < n_blocks - 1:
                x = ops.upsample_nearest(x, skips[-1].shape[2:])
                p = f"up_blocks.{i}.upsamplers.0.conv."
                x = ops.conv2d(x, w[p + "weight"], w[p + "bias"], padding=1)

        # 5. output head
        x = ops.group_norm(x, w["conv_norm_out.weight"], w["conv_norm_out.bias"], groups, eps, silu=True)
        return ops.conv2d(x, w["conv_out.weight"], w["conv_out.bias"], padding=1)
