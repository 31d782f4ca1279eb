"""The attention kernels of "Speed Is All You Need" (arXiv 2304.11267) as variants of op
"attention": `partial_softmax` still writes the f32 score matrix A but never softmax(A) (row
statistics in one reduction dispatch, normalisation inside the matmul with V), and `flash`
never writes A (tiled, online softmax, one query row per invocation). `flash_gemm` is the same
algorithm as two register-blocked GEMMs per key block (S = QK^T, then O += PV, with the online
softmax between them). All take q (B, Tq, H*dh), k and v (B, Tk, H*dh) and return
(B, Tq, H*dh), like the reference in engine/ops.py.
"""

from __future__ import annotations

import math

from ..errors import EngineError
from ..gpu import Tensor
from ..kernels import Variant, register, variants
from .gemm import CONSTANTS as CORE_CONSTANTS
from .gemm import gemm, unsupported

TILE = 16  # the 16x16 tiles of partial_softmax.wgsl
ROW_WG = 256  # invocations per row in partial_softmax.wgsl:row_stats

# flash.wgsl: SPLIT invocations share a query row (each owns DV / SPLIT of its vec4 head-dim
# columns) and each owns RPI rows; q, the accumulator and the block's scores live in private
# arrays bounded by these constants of the shader (MAX_DVS, MAX_RPI, MAX_BC).
FLASH_MAX_DVS = 16
FLASH_MAX_RPI = 2
FLASH_MAX_BC = 64
# Head dims a profile may fix MAX_DH to; by default MAX_DH is dh rounded up to 4 * SPLIT, so
# the padding costs at most 4 * SPLIT - 1 columns.
FLASH_MAX_DH = (40, 64, 80, 128, 160)
# Defaults by SPLIT (which follows the head dim): (BR query rows, BC keys). They keep every
# head dim up to 160 within 16 KiB of workgroup memory, the limit WebGPU guarantees on every
# adapter, and at most 10 vec4 columns (40 floats of q, 40 of acc) per invocation.
FLASH_SPLIT_FOR_DH = ((40, 1), (80, 2), (160, 4))  # (largest dh, SPLIT)
FLASH_BLOCKS = {1: (64, 16), 2: (32, 16), 4: (32, 8)}
WEBGPU_MIN_WORKGROUP_STORAGE = 16384


