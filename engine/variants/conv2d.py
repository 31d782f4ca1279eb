"""The optimized conv2d variants: implicit GEMM (any kernel, stride, padding) and Winograd
F(4x4, 3x3) for 3x3 stride-1 convolutions, plus `winograd_pays`, the rule profiles cite for
when Winograd is worth its transforms.

Both tile a matrix product through workgroup memory with the same override constants (the
tile TILE_M x TILE_N of pixels x output channels, the slab depth TILE_K), with the 4 x 4
register blocks and vec4 workgroup tiles of the tiled linear kernel; their WGSL is in
shaders/conv2d/implicit_gemm.wgsl and shaders/conv2d/winograd.wgsl. Winograd's transformed
filters would take 4x the weights' memory (36 values per 3x3 filter), so its GEMM computes
each one from the filter while staging it, and no copy of the weights exists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..errors import EngineError
from ..gpu import DTYPES, Tensor
from ..kernels import Variant, conv_out_size, register, variants
from .gemm import CANDIDATES as CORE_CANDIDATES
from .gemm import CONSTANTS as CORE_CONSTANTS
from .gemm import F16_CANDIDATES as CORE_F16_CANDIDATES
from .gemm import SCRATCH_BYTES, fit_rows, gemm, scratch_bytes

if TYPE_CHECKING:  # the launchers' first argument; engine.ops loads this module
    from ..ops import Ops

# Tunable tiling of both GEMMs (TILE_M pixels or Winograd tiles x TILE_N output channels per
# workgroup, TILE_K deep slabs); every invocation owns a 4 x 4 register block, so a workgroup
# has TILE_M * TILE_N / 16 invocations. The defaults repeat the WGSL `override` defaults.
GEMM_CONSTANTS = {"TILE_M": (32, 64, 128), "TILE_N": (16, 32, 64), "TILE_K": (8, 16, 32)}
GEMM_DEFAULTS = {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16}
# What the tuner tries besides the defaults: wide pixel tiles for many pixels, small tiles
# (more workgroups) for the 8x8 and 16x16 levels of SD, a deeper slab for long K.
GEMM_CANDIDATES = (
    {"TILE_M": 128, "TILE_N": 32, "TILE_K": 16},
    {"TILE_M": 64, "TILE_N": 32, "TILE_K": 16},
    {"TILE_M": 32, "TILE_N": 32, "TILE_K": 16},
    {"TILE_M": 64, "TILE_N": 16, "TILE_K": 16},
    {"TILE_M": 64, "TILE_N": 64, "TILE_K": 32},
)

WINOGRAD_TILE = 4  # output tile edge m of F(m x m, 3x3)
WINOGRAD_POSITIONS = 36  # (m + 2)^2 products per tile
WINOGRAD_SCRATCH_BYTES = 16 << 20  # bound on each of the transformed input and product buffers


def _gemm_tiling(ops: Ops, consts: dict) -> dict:
    """The full set of tiling constants, checked against the choices and the adapter's limits."""
    tiling = {**GEMM_DEFAULTS, **consts}
    for name, value in tiling.items():
        if name not in GEMM_CONSTANTS or value not in GEMM_CONSTANTS[name]:
            allowed = GEMM_CONSTANTS.get(name)
            raise EngineError(f"conv2d tiling constant {name}={value!r} is not one of {allowed}")
    if tiling["TILE_K"] % (tiling["TILE_N"] // 16):  # the A-slab gather steps k by TILE_N / 16
        raise EngineError(f"conv2d tiling needs TILE_K divisible by TILE_N / 16, got {tiling}")
    limits = ops.rt.caps.limits
    threads = tiling["TILE_M"] * tiling["TILE_N"] // 16
    max_threads = int(limits.get("max-compute-invocations-per-workgroup", 256))
    if threads > max_threads:
        raise EngineError(
            f"conv2d tiling {tiling} needs {threads} invocations per workgroup, above this adapter's {max_threads}"
        )
    shared = 4 * tiling["TILE_K"] * (tiling["TILE_M"] + tiling["TILE_N"])
    max_shared = int(limits.get("max-compute-workgroup-storage-size", 16384))
    if shared > max_shared:
        raise EngineError(
            f"conv2d tiling {tiling} needs {shared} B of workgroup memory, above this adapter's "
            f"{max_shared} B; lower TILE_K, TILE_M or TILE_N"
        )
    return tiling


# ---- implicit GEMM --------------------------------------------------------------------------


@register(
    "conv2d",
    "implicit_gemm",
    doc="conv as a GEMM over (pixels x Cout x Cin*KH*KW), workgroup tiles, register blocking",
    constants=GEMM_CONSTANTS,
    candidates=GEMM_CANDIDATES,
)
def conv2d_implicit_gemm(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout, _, kh, kw = w.shape
    oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
    m, k = bsz * oh * ow, cin * kh * kw
    tiling = fit_rows(_gemm_tiling(ops, consts), m, GEMM_CONSTANTS["TILE_M"])
    m_tiles = math.ceil(m / tiling["TILE_M"])
    gx = min(m_tiles, ops.rt.caps.max_workgroups)  # the pixel tiles fold over x and z
    y = ops.rt.empty((bsz, cout, oh, ow), ops.dtype)
    params = (bsz, cin, h, wd, cout, oh, ow, stride, pads[0], pads[2], int(b is not None), m, k, gx, 0, 0)
    entry = "main_vec4" if k % 4 == 0 else "main"
    ops.rt.dispatch(
        ops.pipeline(v, entry, KH=kh, KW=kw, **tiling), "conv2d", params,
        [x, w, b if b is not None else ops.dummy, y],
        (gx, math.ceil(cout / tiling["TILE_N"]), math.ceil(m_tiles / gx)),
    )
    return y


# ---- Winograd F(4x4, 3x3) -------------------------------------------------------------------


def winograd_applies(shape: dict) -> str | None:
    if shape.get("k") != 3 or shape.get("stride") != 1:
        return "winograd needs a 3x3 stride-1 convolution"
    return None


def _require_3x3_stride1(kh: int, kw: int, stride: int) -> None:
    """The launchers' own check (a profile's rule is checked by winograd_applies first)."""
    if (kh, kw) != (3, 3) or stride != 1:
        raise EngineError(f"winograd needs a 3x3 stride-1 convolution, got {kh}x{kw} stride {stride}")


def winograd_pays(shape: dict, min_channels: int = 64, min_tiles: int = 32) -> bool:
    """TFLite GPU's rule for Winograd 4x4: a 3x3 stride-1 convolution with at least
    `min_channels` input and output channels and at least `min_tiles` 4x4 output tiles per image
    (TFLite counts tiles of one image, not of the batch). The shape dict carries no padding, so
    the output is taken to be the input's size, as with SD's padding of 1."""
    if winograd_applies(shape) is not None:
        return False
    tiles = math.ceil(shape["h"] / WINOGRAD_TILE) * math.ceil(shape["w"] / WINOGRAD_TILE)
    return shape["cin"] >= min_channels and shape["cout"] >= min_channels and tiles >= min_tiles


@register(
    "conv2d",
    "winograd",
    entry="gemm_main",
    doc="Winograd F(4x4,3x3): input transform, 36 batched GEMMs (filters transformed on the fly), output transform",
    constants=GEMM_CONSTANTS,
    candidates=GEMM_CANDIDATES,
    applies=winograd_applies,
)
def conv2d_winograd(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout, _, kh, kw = w.shape
    _require_3x3_stride1(kh, kw, stride)
    oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
    tiling = _gemm_tiling(ops, consts)
    th, tw = math.ceil(oh / WINOGRAD_TILE), math.ceil(ow / WINOGRAD_TILE)
    n_tiles = bsz * th * tw
    # V (36, Cin, tiles) and Mx (36, Cout, tiles) are f32 scratch: walk the tiles in chunks so
    # each stays under WINOGRAD_SCRATCH_BYTES whatever the resolution.
    per_tile = WINOGRAD_POSITIONS * max(cin, cout) * 4
    bound = int(WINOGRAD_SCRATCH_BYTES * min(1, ops.scratch_scale))  # shrunk for a budget, never grown
    chunk = max(tiling["TILE_M"], bound // per_tile // tiling["TILE_M"] * tiling["TILE_M"])
    chunk = min(chunk, n_tiles)
    y = ops.rt.empty((bsz, cout, oh, ow), ops.dtype)
    input_p = ops.pipeline(v, "input_main")
    gemm_p = ops.pipeline(v, "gemm_main", **tiling)
    output_p = ops.pipeline(v, "output_main")
    for t0 in range(0, n_tiles, chunk):
        pc = min(chunk, n_tiles - t0)
        params = (bsz, cin, h, wd, cout, oh, ow, pads[0], pads[2], th, tw, n_tiles, int(b is not None), t0, pc)
        vt = ops.rt.empty((WINOGRAD_POSITIONS, cin, pc), "f32")
        ops.rt.dispatch(input_p, "conv2d_winograd_input", params, [x, None, None, None, vt], ops.grid_1d(cin * pc))
        mx = ops.rt.empty((WINOGRAD_POSITIONS, cout, pc), "f32")
        ops.rt.dispatch(
            gemm_p, "conv2d_winograd_gemm", params, [None, w, None, None, vt, mx],
            (math.ceil(pc / tiling["TILE_M"]), math.ceil(cout / tiling["TILE_N"]), WINOGRAD_POSITIONS),
        )
        ops.rt.dispatch(
            output_p, "conv2d_winograd_output", params,
            [None, None, b if b is not None else ops.dummy, None, None, mx, y], ops.grid_1d(cout * pc),
        )
        del vt, mx
    return y


# ---- Winograd F(2x2, 3x3) through the GEMM core --------------------------------------------

W2_TILE = 2  # output tile edge
W2_POSITIONS = 16  # (2 + 2)^2 products per tile
# Scratch of the core path, in bytes: the transformed filters of one chunk of output channels
# and the products of one chunk of tiles (one size class with the core's own scratch), and the
# transformed input of one chunk of tiles, twice that: with 16 MiB, SD's 32x32 level (512 tiles,
# 1280-1920 input channels) split into a chunk of 272-408 tiles and a small one, and its
# convolutions ran at 60% of the 640-channel ones' rate.
WINOGRAD_CORE_FILTER_BYTES = SCRATCH_BYTES
WINOGRAD_CORE_TILE_BYTES = SCRATCH_BYTES
WINOGRAD_CORE_INPUT_BYTES = 2 * SCRATCH_BYTES


def winograd_core_chunks(cin: int, cout: int, n_tiles: int, item: int = 2, scale: float = 1) -> tuple[int, int]:
    """(output channels, tiles) per chunk: as many as the scratch bounds (times `scale`, the
    Ops' scratch_scale) allow, channels in multiples of 64 (or all), tiles in multiples of 4 (or all)."""
    cc = int(WINOGRAD_CORE_FILTER_BYTES * scale) // (W2_POSITIONS * cin * item)
    cc = cout if cc >= cout else max(64, cc // 64 * 64)
    cc = min(cc, cout)
    tc = min(int(WINOGRAD_CORE_INPUT_BYTES * scale) // (W2_POSITIONS * cin * item),
             int(WINOGRAD_CORE_TILE_BYTES * scale) // (W2_POSITIONS * cc * item))
    tc = n_tiles if tc >= n_tiles else max(4, tc // 4 * 4)
    return cc, tc


# PRETRANSFORM 1: the transformed filters are kept once made (Ops.prepare: once a generation in
# a UNet, whose ContextKV holds them) instead of being made again on every call. They take 16/9
# of the weights' memory beside them (SD 1.4's UNet on an H100: about 1 ms of a step's filter
# transforms for about 1.3 GB); a profile chooses it where the GPU has the memory.
W2_CONSTANTS = {**CORE_CONSTANTS, "PRETRANSFORM": (0, 1)}
W2_CANDIDATES = (*CORE_CANDIDATES, {"PRETRANSFORM": 1}, *({**c, "PRETRANSFORM": 1} for c in CORE_CANDIDATES))
W2_F16_CANDIDATES = (*CORE_F16_CANDIDATES, *({**c, "PRETRANSFORM": 1} for c in CORE_F16_CANDIDATES))


@register(
    "conv2d",
    "winograd_2x2",
    entry="input_main",
    doc="Winograd F(2x2,3x3) through the GEMM core: filters and input tiles transformed into scratch of "
    "the model's element type (f32 arithmetic), 16 products by the core, output transform; Cin % 4 == 0 "
    "(the Winograd F(4x4) kernel otherwise); PRETRANSFORM 1 keeps the transformed filters once made",
    constants=W2_CONSTANTS,
    candidates=W2_CANDIDATES,
    f16_candidates=W2_F16_CANDIDATES,
    applies=winograd_applies,
)
def conv2d_winograd_2x2(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads,
                        residual: Tensor | None = None) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout, _, kh, kw = w.shape
    _require_3x3_stride1(kh, kw, stride)
    if cin % 4:
        return _plus(ops, conv2d_winograd(ops, variants("conv2d")["winograd"], {}, x, w, b, stride, pads), residual)
    keep = bool(consts.get("PRETRANSFORM", 0))
    consts = {k: v for k, v in consts.items() if k != "PRETRANSFORM"}  # the core's own constants
    oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
    th, tw = math.ceil(oh / W2_TILE), math.ceil(ow / W2_TILE)
    n_tiles = bsz * th * tw
    scale = ops.scratch_scale
    cc_max, tc_max = winograd_core_chunks(cin, cout, n_tiles, DTYPES[ops.dtype]().itemsize, scale)
    y = ops.rt.empty((bsz, cout, oh, ow), ops.dtype)
    filter_p, input_p, output_p = (ops.pipeline(v, e) for e in ("filter_main", "input_main", "output_main"))
    bias = b if b is not None else ops.dummy
    base = (bsz, cin, h, wd, cout, oh, ow, pads[0], pads[2], th, tw, n_tiles, int(b is not None))
    has_res = int(residual is not None)

    def transformed_filters(co0: int, cc: int) -> Tensor:
        def make() -> Tensor:  # kept: its own size; else the scratch size class every call shares
            bound = 0 if keep else int(WINOGRAD_CORE_FILTER_BYTES * scale)
            u = ops.rt.empty((W2_POSITIONS, cc, cin), ops.dtype, at_least=bound)
            ops.rt.dispatch(filter_p, "conv2d_winograd_filter", (*base, 0, 0, 0, co0, cc, 0),
                            [None, w, None, u], ops.grid_1d(cc * cin, 2))  # pairs of input channels
            return u

        return ops.prepare(("winograd_2x2", co0, cc), w, make) if keep else make()

    # Tiles outside, channel chunks inside: each chunk of tiles is transformed once; the filters
    # of a channel chunk are transformed once per tile chunk (once in all when one chunk holds
    # every channel, as at SD's large resolutions, or every tile, as at its small ones).
    channel_chunks = [(co0, min(cc_max, cout - co0)) for co0 in range(0, cout, cc_max)]
    u_all = transformed_filters(0, cout) if len(channel_chunks) == 1 else None
    for t0 in range(0, n_tiles, tc_max):
        pc = min(tc_max, n_tiles - t0)
        pcp = -(-pc // 4) * 4
        vt = ops.rt.empty((W2_POSITIONS, cin, pcp), ops.dtype, at_least=int(WINOGRAD_CORE_INPUT_BYTES * scale))
        ops.rt.dispatch(input_p, "conv2d_winograd_input", (*base, t0, pc, pcp, 0, cout, 0),
                        [x, None, None, None, vt], ops.grid_1d(cin * pcp, 2))  # pairs of tiles
        for co0, cc in channel_chunks:
            u = u_all if u_all is not None else transformed_filters(co0, cc)
            mx = gemm(ops, consts, u, vt, cc, pcp, cin, batch=W2_POSITIONS, b_kn=True,
                      out=ops.rt.empty((W2_POSITIONS, cc, pcp), ops.dtype, at_least=int(WINOGRAD_CORE_TILE_BYTES * scale)),
                      label="conv2d_winograd_gemm")
            ops.rt.dispatch(output_p, "conv2d_winograd_output", (*base, t0, pc, pcp, co0, cc, has_res),
                            [None, None, bias, None, None, mx, y, residual if has_res else ops.dummy],
                            ops.grid_1d(cc * pc))
            del mx, u
        del vt
    return y


conv2d_winograd_2x2.fuses_residual = True  # Ops.conv2d hands it the residual to add in the output transform


def _plus(ops: Ops, y: Tensor, residual: Tensor | None) -> Tensor:
    """y, or y + residual by `add` (a fallback path without the fused epilogue)."""
    return y if residual is None else ops.add(y, residual)


# ---- a few output channels: one invocation per pixel ------------------------------------------

NARROW_OUTS = 4  # shaders/conv2d/narrow.wgsl: the most output channels an invocation computes


@register(
    "conv2d",
    "narrow",
    doc="a direct convolution to at most 4 output channels (the UNet's and the VAE decoder's conv_out): "
    "one invocation per output pixel computes every channel, each input element read once a tap",
    applies=lambda shape: None if shape.get("cout", 0) <= NARROW_OUTS
    else f"computes at most {NARROW_OUTS} output channels (Cout={shape.get('cout')})",
)
def conv2d_narrow(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout, _, kh, kw = w.shape
    if cout > NARROW_OUTS:  # (a profile rule matching more: Selection refuses it before this)
        raise EngineError(f"conv2d narrow: {cout} output channels, at most {NARROW_OUTS}")
    oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
    y = ops.rt.empty((bsz, cout, oh, ow), ops.dtype)
    params = (bsz, cin, h, wd, cout, oh, ow, kh, kw, stride, pads[0], pads[2], int(b is not None))
    ops.rt.dispatch(ops.pipeline(v), "conv2d", params, [x, w, b if b is not None else ops.dummy, y],
                    (math.ceil(oh * ow / 64), 1, bsz))
    return y


# ---- 1x1 convolutions through the GEMM core ------------------------------------------------


def pointwise_applies(shape: dict) -> str | None:
    if shape.get("k") != 1 or shape.get("stride") != 1:
        return "the pointwise GEMM needs a 1x1 stride-1 convolution"
    return None


@register(
    "conv2d",
    "pointwise",
    doc="a 1x1 stride-1 convolution as the GEMM core's batched product W (Cout x Cin) by x[b] (Cin x HW), "
    "bias in the epilogue; Cin and HW divisible by 4 (implicit GEMM otherwise)",
    constants=CORE_CONSTANTS,
    candidates=CORE_CANDIDATES,
    f16_candidates=CORE_F16_CANDIDATES,
    applies=pointwise_applies,
)
def conv2d_pointwise(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads,
                     residual: Tensor | None = None) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout = w.shape[0]
    hw = h * wd
    if w.shape[2:] != (1, 1) or stride != 1 or any(pads) or cin % 4 or hw % 4:
        return _plus(ops, conv2d_implicit_gemm(ops, variants("conv2d")["implicit_gemm"], {}, x, w, b, stride, pads),
                     residual)
    return gemm(ops, consts, w, x, cout, hw, cin, batch=bsz, b_kn=True, bias=b, bias_on_m=True, residual=residual,
                strides=(0, cin * hw, cout * hw), out_shape=(bsz, cout, h, wd), label="conv2d")


conv2d_pointwise.fuses_residual = True


# ---- any convolution through the GEMM core (im2col) ----------------------------------------


@register(
    "conv2d",
    "im2col",
    doc="the input unfolded (im2col) into scratch, then the GEMM core's batched product W (Cout x "
    "Cin*KH*KW) by the unfolded image, bias in the epilogue, split-K for the few pixels of SD's "
    "stride-2 convolutions; Cin*KH*KW and the pixel count divisible by 4 and the batch's unfolding "
    "within the scratch bound (implicit GEMM otherwise)",
    constants=CORE_CONSTANTS,
    candidates=CORE_CANDIDATES,
    f16_candidates=CORE_F16_CANDIDATES,
)
def conv2d_im2col(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads,
                  residual: Tensor | None = None) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout, _, kh, kw = w.shape
    oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
    kk, npix = cin * kh * kw, oh * ow
    budget = scratch_bytes(ops)
    nbytes = bsz * kk * npix * DTYPES[ops.dtype]().itemsize
    if kk % 4 or npix % 4 or nbytes > budget:
        return _plus(ops, conv2d_implicit_gemm(ops, variants("conv2d")["implicit_gemm"], {}, x, w, b, stride, pads),
                     residual)
    col = ops.rt.empty((bsz, kk, npix), ops.dtype, at_least=budget)
    ops.rt.dispatch(ops.pipeline(v, "main"), "conv2d_im2col",
                    (cin, h, wd, kh, kw, stride, pads[0], pads[2], oh, ow, bsz * kk * npix),
                    [x, col], ops.grid_1d(bsz * kk * npix, 2))
    return gemm(ops, consts, w, col, cout, npix, kk, batch=bsz, b_kn=True, bias=b, bias_on_m=True, residual=residual,
                strides=(0, kk * npix, cout * npix), out_shape=(bsz, cout, oh, ow), label="conv2d")


conv2d_im2col.fuses_residual = True
