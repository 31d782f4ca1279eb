"""The fused group_norm, row layer_norm and tiled linear variants against numpy and against the
reference variant, on fresh random inputs with outputs poisoned with NaN.

Tolerances as in test_kernels.py: fp32 within 2e-5 relative (to the largest reference
magnitude) of float64 numpy on the same inputs, fp16 within 1e-2 relative of numpy on the
fp16-rounded inputs. Shapes are SD-like but small enough for lavapipe, plus odd sizes that
exercise every edge (K % 4 != 0, partial tiles, groups smaller than a workgroup)."""

from __future__ import annotations

import numpy as np
import pytest
from ci_support import F16_HINT, missing

from engine.gpu import GpuContext
from engine.kernels import PipelineCache, Rule, Selection, variants
from engine.ops import Ops

pytestmark = pytest.mark.gpu

TOL = {"f32": 2e-5, "f16": 1e-2, "f16s": 1e-2}
NP = {"f32": np.float32, "f16": np.float16, "f16s": np.float16}


@pytest.fixture(scope="module")
def rt(gpu):
    return GpuContext(gpu, poison=True)


def make_ops(rt, gpu, dtype, choices):
    return Ops(rt, PipelineCache(gpu), Selection.forcing(gpu.caps.features, choices), dtype)


def need_f16(gpu, dtype):
    if dtype == "f16" and not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)


@pytest.fixture(params=["f32", "f16", "f16s"])
def dtype(request, gpu):
    need_f16(gpu, request.param)
    return request.param


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def q(dtype, a):
    """The value the kernel actually sees: rounded to the storage type, then float64."""
    return np.asarray(a, dtype=NP[dtype]).astype(np.float64)


def rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


def np_group_norm(x, groups, eps):
    """float64 group normalisation without the affine."""
    xr = x.reshape(x.shape[0], groups, -1)
    return ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + eps)).reshape(x.shape)


def apart(x: np.ndarray, groups: int, gap: float = 1.0) -> np.ndarray:
    """Groups of two elements a, b kept at least `gap` apart. Each normalizes to +/-d/sqrt(d^2 +
    eps), d = (a - b)/2, whose slope at d = 0 is 1/sqrt(eps) (1000 for eps 1e-6): on a pair a
    few thousandths apart, f32's rounding of a and b alone (~5e-7) moves the output by more than
    the 2e-5 tolerance (one seed of fresh inputs failed at 2.9e-5). That case tests the layout of
    tiny groups, not cancellation, so its pairs avoid the ill-conditioned band on purpose: with
    |a - b| >= 1 the slope is below 1e-5 and the bound holds for every seed."""
    pairs = x.reshape(x.shape[0], groups, 2).copy()  # (B, groups, 2)
    d = pairs[..., 1] - pairs[..., 0]
    close = np.abs(d) < gap
    pairs[..., 1] = np.where(close, pairs[..., 0] + np.where(d < 0, -gap, gap), pairs[..., 1])
    return pairs.reshape(x.shape).astype(np.float32)


def run_both(rt, gpu, dtype, op, variant, call):
    """(variant output, reference output) as float64, the variant's run checked to be the one
    that ran and to leave no poisoned element."""
    outs = []
    for name in (variant, "reference"):
        ops = make_ops(rt, gpu, dtype, {op: name})
        y = rt.read(call(ops)).astype(np.float64)
        assert np.isfinite(y).all(), f"{op}/{name} left poisoned (NaN) elements or overflowed"
        assert [d.variant for d in ops.selection.decisions.values()] == [name]
        outs.append(y)
    return outs


