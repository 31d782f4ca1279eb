"""The CLIP text encoder (transformers' CLIPTextModel) as SD 1.x uses it: token and position
embeddings, pre-norm transformer layers with causal self-attention and QuickGELU MLPs, and
the final layer norm. Its output is the last hidden state, (B, 77, hidden)."""

from __future__ import annotations

from ..gpu import Tensor
from ..ops import Ops
from .common import GPUWeights

ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu"}


class CLIPTextEncoder:
    def __init__(self, cfg, weights: GPUWeights, ops: Ops):
        self.cfg = cfg
        self.w = weights
        self.ops = ops

    def __call__(self, ids: Tensor) -> Tensor:
        """ids (B, T) u32 -> (B, T, hidden)."""
        cfg, w, ops = self.cfg, self.w, self.ops
        p = "text_model."
        h = ops.embedding(
            ids,
            w[p + "embeddings.token_embedding.weight"],
            w[p + "embeddings.position_embedding.weight"],
        )  # (B, T, D)
        act = ACTIVATIONS[cfg.hidden_act]
        for i in range(cfg.num_hidden_layers):
            lp = f"{p}encoder.layers.{i}."
            x = ops.layer_norm(h, w[lp + "layer_norm1.weight"], w[lp + "layer_norm1.bias"], cfg.layer_norm_eps)
            q = ops.linear(x, w[lp + "self_attn.q_proj.weight"], w[lp + "self_attn.q_proj.bias"])
            k = ops.linear(x, w[lp + "self_attn.k_proj.weight"], w[lp + "self_attn.k_proj.bias"])
            v = ops.linear(x, w[lp + "self_attn.v_proj.weight"], w[lp + "self_attn.v_proj.bias"])
            a = ops.attention(q, k, v, cfg.num_attention_heads, causal=True)
            h = ops.linear(a, w[lp + "self_attn.out_proj.weight"], w[lp + "self_attn.out_proj.bias"], residual=h)
            x = ops.layer_norm(h, w[lp + "layer_norm2.weight"], w[lp + "layer_norm2.bias"], cfg.layer_norm_eps)
            x = ops.activation(ops.linear(x, w[lp + "mlp.fc1.weight"], w[lp + "mlp.fc1.bias"]), act)
            h = ops.linear(x, w[lp + "mlp.fc2.weight"], w[lp + "mlp.fc2.bias"], residual=h)
        return ops.layer_norm(
            h, w[p + "final_layer_norm.weight"], w[p + "final_layer_norm.bias"], cfg.layer_norm_eps
        )
