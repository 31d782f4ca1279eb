"""Optimized linear layers: the "tiled" variant, a register-blocked matrix multiply staged
through workgroup memory with vec4 loads along K when K % 4 == 0, after "Speed Is All You
Need" (Chen et al., 2023). Tile sizes are `override` constants a tuner may set."""

from __future__ import annotations

import math

from ..gpu import Tensor
from ..kernels import Variant, register, variants
from .gemm import CANDIDATES as CORE_CANDIDATES
from .gemm import CONSTANTS as CORE_CONSTANTS
from .gemm import F16_CANDIDATES as CORE_F16_CANDIDATES
from .gemm import fit_rows, gated_unsupported, gemm, unsupported

DEFAULTS = {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16}
TILED_CONSTANTS = {"TILE_M": (32, 64), "TILE_N": (32, 64), "TILE_K": (8, 16, 32)}


@register(
    "linear",
    "tiled",
    entry="main_vec4",
    doc="TILE_M x TILE_N workgroup tiles, 4x4 register blocks, K staged in workgroup memory",
    constants=TILED_CONSTANTS,
)
def linear_tiled(ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    k = math.prod(w.shape[1:])
    return _dispatch_tiled(ops, v, "main_vec4" if k % 4 == 0 else "main", consts, x, w, b)


@register(
    "linear",
    "tiled_f16",
    requires=("shader-f16",),
    doc="the tiled blocking with vec4<f16> workgroup tiles and f16 FMAs, each tile's products added "
    "to an f32 accumulator; f16 models with K % 4 == 0 (otherwise the f32 tiled kernel)",
    constants=TILED_CONSTANTS,
)
def linear_tiled_f16(ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    if ops.dtype != "f16" or math.prod(w.shape[1:]) % 4:
        tiled = variants("linear")["tiled"]
        return linear_tiled(ops, tiled, consts, x, w, b)
    return _dispatch_tiled(ops, v, "main", consts, x, w, b)


def _dispatch_tiled(ops, v: Variant, entry: str, consts: dict, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """y = x w^T + b through `entry` of a tiled kernel: x (..., K), w (N, K), y (..., N)."""
    n_out, k = w.shape[0], math.prod(w.shape[1:])
    m = x.numel // k
    tiles = fit_rows({**DEFAULTS, **consts}, m, TILED_CONSTANTS["TILE_M"])
    y = ops.rt.empty((*x.shape[:-1], n_out), ops.dtype)
    ops.rt.dispatch(
        ops.pipeline(v, entry, **tiles),
        "linear",
        (m, n_out, k, int(b is not None)),
        [x, w, b if b is not None else ops.dummy, y],
        (math.ceil(n_out / tiles["TILE_N"]), math.ceil(m / tiles["TILE_M"]), 1),
    )
    return y


ROWS = 4  # shaders/linear/rows.wgsl: the most rows of x one of its workgroups keeps sums for
COLS_PER_GROUP = 4


@register(
    "linear",
    "rows",
    doc="a few rows of x (at most 4: the UNet's time-embedding projections, M = the batch): each "
    "output column's K split over 64 invocations reading W's row in order, 4 loads in flight each, "
    "f32 sums added in workgroup memory; bound by reading W once, where a tiled product would be "
    "mostly padding",
    applies=lambda shape: None if shape.get("m", 0) <= ROWS else f"takes at most {ROWS} rows (M={shape.get('m')})",
)
def linear_rows(ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    n_out, k = w.shape[0], math.prod(w.shape[1:])
    m = x.numel // k
    if m > ROWS:  # (a profile rule matching more rows: Selection refuses it before this)
        raise ValueError(f"linear rows: {m} rows, at most {ROWS}")
    y = ops.rt.empty((*x.shape[:-1], n_out), ops.dtype)
    ops.rt.dispatch(ops.pipeline(v, "main"), "linear", (m, n_out, k, int(b is not None)),
                    [x, w, b if b is not None else ops.dummy, y], (math.ceil(n_out / COLS_PER_GROUP), 1, 1))
    return y


@register(
    "linear",
    "gemm",
    doc="the GEMM core (shaders/linear/gemm.wgsl): 8x8 register blocks of vec4<f16> FMAs (f32 models: "
    "gemm_f32.wgsl, f32 FMAs), double-buffered TILE_M x TILE_N x TILE_K workgroup tiles, f32 accumulation, "
    "optional split-K, bias in the epilogue; K and N divisible by 4 (the tiled kernels otherwise)",
    constants=CORE_CONSTANTS,
    candidates=CORE_CANDIDATES,
    f16_candidates=CORE_F16_CANDIDATES,
)
def linear_gemm(ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None,
                residual: Tensor | None = None, geglu: bool = False) -> Tensor:
    n_out, k = w.shape[0], math.prod(w.shape[1:])
    m = x.numel // k
    if geglu:  # Ops.linear_geglu has checked that this setting takes it (fuses_geglu)
        return gemm(ops, consts, x, w, m, n_out, k, bias=b, gated=True, out_shape=(*x.shape[:-1], n_out // 2),
                    label="linear")
    if unsupported(k, n_out):  # odd sizes: the tiled kernels, with their defaults
        y = linear_tiled_f16(ops, variants("linear")["tiled_f16"], {}, x, w, b)
        return y if residual is None else ops.add(y, residual)
    return gemm(ops, consts, x, w, m, n_out, k, bias=b, residual=residual, out_shape=(*x.shape[:-1], n_out),
                label="linear")


linear_gemm.fuses_residual = True  # Ops.linear hands it the residual to add in the epilogue
# Ops.linear_geglu hands it GEGLU's gate where the setting can take it in the epilogue
linear_gemm.fuses_geglu = lambda consts, n, k: unsupported(k, n) is None and \
    gated_unsupported(consts, n, False, None, None) is None


# ---- a transformer's output projection, written channel-major (op linear_nchw) ----------------


@register("linear_nchw", "reference", doc="the linear layer's own selection, then a transpose to (B, N, T) and an add")
def linear_nchw_reference(ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None,
                          residual: Tensor) -> Tensor:
    y = ops.transpose(ops.linear(x, w, b)).reshape(residual.shape)
    return ops.add(y, residual)


linear_nchw_reference.composed = True  # it runs other ops' kernels (as they are chosen), none of its own


@register(
    "linear_nchw",
    "gemm",
    doc="one product of the GEMM core per image, W (N x K) by the tokens x[b] (T x K), so that C[b] is "
    "N x T, the image layout; bias and the residual in the epilogue. No transpose and no add kernel",
    constants=CORE_CONSTANTS,
    candidates=CORE_CANDIDATES,
    f16_candidates=CORE_F16_CANDIDATES,
    applies=lambda shape: unsupported(shape["k"], shape["t"]),
)
def linear_nchw_gemm(ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None,
                     residual: Tensor) -> Tensor:
    bsz, t, k = x.shape
    n_out = w.shape[0]
    return gemm(ops, consts, w, x, n_out, t, k, batch=bsz, bias=b, bias_on_m=True, residual=residual,
                strides=(0, t * k, n_out * t), out_shape=residual.shape, label="linear")


# The f32 core's own entry in the registry: its shader file, for gemm() to compile when the
# model is f32 (a profile selects "gemm" for both element types).
register(
    "linear",
    "gemm_f32",
    doc="the GEMM core for f32 models (shaders/linear/gemm_f32.wgsl, generated from gemm.wgsl); "
    "profiles select 'gemm', which runs it for f32 models",
    constants=CORE_CONSTANTS,
    applies=lambda shape: "is selected through 'gemm' (which runs it for f32 models)",
)(linear_gemm)