@pytest.mark.parametrize(
    "c,groups,hw,silu",
    [
        (320, 32, (32, 32), True),  # SD UNet block, 10 channels x 1024 pixels per group
        (128, 32, (48, 48), False),  # VAE-like, 4 channels per group
        (6, 3, (5, 7), True),  # odd sizes, group (70) smaller than a workgroup
        (9, 3, (5, 7), False),  # groups of an odd count (105): stored an element at a time, not in pairs
        (64, 32, (1, 1), False),  # 2 elements per group
    ],
)
@pytest.mark.parametrize("variant", ["fused", "split", "split4"])
def test_group_norm_variant(rt, gpu, dtype, fresh_rng, variant, c, groups, hw, silu):
    eps = 1e-5 if c > 64 else 1e-6
    x = rand(fresh_rng, 2, c, *hw, scale=3.0) + 1.5
    if c // groups * hw[0] * hw[1] == 2:
        x = apart(x, groups)
    g, b = rand(fresh_rng, c) + 1, rand(fresh_rng, c)

    def call(ops):
        return ops.group_norm(*(rt.upload(a, dtype) for a in (x, g, b)), groups, eps, silu)

    got, ref_gpu = run_both(rt, gpu, dtype, "group_norm", variant, call)
    ref = np_group_norm(q(dtype, x), groups, eps)
    ref = ref * q(dtype, g)[None, :, None, None] + q(dtype, b)[None, :, None, None]
    if silu:
        ref = ref / (1 + np.exp(-ref))
    assert rel_err(got, ref) <= TOL[dtype], f"{variant} vs numpy"
    assert rel_err(got, ref_gpu) <= TOL[dtype], f"{variant} vs reference variant"


@pytest.mark.parametrize("variant", ["fused", "split", "split4"])
def test_group_norm_large_offset(rt, gpu, fresh_rng, variant):
    """A group whose mean dwarfs its spread: one-pass E[x^2] - E[x]^2 would lose it in f32."""
    x = rand(fresh_rng, 1, 32, 16, 16) + 300.0
    g, b = np.ones(32, np.float32), np.zeros(32, np.float32)
    ops = make_ops(rt, gpu, "f32", {"group_norm": variant})
    y = ops.group_norm(*(rt.upload(a, "f32") for a in (x, g, b)), 8, 1e-5)
    ref = np_group_norm(x.astype(np.float64), 8, 1e-5)
    assert rel_err(rt.read(y).astype(np.float64), ref) <= 1e-4  # the inputs themselves carry f32 rounding of ~300 * 6e-8


@pytest.mark.parametrize("variant", ["split", "split4"])
@pytest.mark.parametrize("chunk", [1024, 16384])
@pytest.mark.parametrize("c,groups,hw", [(128, 32, (48, 48)), (6, 3, (5, 7)), (64, 4, (33, 35)), (64, 4, (36, 35))])
def test_group_norm_split_chunks(rt, gpu, fresh_rng, variant, chunk, c, groups, hw):
    """split's statistics merged over many chunks, a partial last chunk (at 36x35 and CHUNK 1024
    split4's last chunk has 176 vec4s: invocations with none), and one chunk; split4 runs split
    where H*W is not divisible by 4 (5x7, 33x35)."""
    x = rand(fresh_rng, 2, c, *hw, scale=2.0) - 0.7
    g, b = rand(fresh_rng, c) + 1, rand(fresh_rng, c)
    ops = make_ops(rt, gpu, "f32", {})
    v = variants("group_norm")[variant]
    y = v.launch(ops, v, {"CHUNK": chunk}, *(rt.upload(a, "f32") for a in (x, g, b)), groups, 1e-5, False)
    ref = np_group_norm(x.astype(np.float64), groups, 1e-5) * g[None, :, None, None] + b[None, :, None, None]
    assert rel_err(rt.read(y).astype(np.float64), ref) <= TOL["f32"]