def flash_workgroup_bytes(br: int, bc: int, max_dh: int, split: int = 1) -> int:
    """Workgroup memory of flash.wgsl: K and V blocks as vec4, plus the partial dots of split rows."""
    dv = -(-max_dh // 4)
    part = br * bc * split if split > 1 else 1
    return 2 * 16 * bc * dv + 4 * part


def flash_config(dh: int, consts: dict) -> dict[str, int]:
    """The override constants flash.wgsl runs with for head dim `dh`: the profile's, else the
    defaults. Raises EngineError naming the bad constant when they cannot serve `dh`."""
    widest = max(dh, int(consts.get("MAX_DH") or 0))
    split = int(consts.get("SPLIT") or next((s for d, s in FLASH_SPLIT_FOR_DH if widest <= d), 4))
    if split not in (1, 2, 4):
        raise EngineError(f"attention/flash: SPLIT={split}; use 1, 2 or 4")
    max_dh = int(consts.get("MAX_DH") or 4 * split * -(-dh // (4 * split)))
    if max_dh < dh:
        raise EngineError(f"attention/flash: MAX_DH={max_dh} is below the head dim {dh}; use a larger MAX_DH")
    dv = -(-max_dh // 4)
    if dv % split or dv // split > FLASH_MAX_DVS:
        raise EngineError(
            f"attention/flash: MAX_DH={max_dh} ({dv} vec4 columns) cannot be split over SPLIT={split} "
            f"invocations of at most {FLASH_MAX_DVS} columns each; choose a SPLIT that divides {dv} "
            f"and is at least {-(-dv // FLASH_MAX_DVS)}"
        )
    br, bc = FLASH_BLOCKS[split]
    br, bc = int(consts.get("BR", br)), int(consts.get("BC", bc))
    rpi = int(consts.get("RPI", 1))
    if not 1 <= rpi <= FLASH_MAX_RPI or br % rpi:
        raise EngineError(f"attention/flash: RPI={rpi} with BR={br}; RPI must be 1..{FLASH_MAX_RPI} and divide BR")
    if not 1 <= bc <= FLASH_MAX_BC:
        raise EngineError(f"attention/flash: BC={bc}; use 1..{FLASH_MAX_BC}")
    return {"BR": br, "BC": bc, "MAX_DH": max_dh, "SPLIT": split, "RPI": rpi}


@register(
    "attention",
    "partial_softmax",
    entry="scores",
    doc="A = scale QK^T stored (tiled); row max/sum in one reduction; exp(a-L)/S applied in the matmul with V",
)
def attention_partial_softmax(
    ops, v: Variant, consts: dict, q: Tensor, k: Tensor, vv: Tensor, heads: int, causal: bool, scale: float
) -> Tensor:
    bsz, tq, width = q.shape
    tk = k.shape[1]
    dh = width // heads
    o = ops.rt.empty((bsz, tq, width), ops.dtype)
    scores_p = ops.pipeline(v, "scores")
    stats_p = ops.pipeline(v, "row_stats")
    sum_p = ops.pipeline(v, "weighted_sum")
    for bh0, nbh in ops.score_chunks(bsz * heads, tq, tk):
        rows = nbh * tq
        a = ops.rt.empty((nbh, tq, tk), "f32")  # (chunk, Tq, Tk)
        stats = ops.rt.empty((rows, 2), "f32")  # (chunk * Tq, [L, S])
        params = (heads, tq, tk, dh, width, width, bh0, scale, int(causal), rows)
        ops.rt.dispatch(
            scores_p, "attention/scores", params, [q, k, a], (math.ceil(tk / TILE), math.ceil(tq / TILE), nbh)
        )
        gx = min(rows, ops.rt.caps.max_workgroups)
        ops.rt.dispatch(
            stats_p, "attention/row_stats", params, [None, None, a, None, None, stats], (gx, math.ceil(rows / gx), 1)
        )
        ops.rt.dispatch(
            sum_p, "attention/weighted_sum", params, [None, None, a, vv, o, stats],
            (math.ceil(dh / TILE), math.ceil(tq / TILE), nbh),
        )
        del a, stats  # back to the pool before the next chunk takes them
    return o


def flash_applies(shape: dict) -> str | None:
    dh = shape.get("dh", 0)
    if dh > max(FLASH_MAX_DH):
        return f"supports head dims up to {max(FLASH_MAX_DH)} (got {dh})"
    return None


@register(
    "attention",
    "flash",
    doc="tiled attention with online softmax; q, scores and accumulator in f32 registers, K/V blocks "
    "in workgroup memory; the score matrix is never stored",
    constants={
        "BR": (8, 16, 32, 64, 128),
        "BC": (8, 16, 32, 64),
        "MAX_DH": FLASH_MAX_DH,
        "SPLIT": (1, 2, 4),
        "RPI": (1, 2),
    },
    # For the tuner, beside the defaults: two rows per invocation (twice the FMAs per workgroup
    # read), longer key blocks, and more invocations per row (fewer registers each).
    candidates=({"RPI": 2}, {"BC": 32}, {"RPI": 2, "BC": 8}, {"SPLIT": 2}, {"SPLIT": 4}, {"BR": 128}),
    applies=flash_applies,
)
def attention_flash(
    ops, v: Variant, consts: dict, q: Tensor, k: Tensor, vv: Tensor, heads: int, causal: bool, scale: float
) -> Tensor:
    bsz, tq, width = q.shape
    tk = k.shape[1]
    dh = width // heads
    cfg = flash_config(dh, consts)
    br, bc, max_dh, split = cfg["BR"], cfg["BC"], cfg["MAX_DH"], cfg["SPLIT"]
    need = flash_workgroup_bytes(br, bc, max_dh, split)
    limit = int(ops.rt.caps.limits["max-compute-workgroup-storage-size"])
    if need > limit:
        raise EngineError(
            f"attention/flash: BR={br}, BC={bc}, MAX_DH={max_dh}, SPLIT={split} need {need} bytes of "
            f"workgroup memory, above this adapter's max-compute-workgroup-storage-size of {limit}; "
            "choose smaller blocks in the profile"
        )
    invocations = br // cfg["RPI"] * split
    lim = ops.rt.caps.limits
    max_inv = min(
        int(lim.get("max-compute-invocations-per-workgroup", 256)), int(lim.get("max-compute-workgroup-size-x", 256))
    )
    if invocations > max_inv:
        raise EngineError(
            f"attention/flash: BR={br}, RPI={cfg['RPI']}, SPLIT={split} make {invocations} invocations "
            f"per workgroup, above this adapter's limit of {max_inv} (max-compute-invocations-per-workgroup, "
            "max-compute-workgroup-size-x); choose a smaller BR or a larger RPI in the profile"
        )
    o = ops.rt.empty((bsz, tq, width), ops.dtype)
    pipeline = ops.pipeline(v, **cfg)
    params = (heads, tq, tk, dh, width, width, int(causal), scale)
    ops.rt.dispatch(pipeline, "attention/flash", params, [q, k, vv, o], (math.ceil(tq / br), bsz * heads, 1))
    return o


# flash_gemm.wgsl: its accumulator columns per invocation (a0..a3) and the settings tried by default.
GEMM_MAX_CO = 4
GEMM_MAX_DH = 160
GEMM_BQ = (64, 32, 16, 8, 4)


def gemm_workgroup_bytes(bq: int, tx: int, co: int, operand_bytes: int = 16, kpi: int = 4) -> int:
    """Workgroup memory of flash_gemm.wgsl (and flash_packed.wgsl, `kpi` keys per invocation):
    qs, kv and pt, rows of `operand_bytes` vec4s (16 for f32, 8 for flash_packed's f16), and red,
    vec4<f32>; odd pitches."""
    dvp, typ, bk = (co * tx) | 1, (bq // 4) | 1, kpi * tx
    return operand_bytes * (bq * dvp + bk * dvp + bk * typ) + 16 * tx * typ


def gemm_config(
    dh: int, consts: dict, storage_limit: int, invocation_limit: int, operand_bytes: int = 16, name: str = "flash_gemm"
) -> dict[str, int]:
    """The override constants flash_gemm.wgsl (or flash_packed.wgsl) runs with for head dim `dh`. The profile's BQ and
    TX win; what it leaves open is chosen to give the most invocations per workgroup within the
    adapter's limits (TX defaults to the head dim's vec4 count, capped at 10, so that SD's
    40 / 80 / 160 pad nothing). Raises EngineError naming the bad constant or the limit."""
    dv = -(-dh // 4)
    kpi = int(consts.get("KPI", 4))  # flash_packed's keys of S per invocation
    tx0 = min(dv, 10)
    txs = [int(consts["TX"])] if "TX" in consts else sorted({tx0, -(-tx0 // 2), -(-tx0 // 4), 1}, reverse=True)
    bqs = [int(consts["BQ"])] if "BQ" in consts else list(GEMM_BQ)
    best, why = None, ""
    for tx in txs:
        co = -(-dv // max(tx, 1))
        if tx < 1 or co > GEMM_MAX_CO:
            why = why or (f"TX={tx} leaves {co} vec4 head-dim columns per invocation for head dim {dh} "
                          f"(at most {GEMM_MAX_CO}); use a TX of at least {-(-dv // GEMM_MAX_CO)}")
            continue
        for bq in bqs:
            if bq < 4 or bq % 4:
                raise EngineError(f"attention/{name}: BQ={bq}; use a multiple of 4")
            need = gemm_workgroup_bytes(bq, tx, co, operand_bytes, kpi)
            if need > storage_limit:
                why = why or (f"BQ={bq}, TX={tx} need {need} bytes of workgroup memory for head dim {dh}, above "
                              f"this adapter's max-compute-workgroup-storage-size of {storage_limit}; choose smaller blocks")
                continue
            if tx * bq // 4 > invocation_limit:
                why = why or (f"BQ={bq}, TX={tx} make {tx * bq // 4} invocations per workgroup, above this "
                              f"adapter's limit of {invocation_limit}; choose a smaller BQ or TX")
                continue
            if best is None or tx * bq > best["TX"] * best["BQ"]:
                best = {"BQ": bq, "TX": tx, "CO": co}
    if best is None:
        raise EngineError(f"attention/{name}: {why}")
    return best


def gemm_applies(shape: dict) -> str | None:
    dh = shape.get("dh", 0)
    if dh > GEMM_MAX_DH:
        return f"supports head dims up to {GEMM_MAX_DH} (got {dh})"
    return None


@register(
    "attention",
    "flash_gemm",
    doc="flash attention as two register-blocked GEMMs per key block (S = QK^T and O += PV, 4x4 "
    "register blocks), online softmax between them, P in workgroup memory; the score matrix is never stored",
    constants={"BQ": (16, 32, 64, 128), "TX": (4, 5, 8, 10, 20)},
    # For the tuner, beside the defaults: fewer rows per workgroup (more workgroups, less memory
    # each), fewer invocations per row (shorter key blocks, more head-dim columns each), and
    # with those, more rows.
    candidates=({"BQ": 32}, {"BQ": 16}, {"TX": 5}, {"BQ": 32, "TX": 5}, {"BQ": 128, "TX": 5}),
    applies=gemm_applies,
)
def attention_flash_gemm(
    ops, v: Variant, consts: dict, q: Tensor, k: Tensor, vv: Tensor, heads: int, causal: bool, scale: float
) -> Tensor:
    return _launch_flash_gemm(ops, v, consts, q, k, vv, heads, causal, scale, 16)


@register(
    "attention",
    "flash_packed",
    doc="flash_gemm with Q, K, V and P in the model's type and both products summed in it (two f16 "
    "lanes per FMA) before they reach the f32 scores and accumulators; softmax statistics in f32; vec4 "
    "loads of Q, K and V, the next block's K and V in flight during the FMAs; head dims divisible by 4 "
    "(flash_gemm otherwise)",
    constants={"BQ": (16, 32, 64, 128), "TX": (4, 5, 8, 10, 20), "KPI": (4, 8)},
    # As flash_gemm's; its halved workgroup memory also admits 128 rows at the default TX; and 8
    # keys of S per invocation (blocks of 8 TX keys: half the barriers and Q loads per key).
    candidates=({"BQ": 32}, {"BQ": 16}, {"TX": 5}, {"BQ": 32, "TX": 5}, {"BQ": 128, "TX": 5}, {"BQ": 128},
                {"KPI": 8}, {"KPI": 8, "BQ": 128}, {"KPI": 8, "BQ": 32}, {"KPI": 8, "TX": 5}),
    applies=gemm_applies,
)
def attention_flash_packed(
    ops, v: Variant, consts: dict, q: Tensor, k: Tensor, vv: Tensor, heads: int, causal: bool, scale: float
) -> Tensor:
    if int(consts.get("KPI", 4)) not in (4, 8):  # the shader has code for 4 and 8 keys of S per invocation
        raise EngineError(f"attention/flash_packed: KPI={consts['KPI']}; use 4 or 8")
    aligned = (q.shape[2] // heads) % 4 == 0
    if not aligned:  # its vec4 loads need the head dim (and so the rows) in vec4s
        v, consts = variants("attention")["flash_gemm"], {c: x for c, x in consts.items() if c not in ("FLUSH_DV", "KPI")}
    if ops.dtype == "f16":
        return _launch_flash_gemm(ops, v, consts, q, k, vv, heads, causal, scale, 8 if aligned else 16)
    # An f32 model stages vec4<f32> operands, twice the workgroup memory of the f16 blocks a
    # profile was tuned with: it keeps the profile's blocks where they fit, else the defaults.
    try:
        return _launch_flash_gemm(ops, v, consts, q, k, vv, heads, causal, scale, 16)
    except EngineError:
        if not consts:
            raise
        return _launch_flash_gemm(ops, v, {}, q, k, vv, heads, causal, scale, 16)


def _launch_flash_gemm(ops, v, consts, q, k, vv, heads, causal, scale, operand_bytes: int) -> Tensor:
    bsz, tq, width = q.shape
    tk = k.shape[1]
    dh = width // heads
    lim = ops.rt.caps.limits
    invocations = min(
        int(lim.get("max-compute-invocations-per-workgroup", 256)), int(lim.get("max-compute-workgroup-size-x", 256))
    )
    storage = int(lim.get("max-compute-workgroup-storage-size", WEBGPU_MIN_WORKGROUP_STORAGE))
    cfg = gemm_config(dh, consts, storage, invocations, operand_bytes, v.name)
    # flash_packed's keys of S per invocation, and its summation length in T (benchmarks; not
    # tuned: it trades accuracy)
    cfg |= {c: int(consts[c]) for c in ("KPI", "FLUSH_DV") if c in consts}
    o = ops.rt.empty((bsz, tq, width), ops.dtype)
    params = (heads, tq, tk, dh, width, width, int(causal), scale)
    ops.rt.dispatch(
        ops.pipeline(v, **cfg), f"attention/{v.name}", params, [q, k, vv, o], (math.ceil(tq / cfg["BQ"]), bsz * heads, 1)
    )
    return o


def gemm_softmax_applies(shape: dict) -> str | None:
    if shape.get("heads", 1) != 1:
        return f"runs one-head attention only, the VAE's (got {shape.get('heads')} heads)"
    return None


@register(
    "attention",
    "gemm_softmax",
    entry="softmax_main",
    doc="one-head attention (the VAE's, head dim 512) in f32 as two products of the GEMM core with the "
    "score matrix stored between them and a row softmax in place; a model of halves converts Q, K and V "
    "to f32 and O back; head dim and key count divisible by 4 (partial_softmax otherwise)",
    constants=CORE_CONSTANTS,
    candidates=({"TILE_M": 128, "TILE_N": 128, "TILE_K": 16}, {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16}),
    applies=gemm_softmax_applies,
)
def attention_gemm_softmax(
    ops, v: Variant, consts: dict, q: Tensor, k: Tensor, vv: Tensor, heads: int, causal: bool, scale: float
) -> Tensor:
    bsz, tq, dh = q.shape
    tk = k.shape[1]
    if heads != 1:
        raise EngineError(f"attention/gemm_softmax: {heads} heads; it runs one-head attention only")
    # The core needs vec4 rows.
    if unsupported(dh, tk) or unsupported(tk, dh):
        fallback = variants("attention")["partial_softmax"]
        return attention_partial_softmax(ops, fallback, {}, q, k, vv, heads, causal, scale)
    if ops.dtype != "f32":
        # Halves would hold the unscaled scores: at head dim 512 their rounding reaches the logits
        # and large ones overflow. Q, K and V go to f32 (three element-wise copies, 8 MiB each at
        # the VAE's 4,096 tokens), both products and the softmax run in f32, O comes back.
        f32 = ops.twin("f32")
        o = attention_gemm_softmax(f32, v, consts, *(ops.to_f32(t) for t in (q, k, vv)), heads, causal, scale)
        return ops.from_f32(o)
    # S (bsz, Tq, Tk) = Q K^T, rows of Q and K contiguous (one head: no stride between heads)
    s = gemm(ops, consts, q, k, tq, tk, dh, batch=bsz, strides=(tq * dh, tk * dh, tq * tk),
             out_shape=(bsz, tq, tk), label="attention/scores_gemm")
    rows = bsz * tq
    gx = min(rows, ops.rt.caps.max_workgroups)
    ops.rt.dispatch(ops.pipeline(v, "softmax_main"), "attention/softmax", (rows, tq, tk, int(causal), scale), [s],
                    (gx, math.ceil(rows / gx), 1))
    # O (bsz, Tq, dh) = P V, V (Tk, dh) with dh contiguous: the core's K x N layout of B
    return gemm(ops, consts, s, vv, tq, dh, tk, batch=bsz, b_kn=True, strides=(tq * tk, tk * dh, tq * dh),
                out_shape=(bsz, tq, dh), label="attention/weighted_gemm")
