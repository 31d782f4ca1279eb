"""Optimized group normalisation: the single-dispatch "fused" variant (statistics, normalise,
affine and optional SiLU in one workgroup per (batch, group), no intermediate tensor), after
"Speed Is All You Need" (Chen et al., 2023), the "split" variant for groups too large for
one workgroup (statistics of CHUNK-element runs in workgroups of their own, merged per group,
then the reference's element-wise apply), and "split4", split with every access four elements
wide (vec4 loads and stores) where H*W is divisible by 4."""

from __future__ import annotations

import math

from ..gpu import Tensor
from ..kernels import Variant, register, variants


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


SPLIT_CHUNKS = (1024, 2048, 4096, 8192, 16384)


def _split_passes(ops, v: Variant, consts: dict, x, gamma, beta, groups, eps, silu, width: int) -> Tensor:
    """split's (width 1) or split4's (width 4) three dispatches: each CHUNK-element run's
    statistics, their merge per group, the apply (the reference's two elements an invocation, or
    split4's own four)."""
    bsz, c = x.shape[:2]
    s = x.numel // (bsz * c)
    chunk = int(consts.get("CHUNK", 4096))
    n_groups = bsz * groups
    n_chunks = -(-(c // groups * s) // chunk)
    params = (bsz, c, s, groups, float(eps), int(silu))
    part = ops.rt.empty((n_groups, n_chunks, 3), "f32")
    stats = ops.rt.empty((n_groups, 2), "f32")
    ops.rt.dispatch(ops.pipeline(v, "partial_main", CHUNK=chunk), "group_norm", params, [x, part],
                    (n_chunks, n_groups, 1))
    merge = variants("group_norm")["split"]  # split4's partial runs are split's: one merge for both
    ops.rt.dispatch(ops.pipeline(merge, "finalize_main", CHUNK=chunk), "group_norm", params, [None, part, stats],
                    (math.ceil(n_groups / 64), 1, 1))
    y = ops.rt.empty(x.shape, ops.dtype)
    if width == 4:  # split4.wgsl's bindings: x, part, stats, gamma, beta, y
        apply, buffers = v, [x, None, stats, gamma, beta, y]
    else:  # reference.wgsl's: x, stats, gamma, beta, y
        apply, buffers = variants("group_norm")["reference"], [x, stats, gamma, beta, y]
    ops.rt.dispatch(ops.pipeline(apply, "apply_main"), "group_norm", params, buffers,
                    ops.grid_1d(x.numel, 4 if width == 4 else 2))
    return y


@register(
    "group_norm",
    "split",
    doc="three dispatches: per CHUNK-element run of a group (count, mean, M2) in its own workgroup, a "
    "Chan merge per group, the reference's element-wise apply; for groups far larger than a workgroup",
    constants={"CHUNK": SPLIT_CHUNKS},
    candidates=({"CHUNK": 1024}, {"CHUNK": 16384}),
)
def group_norm_split(ops, v: Variant, consts: dict, x, gamma, beta, groups, eps, silu) -> Tensor:
    return _split_passes(ops, v, consts, x, gamma, beta, groups, eps, silu, 1)


@register(
    "group_norm",
    "split4",
    doc="split's three dispatches with vec4 loads and stores (four consecutive elements per access, the "
    "apply's channel arithmetic once per four); H*W divisible by 4 (split otherwise)",
    constants={"CHUNK": SPLIT_CHUNKS},
    candidates=({"CHUNK": 1024}, {"CHUNK": 16384}),
)
def group_norm_split4(ops, v: Variant, consts: dict, x, gamma, beta, groups, eps, silu) -> Tensor:
    if (x.numel // (x.shape[0] * x.shape[1])) % 4:
        return group_norm_split(ops, variants("group_norm")["split"], consts, x, gamma, beta, groups, eps, silu)
    return _split_passes(ops, v, consts, x, gamma, beta, groups, eps, silu, 4)
