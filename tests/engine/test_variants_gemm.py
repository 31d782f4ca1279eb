"""The GEMM core (shaders/linear/gemm.wgsl, and gemm_f32.wgsl for f32 models) against numpy and
the reference linear variant, on fresh random inputs with outputs poisoned with NaN: the linear
variant "gemm" at every tile setting a tuner may pick, partial tiles in M, N and K, and the
core's other forms (a batch with a shared operand, B stored K x N, bias per row, a residual,
SiLU and GELU in the epilogue, split K).

Tolerances as in test_variants_norm_linear.py, relative to the largest reference magnitude: f16
within 1e-2 of float64 numpy on the fp16-rounded inputs, f32 within 2e-5."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from script_support import load_script

from engine.errors import EngineError
from engine.gpu import GpuContext
from engine.kernels import PipelineCache, Rule, Selection
from engine.ops import Ops
from engine.variants import gemm as core

pytestmark = pytest.mark.gpu

TOL = {"f16": 1e-2, "f32": 2e-5, "f16s": 1e-2}
NP = {"f16": np.float16, "f32": np.float32, "f16s": np.float16}


@pytest.fixture(scope="module")
def rt(gpu):
    return GpuContext(gpu, poison=True)


@pytest.fixture(params=["f16", "f32", "f16s"])
def dtype(request, gpu):
    if request.param == "f16" and not gpu.caps.has_f16:
        pytest.fail("this adapter lacks shader-f16 (lavapipe and every GPU the farm targets have it)")
    return request.param


def ops_for(rt, gpu, rules=(), dtype="f16"):
    return Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features), list(rules)), dtype)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def h(a, dtype="f16"):
    """What the kernel sees: rounded to the storage type, as float64."""
    return np.asarray(a, dtype=NP[dtype]).astype(np.float64)


def rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


def gelu(v):
    from math import erf

    return 0.5 * v * (1.0 + np.vectorize(erf)(v / math.sqrt(2.0)))


def fits(gpu, tiles, dtype="f16") -> bool:
    try:
        core.check_tiles({**core.DEFAULTS, **tiles}, gpu.caps.limits, dtype)
    except EngineError:
        return False
    return True


@pytest.mark.parametrize("tiles", [{}, *core.CANDIDATES], ids=lambda t: "x".join(map(str, t.values())) or "defaults")
@pytest.mark.parametrize(
    "m,k,n,bias",
    [
        (512, 320, 256, True),  # SD's attention projections, fewer tokens
        (154, 768, 96, False),  # CLIP-length rows: a partial tile in M
        (130, 2560, 68, True),  # SD's longest K; N a multiple of 4 but not of any tile
        (3, 12, 4, True),  # smaller than one tile in every direction, K shorter than TILE_K
        (2, 1280, 320, True),  # SD's time-embedding projections: two rows, long K (split-K's case)
    ],
)
def test_linear_gemm(rt, gpu, fresh_rng, dtype, m, k, n, bias, tiles):
    x, w, b = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=tuple(tiles.items()))], dtype)
    if not fits(gpu, tiles, dtype):  # less workgroup memory than the setting needs: refused, never run
        with pytest.raises(EngineError, match="workgroup memory"):
            ops.linear(rt.upload(x, dtype), rt.upload(w, dtype))
        return
    got = rt.read(ops.linear(rt.upload(x, dtype), rt.upload(w, dtype),
                             rt.upload(b, dtype) if bias else None)).astype(np.float64)
    assert np.isfinite(got).all(), "gemm left poisoned (NaN) elements or overflowed"
    assert [d.variant for d in ops.selection.decisions.values()] == ["gemm"]
    ref = h(x, dtype) @ h(w, dtype).T + (h(b, dtype) if bias else 0)
    assert rel_err(got, ref) <= TOL[dtype], "gemm vs numpy"
    ref_ops = Ops(rt, PipelineCache(gpu), Selection.forcing(gpu.caps.features, {"linear": "reference"}), dtype)
    ref_gpu = rt.read(ref_ops.linear(rt.upload(x, dtype), rt.upload(w, dtype),
                                     rt.upload(b, dtype) if bias else None)).astype(np.float64)
    assert rel_err(got, ref_gpu) <= TOL[dtype], "gemm vs the reference variant"


# Two settings, each a compile per element type on lavapipe (about 2 s cold): the no-prefetch
# path rides with the 4-way split rather than having a setting of its own. (The tuner also tries
# FLUSH 2 beside every TILE_K 16 setting that test_linear_gemm runs: these cases cover the pairs
# loop, so that list does not run again with it.)
@pytest.mark.parametrize("tiles", [{"FLUSH": 2, "SPLIT_K": 2},
                                   {"FLUSH": 2, "SPLIT_K": 4, "COLS": 4, "TILE_M": 32, "PREFETCH": 0}],
                         ids=["pairs-split-K-2", "pairs-split-K-4-8x4-no-prefetch"])
@pytest.mark.parametrize("m,k,n", [(130, 80, 68), (3, 12, 4)], ids=["5-slabs", "one-short-slab"])
def test_flush_2_sums_the_slabs_in_pairs(rt, gpu, fresh_rng, dtype, m, k, n, tiles):
    """FLUSH 2 runs the slabs two at a time: an odd number of slabs (a pair's second staged as
    zeros), splits of K whose shares are odd (5 slabs in 2 splits: 3 and 2; in 4: 2, 2, 1, 0),
    fewer slabs than a pair (one short slab: shares of 1 and 0), with and without the next
    slab's prefetch; against numpy, outputs poisoned."""
    x, w, b = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=tuple(tiles.items()))], dtype)
    got = rt.read(ops.linear(rt.upload(x, dtype), rt.upload(w, dtype), rt.upload(b, dtype))).astype(np.float64)
    assert np.isfinite(got).all(), "gemm left poisoned (NaN) elements or overflowed"
    assert [d.variant for d in ops.selection.decisions.values()] == ["gemm"]
    assert rel_err(got, h(x, dtype) @ h(w, dtype).T + h(b, dtype)) <= TOL[dtype]