@pytest.mark.parametrize(
    "rows,d,wg",
    [
        (2 * 77, 768, None),  # CLIP's final norm, both prompts
        (2 * 1024, 320, None),  # an SD transformer block at 32x32 latents
        (2 * 64, 32, 32),  # the tiny model's, 32 rows per workgroup
        (3, 1000, 128),  # fewer rows than one workgroup, D not a power of two
        (130, 64, 64),  # a row past a workgroup
    ],
)
def test_layer_norm_row(rt, gpu, dtype, fresh_rng, rows, d, wg):
    x = rand(fresh_rng, rows, d, scale=2.0) + 0.5
    g, b = rand(fresh_rng, d) + 1, rand(fresh_rng, d)

    outs = {}
    for variant in ("row", "reference"):
        constants = (("WG", wg),) if variant == "row" and wg is not None else ()
        ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features),
                                                    [Rule("layer_norm", variant, constants=constants)]), dtype)
        y = rt.read(ops.layer_norm(*(rt.upload(a, dtype) for a in (x, g, b)), 1e-5)).astype(np.float64)
        assert np.isfinite(y).all(), f"layer_norm/{variant} left poisoned (NaN) elements"
        assert [d.variant for d in ops.selection.decisions.values()] == [variant]
        outs[variant] = y
    got, ref_gpu = outs["row"], outs["reference"]
    xq = q(dtype, x)
    ref = (xq - xq.mean(-1, keepdims=True)) / np.sqrt(xq.var(-1, keepdims=True) + 1e-5) * q(dtype, g) + q(dtype, b)
    assert rel_err(got, ref) <= TOL[dtype], "row vs numpy"
    assert rel_err(got, ref_gpu) <= TOL[dtype], "row vs reference variant"


@pytest.mark.parametrize(
    "dtype,m,k,n,bias",
    [
        ("f32", 512, 320, 1280, True),  # SD feed-forward in, fewer tokens
        ("f32", 154, 768, 96, False),  # CLIP-length rows, cross-attention K
        ("f16", 154, 768, 96, False),
        ("f16", 256, 640, 320, True),
        ("f32", 77, 37, 45, True),  # K % 4 != 0: scalar loads, partial tiles
        ("f16", 77, 37, 45, True),
        ("f32", 3, 5, 2, False),  # smaller than one tile in every direction
        ("f16", 3, 5, 2, False),
        ("f32", 65, 36, 67, True),  # vec4 loads, one row and column past a tile
        # f16-storage: even N stores pairs of columns as whole words (with a partial last tile),
        # odd N halves one at a time
        ("f16s", 65, 36, 66, True),
        ("f16s", 77, 37, 45, True),
    ],
)
def test_linear_tiled(rt, gpu, fresh_rng, dtype, m, k, n, bias):
    need_f16(gpu, dtype)
    check_linear(rt, gpu, fresh_rng, dtype, "tiled", m, k, n, bias)


def check_linear(rt, gpu, rng, dtype, variant, m, k, n, bias):
    """`variant` of linear on (m, k) x (n, k)^T [+ b] against numpy and the reference variant."""
    x, w, b = rand(rng, m, k), rand(rng, n, k, scale=k**-0.5), rand(rng, n)

    def call(ops):
        bt = rt.upload(b, dtype) if bias else None
        return ops.linear(rt.upload(x, dtype), rt.upload(w, dtype), bt)

    got, ref_gpu = run_both(rt, gpu, dtype, "linear", variant, call)
    ref = q(dtype, x) @ q(dtype, w).T + (q(dtype, b) if bias else 0)
    assert rel_err(got, ref) <= TOL[dtype], f"{variant} vs numpy"
    assert rel_err(got, ref_gpu) <= TOL[dtype], f"{variant} vs reference variant"


@pytest.mark.parametrize(
    "m,k,n,bias",
    [
        (2, 1280, 640, True),  # SD's time-embedding projections: batch rows, many columns
        (1, 320, 1280, True),
        (4, 96, 40, False),  # as many rows as a workgroup keeps sums for
        (3, 37, 45, True),  # K past a multiple of the 64 invocations per column; a partial workgroup of columns
        (2, 1000, 6, False),  # K's last pass partial: some of its 4 loads in flight past K
    ],
)
def test_linear_rows(rt, gpu, fresh_rng, dtype, m, k, n, bias):
    check_linear(rt, gpu, fresh_rng, dtype, "rows", m, k, n, bias)


