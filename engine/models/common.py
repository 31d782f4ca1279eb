"""What the three networks share: GPU weights keyed by diffusers' parameter names, and the
blocks that appear in more than one of them (ResNet block, attention on the token layout)."""

from __future__ import annotations

import numpy as np

from ..gpu import GpuContext, Tensor
from ..ops import Ops


class GPUWeights:
    """A component's parameters on the GPU, by state-dict name (the weights of the blueprint).

    Normally uploaded once, at construction. A pipeline that stages its weights builds an
    empty one (`state=None`) and moves parameters on and off the GPU with `load`/`release`
    around each use; the models look names up at call time, so they see whichever are
    loaded."""

    def __init__(self, rt: GpuContext, state: dict[str, np.ndarray] | None, dtype: str):
        self.dtype = dtype
        self.tensors: dict[str, Tensor] = {}
        if state is not None:
            self.load(rt, state)

    def load(self, rt: GpuContext, state: dict[str, np.ndarray]) -> None:
        """Upload the parameters of `state` that are not on the GPU yet."""
        self.tensors.update(rt.upload_weights({n: a for n, a in state.items() if n not in self.tensors}, self.dtype))

    def release(self, rt: GpuContext, names=None) -> None:
        """Free the GPU copies of `names` (default: all) now."""
        names = list(self.tensors) if names is None else [n for n in names if n in self.tensors]
        rt.release_weights([self.tensors.pop(n) for n in names])

    @classmethod
    def of_tensors(cls, tensors: dict[str, Tensor], dtype: str) -> GPUWeights:
        w = cls.__new__(cls)
        w.dtype, w.tensors = dtype, dict(tensors)
        return w

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def get(self, name: str) -> Tensor | None:
        return self.tensors.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def resnet_block(
    ops: Ops, w: GPUWeights, p: str, x: Tensor, temb: Tensor | None, groups: int, eps: float
) -> Tensor:
    """diffusers ResnetBlock2D (default time-embedding mode, output scale 1)."""
    h = ops.group_norm(x, w[p + "norm1.weight"], w[p + "norm1.bias"], groups, eps, silu=True)
    h = ops.conv2d(h, w[p + "conv1.weight"], w[p + "conv1.bias"], padding=1)
    if temb is not None:  # temb is already SiLU'd; one value per (batch, channel)
        h = ops.add(h, ops.linear(temb, w[p + "time_emb_proj.weight"], w[p + "time_emb_proj.bias"]))
    h = ops.group_norm(h, w[p + "norm2.weight"], w[p + "norm2.bias"], groups, eps, silu=True)
    # The sum in the epilogue of the block's last convolution, where its variant has one
    # (Ops.conv2d): conv2's with the input as the shortcut, else the 1x1 shortcut convolution's
    # with conv2's output, so that no tensor more is alive during conv2 than unfused (the
    # shortcut computed first would be, beside Winograd's scratch at the VAE's 512x512 level),
    # and, where the variant adds by a kernel after it, conv2's input is let go before that add
    # (last_use), as the unfused block let it go.
    if p + "conv_shortcut.weight" not in w:
        return ops.conv2d(h, w[p + "conv2.weight"], w[p + "conv2.bias"], padding=1, residual=x, last_use=True)
    h = ops.conv2d(h, w[p + "conv2.weight"], w[p + "conv2.bias"], padding=1)
    return ops.conv2d(x, w[p + "conv_shortcut.weight"], w.get(p + "conv_shortcut.bias"), residual=h)


def attention_block(
    ops: Ops, w: GPUWeights, p: str, x: Tensor, context: Tensor | None, heads: int, residual: Tensor | None = None,
    kv: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """diffusers Attention on tokens: x (B, T, C), context (B, Tk, Cctx) or None (self), plus
    `residual` when given (added in the output projection's epilogue where it can be). `kv`:
    the keys and values already projected (key_value's of the same context), instead of
    `context`."""
    q = ops.linear(x, w[p + "to_q.weight"], w.get(p + "to_q.bias"))
    k, v = kv if kv is not None else key_value(ops, w, p, x if context is None else context)
    a = ops.attention(q, k, v, heads)
    return ops.linear(a, w[p + "to_out.0.weight"], w.get(p + "to_out.0.bias"), residual=residual)


def key_value(ops: Ops, w: GPUWeights, p: str, context: Tensor) -> tuple[Tensor, Tensor]:
    """An attention's keys and values of `context` (B, Tk, Cctx) -> two (B, Tk, C)."""
    k = ops.linear(context, w[p + "to_k.weight"], w.get(p + "to_k.bias"))
    v = ops.linear(context, w[p + "to_v.weight"], w.get(p + "to_v.bias"))
    return k, v