def test_the_tuner_tries_flush_2_where_the_core_sums_in_f16_and_only_there():
    """FLUSH 2 beside the defaults and every TILE_K 16 candidate of the core's users where the call
    computes in f16; in f32 and f16-storage (f32 sums, nothing to flush) the list is as before.
    Every setting is one the core accepts."""
    from engine.kernels import variants
    from engine.tune import _settings

    for op, name in (("linear", "gemm"), ("linear_nchw", "gemm"), ("conv2d", "im2col"), ("conv2d", "pointwise"),
                     ("conv2d", "winograd_2x2")):
        v = variants(op)[name]
        f16, f32, f16s = (_settings(v, dtype) for dtype in ("f16", "f32", "f16s"))
        assert f32 == f16s == [{}, *v.candidates], (op, name)
        assert all(c.get("FLUSH", 1) == 1 for c in f32), (op, name)
        flush2 = [c for c in f16 if c.get("FLUSH") == 2]
        assert f16 == [*f32, *flush2] and {"FLUSH": 2} in flush2, (op, name)
        without = {json.dumps({k: x for k, x in c.items() if k != "FLUSH"}, sort_keys=True) for c in flush2}
        assert without == {json.dumps(c, sort_keys=True) for c in f32 if c.get("TILE_K", 16) == 16}, (op, name)
        for c in f16:
            core.check_tiles({**core.DEFAULTS, **{k: x for k, x in c.items() if k != "PRETRANSFORM"}},
                             {"max-compute-workgroup-storage-size": 1 << 20, "max-compute-invocations-per-workgroup": 1024},
                             "f16")


def test_linear_gemm_falls_back_where_the_core_cannot_run(rt, gpu, fresh_rng, dtype):
    """K % 4 != 0: the tiled kernels serve the call, still correct."""
    x, w = rand(fresh_rng, 77, 37), rand(fresh_rng, 45, 37, scale=37**-0.5)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=(("TILE_M", 128), ("TILE_N", 128)))], dtype)
    got = rt.read(ops.linear(rt.upload(x, dtype), rt.upload(w, dtype))).astype(np.float64)
    assert rel_err(got, h(x, dtype) @ h(w, dtype).T) <= TOL[dtype]


def test_the_f32_core_is_generated_from_the_f16_core():
    """shaders/linear/gemm_f32.wgsl is scripts/make_gemm_f32.py's output for today's gemm.wgsl."""
    gen = load_script("scripts/make_gemm_f32.py")
    assert gen.DST.read_text() == gen.f32_core(gen.SRC.read_text()), "run python scripts/make_gemm_f32.py"
    assert "f16" not in gen.DST.read_text().replace("slabs summed in f16", "")