@pytest.mark.parametrize("b,c,hw,n,bias", [(2, 32, (8, 8), 32, True), (1, 40, (4, 6), 24, False), (2, 20, (5, 4), 12, True)])
def test_linear_to_channels_gemm(rt, gpu, fresh_rng, dtype, b, c, hw, n, bias):
    """A transformer's output projection written channel-major with the residual added, by the
    GEMM core in one product, against numpy and against a linear, a transpose and an add."""
    if dtype != "f32" and not gpu.caps.has_f16:
        missing("the GEMM core computes in f16", F16_HINT)
    t = hw[0] * hw[1]
    x, w, bv, r = rand(fresh_rng, b, t, c), rand(fresh_rng, n, c, 1, 1, scale=c**-0.5), rand(fresh_rng, n), \
        rand(fresh_rng, b, n, *hw)

    def call(ops):
        return ops.linear_to_channels(rt.upload(x, dtype), rt.upload(w, dtype), rt.upload(bv, dtype) if bias else None,
                                      rt.upload(r, dtype))

    fused, unfused = (make_ops(rt, gpu, dtype, {"linear_nchw": name}) for name in ("gemm", "reference"))
    got, ref_gpu = (rt.read(call(ops)).astype(np.float64) for ops in (fused, unfused))
    assert np.isfinite(got).all(), "gemm left poisoned (NaN) elements"
    assert [d.variant for d in fused.selection.decisions.values()] == ["gemm"]  # one product, nothing after
    y = q(dtype, x) @ q(dtype, w).reshape(n, c).T + (q(dtype, bv) if bias else 0)  # (B, T, N)
    ref = y.transpose(0, 2, 1).reshape(b, n, *hw) + q(dtype, r)
    assert got.shape == (b, n, *hw)
    assert rel_err(got, ref) <= TOL[dtype], "gemm vs numpy"
    assert rel_err(got, ref_gpu) <= TOL[dtype], "gemm vs linear, transpose and add"


def test_linear_rows_refuses_more_rows_than_it_keeps_sums_for(rt, gpu):
    ops = make_ops(rt, gpu, "f32", {"linear": "rows"})
    with pytest.warns(UserWarning, match="at most 4 rows"):
        y = ops.linear(rt.upload(np.ones((5, 8), np.float32), "f32"), rt.upload(np.ones((4, 8), np.float32), "f32"))
    assert np.array_equal(rt.read(y), np.full((5, 4), 8.0, np.float32))  # the reference ran it
    assert [d.variant for d in ops.selection.decisions.values()] == ["reference"]


def test_linear_tiled_rows_below_a_tile_run_tiles_of_their_height(rt, gpu, fresh_rng, monkeypatch):
    """A product of few rows (SD's attention on its 4x4, 2x2 and 1x1 maps: 16, 4 and 1 tokens)
    runs in tiles of the next multiple-of-4 height rather than the default 64 (padding every
    invocation would multiply through K), exactly; 65 rows keep the 64-row tiles."""
    cache, seen = PipelineCache(gpu), []
    get = cache.get
    monkeypatch.setattr(cache, "get", lambda v, dtype, constants=None, entry=None:
                        seen.append((constants or {}).get("TILE_M")) or get(v, dtype, constants, entry))
    ops = Ops(rt, cache, Selection(frozenset(gpu.caps.features), [Rule("linear", "tiled")]), "f32")
    for m, want in ((1, 4), (4, 4), (7, 8), (16, 16), (20, 32), (65, 64)):
        x, w = rand(fresh_rng, m, 40), rand(fresh_rng, 36, 40, scale=40**-0.5)
        y = rt.read(ops.linear(rt.upload(x, "f32"), rt.upload(w, "f32"))).astype(np.float64)
        assert seen[-1] == want, (m, seen)
        assert rel_err(y, q("f32", x) @ q("f32", w).T) <= TOL["f32"], m


