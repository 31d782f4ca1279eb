"""The attention kernels of "Speed Is All You Need" (arXiv 2304.11267) as variants of op
"attention": `partial_softmax` still writes the f32 score matrix A but never softmax(A) (row
statistics in one reduction dispatch, normalisation inside the matmul with V), and `flash`
never writes A (tiled, online softmax). Both take q (B, Tq, H*dh), k and v (B, Tk, H*dh) and
return (B, Tq, H*dh), like the reference in engine/ops.py.
"""

from __future__ import annotations

import math

from ..errors import EngineError
from ..kernels import Variant, register
from ..runtime import Tensor

TILE = 16  # the 16x16 tiles of partial_softmax.wgsl
ROW_WG = 256  # invocations per row in partial_softmax.wgsl:row_stats

# flash.wgsl: NT invocations per query row, each with ACC_MAX register accumulators.
FLASH_NT = 8
FLASH_ACC_MAX = 20
FLASH_MAX_DH = (40, 64, 80, 128, 160)
# Default blocks (BR query rows, BC keys) per MAX_DH, chosen so the workgroup memory stays
# within 16 KiB, the limit WebGPU guarantees on every adapter; a profile may ask for more.
FLASH_BLOCKS = {40: (32, 32), 64: (16, 16), 80: (16, 16), 128: (8, 16), 160: (8, 16)}
WEBGPU_MIN_WORKGROUP_STORAGE = 16384


def flash_workgroup_bytes(br: int, bc: int, max_dh: int) -> int:
    """Workgroup memory of flash.wgsl: the Q block, one K/V block and the block's scores."""
    return 4 * (br * max_dh + bc * max_dh + br * bc)


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
    # As in the reference, A of all (batch, head) pairs may not fit one storage binding.
    per_pair = tq * tk * 4
    chunk = max(1, min(bsz * heads, ops.rt.caps.max_binding_bytes // per_pair))
    scores_p = ops.pipeline(v, "scores")
    stats_p = ops.pipeline(v, "row_stats")
    sum_p = ops.pipeline(v, "weighted_sum")
    for bh0 in range(0, bsz * heads, chunk):
        nbh = min(chunk, bsz * heads - bh0)
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
    return o


def flash_applies(shape: dict) -> str | None:
    dh = shape.get("dh", 0)
    if dh > max(FLASH_MAX_DH):
        return f"supports head dims up to {max(FLASH_MAX_DH)} (got {dh})"
    return None


@register(
    "attention",
    "flash",
    doc="tiled attention with online softmax in f32 registers; the score matrix is never stored",
    constants={"BR": (8, 16, 32), "BC": (8, 16, 32, 64), "MAX_DH": FLASH_MAX_DH},
    applies=flash_applies,
)
def attention_flash(
    ops, v: Variant, consts: dict, q: Tensor, k: Tensor, vv: Tensor, heads: int, causal: bool, scale: float
) -> Tensor:
    bsz, tq, width = q.shape
    tk = k.shape[1]
    dh = width // heads
    max_dh = int(consts.get("MAX_DH") or min((d for d in FLASH_MAX_DH if d >= dh), default=0))
    if max_dh < dh:
        raise EngineError(f"attention/flash: MAX_DH={max_dh} is below the head dim {dh}; use a larger MAX_DH")
    br, bc = FLASH_BLOCKS[max_dh]
    br, bc = int(consts.get("BR", br)), int(consts.get("BC", bc))
    need = flash_workgroup_bytes(br, bc, max_dh)
    limit = int(ops.rt.caps.limits["max-compute-workgroup-storage-size"])
    if need > limit:
        raise EngineError(
            f"attention/flash: BR={br}, BC={bc}, MAX_DH={max_dh} need {need} bytes of workgroup "
            f"memory, above this adapter's max-compute-workgroup-storage-size of {limit}; "
            "choose smaller blocks in the profile"
        )
    o = ops.rt.empty((bsz, tq, width), ops.dtype)
    pipeline = ops.pipeline(v, BR=br, BC=bc, MAX_DH=max_dh)
    params = (heads, tq, tk, dh, width, width, int(causal), scale)
    ops.rt.dispatch(pipeline, "attention/flash", params, [q, k, vv, o], (math.ceil(tq / br), bsz * heads, 1))
    return o