@pytest.mark.parametrize("split", [1, 4, 32], ids=["whole-K", "split-K-4", "split-K-32-more-than-slabs"])
@pytest.mark.parametrize("b_kn", [False, True], ids=["B_NxK", "B_KxN"])
def test_gemm_core_batched_forms(rt, gpu, fresh_rng, dtype, b_kn, split):
    """A batch of 3 products with A shared (stride 0), B per item in either layout, bias per
    row (a 1x1 convolution's), a residual and SiLU; whole or split K (the epilogue then runs in
    the reduction)."""
    batch, m, n, k = 3, 72, 100, 48
    a = rand(fresh_rng, m, k, scale=k**-0.5)
    bmat = rand(fresh_rng, batch, k, n) if b_kn else rand(fresh_rng, batch, n, k)
    bias, res = rand(fresh_rng, m), rand(fresh_rng, batch, m, n)
    ops = ops_for(rt, gpu, dtype=dtype)
    y = core.gemm(ops, {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": split}, rt.upload(a, dtype),
                  rt.upload(bmat, dtype), m, n, k, batch=batch, b_kn=b_kn, bias=rt.upload(bias, dtype),
                  bias_on_m=True, residual=rt.upload(res, dtype), act="silu", strides=(0, n * k, m * n))
    got = rt.read(y).astype(np.float64)
    assert got.shape == (batch, m, n)
    bt = h(bmat, dtype) if b_kn else h(bmat, dtype).transpose(0, 2, 1)
    pre = h(a, dtype)[None] @ bt + h(bias, dtype)[None, :, None] + h(res, dtype)
    ref = pre / (1.0 + np.exp(-pre))
    assert np.isfinite(got).all()
    assert rel_err(got, ref) <= TOL[dtype]


def test_gemm_core_gelu_epilogue(rt, gpu, fresh_rng):
    m, n, k = 40, 64, 32
    a, b, bias = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    y = core.gemm(ops_for(rt, gpu), {}, rt.upload(a, "f16"), rt.upload(b, "f16"), m, n, k,
                  bias=rt.upload(bias, "f16"), act="gelu")
    pre = h(a) @ h(b).T + h(bias)
    assert rel_err(rt.read(y).astype(np.float64), gelu(pre)) <= TOL["f16"]


@pytest.mark.parametrize("tiles,why", [
    ({"TILE_M": 40, "TILE_N": 64, "TILE_K": 16}, "multiples of 16"),
    ({"TILE_M": 32, "TILE_N": 64, "TILE_K": 32}, "at most half"),
    ({"SPLIT_K": 3}, "SPLIT_K=3 is not one of"),
    ({"TILE_X": 3}, "unknown constant TILE_X"),
])
def test_gemm_core_refuses_settings_it_cannot_take(rt, gpu, fresh_rng, tiles, why):
    a, b = rand(fresh_rng, 8, 8), rand(fresh_rng, 8, 8)
    with pytest.raises(EngineError, match=why):
        core.gemm(ops_for(rt, gpu), tiles, rt.upload(a, "f16"), rt.upload(b, "f16"), 8, 8, 8)


def test_gemm_core_refuses_what_the_adapter_cannot_hold():
    tiles = {"TILE_M": 128, "TILE_N": 128, "TILE_K": 32}
    with pytest.raises(EngineError, match="workgroup memory"):
        core.check_tiles(tiles, {"max-compute-workgroup-storage-size": 16384,
                                 "max-compute-invocations-per-workgroup": 256})
    core.check_tiles(tiles, {"max-compute-workgroup-storage-size": 49152,
                             "max-compute-invocations-per-workgroup": 256})


@pytest.mark.parametrize("variant,dispatches", [("gemm", 1), ("tiled", 2)])
def test_linear_adds_the_residual_in_the_epilogue_where_it_can(rt, gpu, fresh_rng, dtype, variant, dispatches):
    """Ops.linear(..., residual=r): the core adds r in its epilogue (one dispatch); a variant
    without an epilogue gets an add after it (two). Both equal x w^T + b + r."""
    x, w, b, r = rand(fresh_rng, 2, 40, 64), rand(fresh_rng, 48, 64, scale=0.125), rand(fresh_rng, 48), \
        rand(fresh_rng, 2, 40, 48)
    ops = Ops(rt, PipelineCache(gpu), Selection.forcing(gpu.caps.features, {"linear": variant}), dtype)
    xt, wt, bt, res = (rt.upload(a, dtype) for a in (x, w, b, r))
    before = rt.dispatches
    got = rt.read(ops.linear(xt, wt, bt, residual=res)).astype(np.float64)
    assert rt.dispatches - before == dispatches
    assert got.shape == (2, 40, 48)
    assert rel_err(got, h(x, dtype) @ h(w, dtype).T + h(b, dtype) + h(r, dtype)) <= TOL[dtype]
    with pytest.raises(ValueError, match="residual"):
        ops.linear(xt, wt, bt, residual=xt)


@pytest.mark.parametrize("tiles", [{}, {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16, "PREFETCH": 0},
                                   {"TILE_M": 128, "TILE_N": 128, "TILE_K": 16}],
                         ids=lambda t: "x".join(map(str, t.values())) or "defaults")
@pytest.mark.parametrize("m,f,k", [
    (70, 100, 48),  # partial tiles in M and in both halves of N (F not a multiple of TILE_N / 2)
    (256, 320, 320),  # SD's 64x64 level feed-forward, fewer tokens
    (3, 4, 12),  # one output vec4, K shorter than TILE_K
])
def test_linear_geglu_in_the_epilogue(rt, gpu, fresh_rng, dtype, m, f, k, tiles):
    """Ops.linear_geglu with the core's GEGLU epilogue: each tile stages the value rows of its
    output columns and their gate rows, and writes value * GELU(gate); against numpy (exact
    erf GELU) and against the unfused projection followed by the geglu kernel."""
    x, w, b = rand(fresh_rng, 2, m, k), rand(fresh_rng, 2 * f, k, scale=k**-0.5), rand(fresh_rng, 2 * f)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=tuple(tiles.items()))], dtype)
    assert ops.selection.variant("linear", {"m": 2 * m, "n": 2 * f, "k": k}).launch.fuses_geglu(tiles, 2 * f, k)
    xs, ws, bs = rt.upload(x, dtype), rt.upload(w, dtype), rt.upload(b, dtype)
    if not fits(gpu, tiles, dtype):  # less workgroup memory than the setting needs: refused, never run
        with pytest.raises(EngineError, match="workgroup memory"):
            ops.linear_geglu(xs, ws, bs)
        return
    got = rt.read(ops.linear_geglu(xs, ws, bs)).astype(np.float64)
    assert got.shape == (2, m, f)
    assert np.isfinite(got).all(), "the GEGLU epilogue left poisoned (NaN) elements"
    pre = h(x, dtype) @ h(w, dtype).T + h(b, dtype)
    ref = pre[..., :f] * gelu(pre[..., f:])
    assert rel_err(got, ref) <= TOL[dtype], "GEGLU epilogue vs numpy"
    unfused = rt.read(ops.geglu(ops.linear(xs, ws, bs))).astype(np.float64)
    assert rel_err(got, unfused) <= TOL[dtype], "GEGLU epilogue vs linear + geglu"


