"""The GEMM core (shaders/linear/gemm.wgsl; gemm_f32.wgsl, generated from it, for f32 models)
and its launcher, shared by the linear variant "gemm", the 1x1 convolution and Winograd's 16
products.

`gemm(ops, consts, a, b, ...)` computes C[z] = act(A[z] B[z]^T + bias + R[z]) in the model's
element type with 8 x 8 register blocks and double-buffered workgroup tiles; the tile sizes, the
f16 flush interval, the split of K and the global prefetch are the constants a profile or the
tuner sets (`CONSTANTS`, `CANDIDATES`).
"""

from __future__ import annotations

import math

from ..errors import EngineError
from ..gpu import Tensor
from ..kernels import variants

DEFAULTS = {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "FLUSH": 1, "SPLIT_K": 1, "PREFETCH": 1, "COLS": 8}
CONSTANTS = {"TILE_M": (32, 64, 128), "TILE_N": (32, 64, 128), "TILE_K": (8, 16, 32), "FLUSH": (1, 2, 4),
             "SPLIT_K": (1, 2, 4, 8, 16, 32), "PREFETCH": (0, 1), "COLS": (8, 4)}
# the settings a tuner tries besides the defaults: large tiles for large products, small ones
# and splits of K so that small M x N still fill the GPU (SD's 8x8 and 16x16 levels: 128 rows
# or tiles by 1280 channels, K up to 11520), no global prefetch (PREFETCH 0) for fewer registers,
# TILE_K 8 for half the workgroup memory (the f32 core's large VAE products: 1.2x on the H100),
# 8 x 4 register blocks (COLS 4: twice the invocations, half the registers; 2-7% on the H100
# for SD's 64x64-level convolutions and projections and the split-K products).
# TILE_K 32 stays a tunable constant but is not tried by default: on the H100 it was slower on
# every SD shape (the tunes of 2026-11-25); so are the settings that never won there (16 and 32
# splits with 8x8 blocks, 16 splits with TILE_K 8: their 8x4 forms won).
CANDIDATES = (
    {"TILE_M": 128, "TILE_N": 128, "TILE_K": 16},
    {"TILE_M": 128, "TILE_N": 64, "TILE_K": 16},
    {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16},
    {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16, "PREFETCH": 0},
    {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16, "SPLIT_K": 2},
    {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16, "SPLIT_K": 4},
    {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 4},
    {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 8},
    {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 8},
    {"TILE_M": 128, "TILE_N": 128, "TILE_K": 8},
    {"TILE_M": 64, "TILE_N": 128, "TILE_K": 8},
    {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "COLS": 4},
    {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 16, "COLS": 4},
    {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 16, "COLS": 4},
)
# Where the core computes in f16, FLUSH 2 (the slabs in pairs, one flush of the f16 sums a pair)
# beside the defaults and every candidate of TILE_K 16: with its pairs loop it was 4-16% faster
# than FLUSH 1 on the H100 at SD's FF1, FF2, q/k/v and 8x8-level im2col products (gemm_probes,
# 2026-12-08); its f16 sums run over 32 terms, as TILE_K 32's do. (The loop before the pairs,
# which tested each slab's parity, was 1.4-1.7x slower.) In f32 there is no f16 sum to flush.
F16_CANDIDATES = ({"FLUSH": 2}, *({**c, "FLUSH": 2} for c in CANDIDATES if c["TILE_K"] == 16))
ACTIVATIONS = {None: 0, "silu": 1, "gelu": 2}
HAS_BIAS, BIAS_ON_M, HAS_RESIDUAL = 1, 2, 4
PAD = 1  # vec4s of padding per staged row (the shader's PAD)
# Every scratch buffer of the core's users (split-K partials, Winograd's transformed operands
# and products) is at most this big and is taken from the pool at exactly this size, so all of
# them share one size class: a UNet step adds a few such buffers to the pool, not one per shape.
SCRATCH_BYTES = 16 << 20


# The heights fit_rows may cut a tile to: multiples of 4 (each invocation's 4 x 4 register
# block), below every choice a profile or tuner has.
FIT_HEIGHTS = (4, 8, 16)


def fit_rows(tiles: dict, rows: int, allowed: tuple[int, ...]) -> dict:
    """`tiles` with TILE_M cut to the smallest height (FIT_HEIGHTS or an allowed choice) that still
    holds `rows` in one tile, where that is below the chosen one: on SD's smallest maps a product
    has few rows (16, 4 and 1 on an 8x8 latent's 4x4, 2x2 and 1x1 levels), and a 64-row tile of
    them is mostly padding that every invocation still multiplies through the whole of K (a
    software adapter runs it as real work). Each output's sum over K is unchanged, so the result
    is too; only padding goes."""
    smaller = [t for t in (*FIT_HEIGHTS, *allowed) if rows <= t < tiles["TILE_M"]]
    return {**tiles, "TILE_M": min(smaller)} if smaller else tiles


def scratch_bytes(ops) -> int:
    """The size class of every scratch buffer of `ops`: SCRATCH_BYTES times its scratch_scale."""
    return int(SCRATCH_BYTES * ops.scratch_scale)


