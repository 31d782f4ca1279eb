"""The GEMM core (shaders/linear/gemm.wgsl) against numpy and the reference linear variant, on
fresh random inputs with outputs poisoned with NaN: the linear variant "gemm" at every tile
setting a tuner may pick, partial tiles in M, N and K, and the core's other forms (a batch with
a shared operand, B stored K x N, bias per row, a residual, SiLU and GELU in the epilogue).

Tolerance as in test_variants_norm_linear.py: f16 within 1e-2 relative (to the largest
reference magnitude) of float64 numpy on the fp16-rounded inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.errors import EngineError
from engine.kernels import PipelineCache, Rule, Selection
from engine.ops import Ops
from engine.runtime import Runtime
from engine.variants import gemm as core

pytestmark = pytest.mark.gpu

TOL = 1e-2


@pytest.fixture(scope="module")
def rt(gpu):
    if not gpu.caps.has_f16:
        pytest.fail("the GEMM core runs f16 models only; this adapter lacks shader-f16 "
                    "(lavapipe and every GPU the farm targets have it)")
    return Runtime(gpu, poison=True)


def ops_for(rt, gpu, rules=()):
    return Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features), list(rules)), "f16")


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def h(a):
    return np.asarray(a, dtype=np.float16).astype(np.float64)


def rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


def gelu(v):
    from math import erf

    return 0.5 * v * (1.0 + np.vectorize(erf)(v / math.sqrt(2.0)))


def fits(gpu, tiles) -> bool:
    try:
        core.check_tiles({**core.DEFAULTS, **tiles}, gpu.caps.limits)
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
def test_linear_gemm(rt, gpu, fresh_rng, m, k, n, bias, tiles):
    x, w, b = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=tuple(tiles.items()))])
    if not fits(gpu, tiles):  # an adapter with 16 KiB of workgroup memory: refused, never run
        with pytest.raises(EngineError, match="workgroup memory"):
            ops.linear(rt.upload(x, "f16"), rt.upload(w, "f16"))
        return
    got = rt.read(ops.linear(rt.upload(x, "f16"), rt.upload(w, "f16"),
                             rt.upload(b, "f16") if bias else None)).astype(np.float64)
    assert np.isfinite(got).all(), "gemm left poisoned (NaN) elements or overflowed"
    assert [d.variant for d in ops.selection.decisions.values()] == ["gemm"]
    ref = h(x) @ h(w).T + (h(b) if bias else 0)
    assert rel_err(got, ref) <= TOL, "gemm vs numpy"
    ref_ops = Ops(rt, PipelineCache(gpu), Selection.forcing(gpu.caps.features, {"linear": "reference"}), "f16")
    ref_gpu = rt.read(ref_ops.linear(rt.upload(x, "f16"), rt.upload(w, "f16"),
                                     rt.upload(b, "f16") if bias else None)).astype(np.float64)
    assert rel_err(got, ref_gpu) <= TOL, "gemm vs the reference variant"


def test_linear_gemm_falls_back_where_the_core_cannot_run(rt, gpu, fresh_rng):
    """K % 4 != 0: the tiled kernels serve the call, still correct (an f32 model likewise)."""
    x, w = rand(fresh_rng, 77, 37), rand(fresh_rng, 45, 37, scale=37**-0.5)
    ops = ops_for(rt, gpu, [Rule("linear", "gemm", constants=(("TILE_M", 128), ("TILE_N", 128)))])
    got = rt.read(ops.linear(rt.upload(x, "f16"), rt.upload(w, "f16"))).astype(np.float64)
    assert rel_err(got, h(x) @ h(w).T) <= TOL
    f32 = Ops(rt, PipelineCache(gpu), Selection.forcing(gpu.caps.features, {"linear": "gemm"}), "f32")
    got32 = rt.read(f32.linear(rt.upload(x, "f32"), rt.upload(w, "f32"))).astype(np.float64)
    assert rel_err(got32, x.astype(np.float64) @ w.astype(np.float64).T) <= 2e-5


@pytest.mark.parametrize("split", [1, 4], ids=["whole-K", "split-K-4"])
@pytest.mark.parametrize("b_kn", [False, True], ids=["B_NxK", "B_KxN"])
def test_gemm_core_batched_forms(rt, gpu, fresh_rng, b_kn, split):
    """A batch of 3 products with A shared (stride 0), B per item in either layout, bias per
    row (a 1x1 convolution's), a residual and SiLU; whole or split K (the epilogue then runs in
    the reduction)."""
    batch, m, n, k = 3, 72, 100, 48
    a = rand(fresh_rng, m, k, scale=k**-0.5)
    bmat = rand(fresh_rng, batch, k, n) if b_kn else rand(fresh_rng, batch, n, k)
    bias, res = rand(fresh_rng, m), rand(fresh_rng, batch, m, n)
    ops = ops_for(rt, gpu)
    y = core.gemm(ops, {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": split}, rt.upload(a, "f16"), rt.upload(bmat, "f16"),
                  m, n, k, batch=batch, b_kn=b_kn, bias=rt.upload(bias, "f16"), bias_on_m=True,
                  residual=rt.upload(res, "f16"), act="silu", strides=(0, n * k, m * n))
    got = rt.read(y).astype(np.float64)
    assert got.shape == (batch, m, n)
    bt = h(bmat) if b_kn else h(bmat).transpose(0, 2, 1)
    pre = h(a)[None] @ bt + h(bias)[None, :, None] + h(res)
    ref = pre / (1.0 + np.exp(-pre))
    assert np.isfinite(got).all()
    assert rel_err(got, ref) <= TOL


def test_gemm_core_gelu_epilogue(rt, gpu, fresh_rng):
    m, n, k = 40, 64, 32
    a, b, bias = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    y = core.gemm(ops_for(rt, gpu), {}, rt.upload(a, "f16"), rt.upload(b, "f16"), m, n, k,
                  bias=rt.upload(bias, "f16"), act="gelu")
    pre = h(a) @ h(b).T + h(bias)
    assert rel_err(rt.read(y).astype(np.float64), gelu(pre)) <= TOL


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
