"""AutoencoderKL (SD 1.x VAE): the decoder turns latents into images, the encoder (img2img)
turns images into the mean and log-variance of the latent distribution.

Notation: B batch, C channels, (H, W) image size, (h, w) = (H, W) / 2^(levels-1).
"""

from __future__ import annotations

from ..gpu import Tensor
from ..ops import Ops
from .common import GPUWeights, attention_block, resnet_block

VAE_EPS = 1e-6


class AutoencoderKL:
    def __init__(self, cfg, weights: GPUWeights, ops: Ops):
        self.cfg = cfg
        self.w = weights
        self.ops = ops

    def _mid(self, p: str, x: Tensor) -> Tensor:
        ops, w, groups = self.ops, self.w, self.cfg.norm_num_groups
        x = resnet_block(ops, w, p + "resnets.0.", x, None, groups, VAE_EPS)
        if getattr(self.cfg, "mid_block_add_attention", True):
            b, c, hh, ww = x.shape
            a = p + "attentions.0."
            h = ops.group_norm(x, w[a + "group_norm.weight"], w[a + "group_norm.bias"], groups, VAE_EPS)
            h = ops.transpose(h.reshape(b, c, hh * ww))  # (B, T, C)
            h = attention_block(ops, w, a, h, None, heads=1)
            x = ops.add(ops.transpose(h).reshape(b, c, hh, ww), x)
        return resnet_block(ops, w, p + "resnets.1.", x, None, groups, VAE_EPS)

    def decode(self, z: Tensor) -> Tensor:
        """z (B, latent, h, w), already divided by the scaling factor -> image (B, 3, H, W)."""
        cfg, ops, w = self.cfg, self.ops, self.w
        if getattr(cfg, "use_post_quant_conv", True):
            z = ops.conv2d(z, w["post_quant_conv.weight"], w["post_quant_conv.bias"])
        x = ops.conv2d(z, w["decoder.conv_in.weight"], w["decoder.conv_in.bias"], padding=1)
        x = self._mid("decoder.mid_block.", x)
        n = len(cfg.block_out_channels)
        for i in range(n):
            for layer in range(cfg.layers_per_block + 1):
                x = resnet_block(ops, w, f"decoder.up_blocks.{i}.resnets.{layer}.", x, None, cfg.norm_num_groups, VAE_EPS)
            if i < n - 1:
                x = ops.upsample_nearest(x, (2 * x.shape[2], 2 * x.shape[3]))
                p = f"decoder.up_blocks.{i}.upsamplers.0.conv."
                x = ops.conv2d(x, w[p + "weight"], w[p + "bias"], padding=1)
        x = ops.group_norm(
            x, w["decoder.conv_norm_out.weight"], w["decoder.conv_norm_out.bias"], cfg.norm_num_groups, VAE_EPS, silu=True
        )
        return ops.conv2d(x, w["decoder.conv_out.weight"], w["decoder.conv_out.bias"], padding=1)

    def encode(self, image: Tensor) -> Tensor:
        """image (B, 3, H, W) in [-1, 1] -> moments (B, 2*latent, h, w): mean, then log-variance."""
        cfg, ops, w = self.cfg, self.ops, self.w
        x = ops.conv2d(image, w["encoder.conv_in.weight"], w["encoder.conv_in.bias"], padding=1)
        n = len(cfg.block_out_channels)
        for i in range(n):
            for layer in range(cfg.layers_per_block):
                x = resnet_block(ops, w, f"encoder.down_blocks.{i}.resnets.{layer}.", x, None, cfg.norm_num_groups, VAE_EPS)
            if i < n - 1:
                # The encoder's Downsample2D pads (left 0, right 1, top 0, bottom 1), then
                # convolves with stride 2 and no padding.
                p = f"encoder.down_blocks.{i}.downsamplers.0.conv."
                x = ops.conv2d(x, w[p + "weight"], w[p + "bias"], stride=2, padding=(0, 1, 0, 1))
        x = self._mid("encoder.mid_block.", x)
        x = ops.group_norm(
            x, w["encoder.conv_norm_out.weight"], w["encoder.conv_norm_out.bias"], cfg.norm_num_groups, VAE_EPS, silu=True
        )
        x = ops.conv2d(x, w["encoder.conv_out.weight"], w["encoder.conv_out.bias"], padding=1)
        if getattr(cfg, "use_quant_conv", True):
            x = ops.conv2d(x, w["quant_conv.weight"], w["quant_conv.bias"])
        return x