def workgroup_bytes(tiles: dict, dtype: str = "f16") -> int:
    """Workgroup memory of one setting: two stages of TILE_K rows of A and B, vec4s of the
    element type (f16: 8 bytes; the f32 core: 16)."""
    item = 8 if dtype == "f16" else 16
    return 2 * tiles["TILE_K"] * (tiles["TILE_M"] // 4 + PAD + tiles["TILE_N"] // 4 + PAD) * item


def check_tiles(tiles: dict, limits: dict, dtype: str = "f16") -> None:
    """Raise EngineError for a setting the shader cannot take or the adapter cannot hold."""
    tm, tn, tk = tiles["TILE_M"], tiles["TILE_N"], tiles["TILE_K"]
    for name, value in tiles.items():
        if name not in CONSTANTS:
            raise EngineError(f"gemm: unknown constant {name}; the core takes {', '.join(CONSTANTS)}")
        if name in ("FLUSH", "SPLIT_K", "PREFETCH", "COLS") and value not in CONSTANTS[name]:
            raise EngineError(f"gemm: {name}={value} is not one of {CONSTANTS[name]}")
    if tm % 16 or tn % 16 or tk % 8:
        raise EngineError(f"gemm: TILE_M and TILE_N must be multiples of 16 and TILE_K of 8, got {tiles}")
    if tk > tm // 2 or tk > tn // 2:
        raise EngineError(f"gemm: TILE_K must be at most half of TILE_M and of TILE_N, got {tiles}")
    threads = (tm // 8) * (tn // tiles.get("COLS", 8))
    if threads > limits.get("max-compute-invocations-per-workgroup", 256):
        raise EngineError(f"gemm: {tiles} needs {threads} invocations per workgroup; the adapter allows "
                          f"{limits.get('max-compute-invocations-per-workgroup', 256)}")
    need, have = workgroup_bytes(tiles, dtype), limits.get("max-compute-workgroup-storage-size", 16384)
    if need > have:
        raise EngineError(f"gemm: {tiles} needs {need} bytes of workgroup memory; the adapter has {have}")


def gated_unsupported(consts: dict, n: int, b_kn: bool, residual, act) -> str | None:
    """Why the core cannot run a product with the GEGLU epilogue in this setting (None: it can)."""
    tiles = {**DEFAULTS, **consts}
    if tiles["COLS"] != 8 or tiles["SPLIT_K"] != 1:
        return f"the GEGLU epilogue needs COLS 8 and SPLIT_K 1 (got COLS {tiles['COLS']}, SPLIT_K {tiles['SPLIT_K']})"
    if n % 8 or b_kn or residual is not None or act is not None:
        return "the GEGLU epilogue needs N divisible by 8, B as N x K, no residual and no activation"
    return None


def unsupported(k: int, n: int) -> str | None:
    """Why the core cannot run a product with inner size k and output width n (None: it can)."""
    if k % 4 or n % 4:
        return f"needs K and N divisible by 4 (K={k}, N={n})"
    return None


def gemm(
    ops,
    consts: dict,
    a: Tensor,
    b: Tensor,
    m: int,
    n: int,
    k: int,
    *,
    batch: int = 1,
    b_kn: bool = False,
    bias: Tensor | None = None,
    bias_on_m: bool = False,
    residual: Tensor | None = None,
    act: str | None = None,
    out: Tensor | None = None,
    out_shape: tuple[int, ...] | None = None,
    strides: tuple[int, int, int] | None = None,
    label: str = "gemm",
    gated: bool = False,
) -> Tensor:
    """C (batch, m, n) = act(A B^T + bias + residual) for A (batch, m, k) and B (batch, n, k),
    or B (batch, k, n) when `b_kn`. `strides` are the batch strides of A, B and C in elements
    (default: packed; 0 shares one operand across the batch). `gated`: GEGLU, C (batch, m, n/2)
    = value * GELU(gate), the first n/2 of B's rows (and of bias) the value's, the rest the gate's."""
    why = unsupported(k, n) or (gated_unsupported(consts, n, b_kn, residual, act) if gated else None)
    if why:
        raise EngineError(f"gemm {m}x{n}x{k}: {why}")
    tiles = {**DEFAULTS, **consts}
    check_tiles(tiles, ops.rt.caps.limits, ops.dtype)
    n_c = n // 2 if gated else n
    sa, sb, sc = strides if strides is not None else (m * k, n * k, m * n_c)
    if sa % 4 or sb % 4 or sc % 4:
        raise EngineError(f"gemm: batch strides {sa, sb, sc} must be multiples of 4")
    y = out if out is not None else ops.rt.empty(out_shape or ((batch, m, n_c) if batch > 1 else (m, n_c)), ops.dtype)
    flags = (HAS_BIAS if bias is not None else 0) | (BIAS_ON_M if bias_on_m else 0) | \
        (HAS_RESIDUAL if residual is not None else 0)
    core = variants("linear")["gemm" if ops.dtype == "f16" else "gemm_f32"]
    split = tiles["SPLIT_K"]
    params = (m, n, k, flags, sa, sb, sc, ACTIVATIONS[act], batch)
    epilogue = [bias if bias is not None else ops.dummy, residual if residual is not None else ops.dummy, y]
    budget = scratch_bytes(ops)
    if split > 1 and split * batch * m * n * 4 > budget:
        raise EngineError(f"gemm: SPLIT_K={split} of a {batch}x{m}x{n} product needs more than "
                          f"{budget >> 20} MiB of partials; split products that small M x N need")
    part = ops.rt.empty((split, batch, m, n), "f32", at_least=budget) if split > 1 else ops.dummy_rw
    ops.rt.dispatch(
        ops.pipeline(core, "main", **tiles, B_KN=bool(b_kn), **({"GATED": True} if gated else {})),
        label, params, [a, b, *epilogue, part],
        (math.ceil(n / tiles["TILE_N"]), math.ceil(m / tiles["TILE_M"]), batch * split),
    )
    if split > 1:
        ops.rt.dispatch(ops.pipeline(core, "reduce_main", SPLIT_K=split), f"{label}_reduce", params,
                        [None, None, *epilogue, part], ops.grid_1d(batch * m * n // 4))
    return y