@pytest.mark.parametrize("tiles", [(32, 32, 8), (32, 64, 32), (64, 32, 16)])
@pytest.mark.parametrize("k", [24, 19])
def test_linear_tiled_constants(rt, gpu, fresh_rng, tiles, k):
    """Every tile shape a tuner may choose is exact, on both load paths."""
    tm, tn, tk = tiles
    m, n = 70, 90
    x, w = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5)
    sel = Selection(
        frozenset(gpu.caps.features),
        [Rule("linear", "tiled", constants=(("TILE_M", tm), ("TILE_N", tn), ("TILE_K", tk)))],
    )
    ops = Ops(rt, PipelineCache(gpu), sel, "f32")
    y = rt.read(ops.linear(rt.upload(x, "f32"), rt.upload(w, "f32"))).astype(np.float64)
    assert np.isfinite(y).all()
    assert rel_err(y, x.astype(np.float64) @ w.astype(np.float64).T) <= TOL["f32"]


@pytest.mark.parametrize(
    "m,k,n,bias,tiles",
    [
        (512, 320, 1280, True, {}),  # SD feed-forward in, fewer tokens
        (154, 768, 96, False, {}),  # CLIP-length rows, cross-attention K
        (130, 2560, 70, True, {"TILE_K": 32}),  # SD's longest K (feed-forward out), longest f16 partial sums
        (77, 37, 45, True, {}),  # K % 4 != 0: the f32 tiled kernel serves it
        (3, 4, 2, False, {}),  # smaller than one tile in every direction
        (65, 36, 67, True, {"TILE_M": 32, "TILE_N": 64, "TILE_K": 8}),  # one row and column past a tile
        (70, 24, 90, False, {"TILE_M": 64, "TILE_N": 32, "TILE_K": 16}),
    ],
)
def test_linear_tiled_f16(rt, gpu, fresh_rng, m, k, n, bias, tiles):
    need_f16(gpu, "f16")
    x, w, b = rand(fresh_rng, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features),
              [Rule("linear", "tiled_f16", constants=tuple(tiles.items()))]), "f16")
    y = ops.linear(rt.upload(x, "f16"), rt.upload(w, "f16"), rt.upload(b, "f16") if bias else None)
    got = rt.read(y).astype(np.float64)
    assert np.isfinite(got).all(), "tiled_f16 left poisoned (NaN) elements or overflowed"
    assert [d.variant for d in ops.selection.decisions.values()] == ["tiled_f16"]
    ref = q("f16", x) @ q("f16", w).T + (q("f16", b) if bias else 0)
    assert rel_err(got, ref) <= TOL["f16"], "tiled_f16 vs numpy"
    ref_ops = make_ops(rt, gpu, "f16", {"linear": "reference"})
    ref_gpu = rt.read(ref_ops.linear(rt.upload(x, "f16"), rt.upload(w, "f16"),
                                     rt.upload(b, "f16") if bias else None)).astype(np.float64)
    assert rel_err(got, ref_gpu) <= TOL["f16"], "tiled_f16 vs reference variant"


def test_linear_tiled_f16_runs_f32_models_in_f32(rt, gpu, fresh_rng):
    """On an f16-capable adapter an f32 model keeps f32 arithmetic (the f32 tiled kernel)."""
    need_f16(gpu, "f16")
    x, w = rand(fresh_rng, 40, 64), rand(fresh_rng, 24, 64, scale=64**-0.5)
    ops = make_ops(rt, gpu, "f32", {"linear": "tiled_f16"})
    got = rt.read(ops.linear(rt.upload(x, "f32"), rt.upload(w, "f32"))).astype(np.float64)
    assert rel_err(got, x.astype(np.float64) @ w.astype(np.float64).T) <= TOL["f32"]