@pytest.mark.parametrize("tiles", [{"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "COLS": 4},
                                   {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 4}],
                         ids=["COLS-4", "split-K"])
def test_linear_geglu_unfused_where_the_setting_cannot_take_it(rt, gpu, fresh_rng, tiles):
    """A setting whose invocations hold one column half (COLS 4) or whose epilogue runs in the
    split-K reduction cannot gate in the epilogue: the projection runs as selected and geglu after
    it, with the same result; the core itself refuses the gated form by name."""
    m, f, k = 40, 64, 96
    x, w, b = rand(fresh_rng, m, k), rand(fresh_rng, 2 * f, k, scale=k**-0.5), rand(fresh_rng, 2 * f)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=tuple(tiles.items()))])
    assert not ops.selection.variant("linear", {"m": m, "n": 2 * f, "k": k}).launch.fuses_geglu(tiles, 2 * f, k)
    xs, ws, bs = rt.upload(x, "f16"), rt.upload(w, "f16"), rt.upload(b, "f16")
    got = rt.read(ops.linear_geglu(xs, ws, bs)).astype(np.float64)
    pre = h(x) @ h(w).T + h(b)
    assert rel_err(got, pre[..., :f] * gelu(pre[..., f:])) <= TOL["f16"]
    with pytest.raises(EngineError, match="GEGLU epilogue needs COLS 8 and SPLIT_K 1"):
        core.gemm(ops, tiles, xs, ws, m, 2 * f, k, bias=bs, gated=True)
