"""Optimized group normalisation: the single-dispatch "fused" variant (statistics, normalise,
affine and optional SiLU in one workgroup per (batch, group), no intermediate tensor), after
"Speed Is All You Need" (Chen et al., 2023)."""

from __future__ import annotations

import math

from ..kernels import Variant, register
from ..runtime import Tensor


@register(
    "group_norm",
    "fused",
    doc="one dispatch, one workgroup per (batch, group): shifted-sum/Chan statistics, then apply",
)
def group_norm_fused(ops, v: Variant, consts: dict, x, gamma, beta, groups, eps, silu) -> Tensor:
    bsz, c = x.shape[:2]
    s = x.numel // (bsz * c)
    y = ops.rt.empty(x.shape, ops.dtype)
    n_groups = bsz * groups
    gx = min(n_groups, ops.rt.caps.max_workgroups)
    ops.rt.dispatch(
        ops.pipeline(v, **consts),
        "group_norm",
        (bsz, c, s, groups, float(eps), int(silu)),
        [x, gamma, beta, y],
        (gx, math.ceil(n_groups / gx), 1),
    )
    return y
