"""The optimized conv2d variants (implicit GEMM, Winograd F(4x4, 3x3)) against a float64 numpy
convolution and against the reference variant, on fresh random inputs, outputs poisoned.

Tolerances, relative to the largest reference magnitude: implicit GEMM sums the same products
as the reference in another order, so it gets the reference kernels' 2e-5 (fp32). Winograd's
transforms add rounding (measured by test_winograd_error_is_bounded: about 3-6x the direct
error, around 1e-5 at 320 channels), so it gets 1e-4 in fp32. fp16: 1e-2 for both, against
the reference computed from the fp16-rounded inputs (accumulation and transforms are f32).
"""

from __future__ import annotations

import numpy as np
import pytest
from ci_support import F16_HINT, missing

from engine.errors import EngineError
from engine.gpu import GpuContext
from engine.kernels import PipelineCache, Rule, Selection
from engine.ops import Ops
from engine.variants.conv2d import winograd_applies, winograd_pays

pytestmark = pytest.mark.gpu

TOL = {("implicit_gemm", "f32"): 2e-5, ("winograd", "f32"): 1e-4, ("implicit_gemm", "f16"): 1e-2, ("winograd", "f16"): 1e-2,
       ("winograd_2x2", "f16"): 1e-2, ("winograd_2x2", "f32"): 1e-4,
       ("pointwise", "f16"): 1e-2, ("pointwise", "f32"): 2e-5, ("im2col", "f16"): 1e-2, ("im2col", "f32"): 2e-5,
       ("narrow", "f32"): 2e-5, ("narrow", "f16"): 1e-2}
TOL.update({(v, "f16s"): 1e-2 for v, _ in list(TOL)})  # f16-storage: f16 rounding, f32 arithmetic
NP = {"f32": np.float32, "f16": np.float16, "f16s": np.float16}


@pytest.fixture(scope="module")
def rt(gpu):
    return GpuContext(gpu, poison=True)


@pytest.fixture(scope="module")
def pipelines(gpu):
    return PipelineCache(gpu)  # shared so each shader compiles once per module


def make_ops(rt, pipelines, dtype: str, variant: str, constants: dict | None = None) -> Ops:
    caps = rt.gpu.caps
    if dtype == "f16" and not caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    rule = Rule("conv2d", variant, constants=tuple(sorted((constants or {}).items())))
    selection = Selection(frozenset(caps.features), [rule], profile_name=f"test-{variant}")
    return Ops(rt, pipelines, selection, dtype)


def np_conv(x, w, b, stride, pads):
    """float64 direct convolution; x (B, Cin, H, W), w (Cout, Cin, KH, KW)."""
    pt, pb, pl, pr = pads
    xp = np.pad(x, ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    kh, kw = w.shape[2:]
    oh = (xp.shape[2] - kh) // stride + 1
    ow = (xp.shape[3] - kw) // stride + 1
    y = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for ky in range(kh):
        for kx in range(kw):
            patch = xp[:, :, ky : ky + stride * oh : stride, kx : kx + stride * ow : stride]
            y += np.einsum("bchw,oc->bohw", patch, w[:, :, ky, kx])
    return y + (0 if b is None else b[None, :, None, None])


def conv_inputs(rng, bsz, cin, cout, hw, k, bias=True):
    x = rng.standard_normal((bsz, cin, *hw)).astype(np.float32)
    w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32) if bias else None
    return x, w, b


def rel_err(got, ref) -> float:
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))


def run_and_compare(rt, pipelines, rng, variant, dtype, bsz, cin, cout, hw, k, stride, pads, bias=True, constants=None,
                    scratch_scale=1, residual=False):
    """Run `variant` and the reference on the same inputs; check both agreements. `residual`:
    with a residual of the output's shape added (Ops.conv2d's residual=); returns how many
    `add` kernels the variant's call launched for it (0 where its epilogue adds it)."""
    ops = make_ops(rt, pipelines, dtype, variant, constants)
    ops.scratch_scale = scratch_scale
    ref_ops = make_ops(rt, pipelines, dtype, "reference")
    x, w, b = conv_inputs(rng, bsz, cin, cout, hw, k, bias)
    xt, wt = rt.upload(x, dtype), rt.upload(w, dtype)
    bt = rt.upload(b, dtype) if bias else None
    oh, ow = ((hw[0] + pads[0] + pads[1] - k) // stride + 1, (hw[1] + pads[2] + pads[3] - k) // stride + 1)
    r = (rng.standard_normal((bsz, cout, oh, ow)) * 2).astype(np.float32) if residual else None
    rt_r = rt.upload(r, dtype) if residual else None
    adds = []
    plain_add = ops.add
    ops.add = lambda *a: adds.append(a) or plain_add(*a)
    y = rt.read(ops.conv2d(xt, wt, bt, stride=stride, padding=pads, residual=rt_r)).astype(np.float64)
    assert ops.selection.decisions, "the op did not go through the selection"
    assert next(iter(ops.selection.decisions.values())).variant == variant
    y_ref = rt.read(ref_ops.conv2d(xt, wt, bt, stride=stride, padding=pads, residual=rt_r)).astype(np.float64)

    def q(a):
        return None if a is None else np.asarray(a, dtype=NP[dtype]).astype(np.float64)

    expect = np_conv(q(x), q(w), q(b), stride, pads) + (q(r) if residual else 0)
    tol = TOL[(variant, dtype)]
    assert y.shape == expect.shape
    assert np.isfinite(y).all(), "kernel left poisoned (NaN) elements or overflowed"
    err_np, err_ref = rel_err(y, expect), rel_err(y, y_ref)
    assert err_np <= tol, f"{variant} vs numpy: max relative error {err_np:.3g} > {tol}"
    assert err_ref <= tol, f"{variant} vs reference variant: max relative error {err_ref:.3g} > {tol}"
    return len(adds)


@pytest.mark.parametrize("dtype", ["f16", "f32", "f16s"])
@pytest.mark.parametrize(
    "variant,bsz,cin,cout,hw,k,stride,pads,adds",
    [
        # in the epilogue: Winograd's output transform, the GEMM core's for 1x1 and im2col
        pytest.param("winograd_2x2", 2, 32, 20, (9, 7), 3, 1, (1, 1, 1, 1), 0, id="winograd_2x2"),
        pytest.param("winograd_2x2", 1, 32, 20, (8, 6), 3, 1, (1, 1, 1, 1), 0, id="winograd_2x2-even-width-pairs"),
        pytest.param("pointwise", 2, 64, 40, (8, 12), 1, 1, (0, 0, 0, 0), 0, id="pointwise"),
        pytest.param("im2col", 2, 64, 64, (16, 16), 3, 2, (0, 1, 0, 1), 0, id="im2col-stride2"),
        # by an add kernel after it: the fallbacks and the variants without such an epilogue
        pytest.param("winograd_2x2", 1, 5, 7, (9, 7), 3, 1, (1, 1, 1, 1), 1, id="winograd_2x2-cin5-falls-back"),
        pytest.param("pointwise", 1, 6, 5, (5, 5), 1, 1, (0, 0, 0, 0), 1, id="pointwise-odd-falls-back"),
        pytest.param("implicit_gemm", 1, 8, 12, (6, 6), 3, 1, (1, 1, 1, 1), 1, id="implicit_gemm"),
    ],
)
def test_a_residual_is_added_in_the_epilogue_where_the_variant_has_one(rt, pipelines, fresh_rng, dtype, variant, bsz,
                                                                       cin, cout, hw, k, stride, pads, adds):
    """A ResNet block's shortcut: conv(x) + b + r against numpy and the reference (which adds r
    by a kernel after it); the fusing variants launch no add of their own."""
    assert run_and_compare(rt, pipelines, fresh_rng, variant, dtype, bsz, cin, cout, hw, k, stride, pads,
                           residual=True) == adds


# (batch, cin, cout, (h, w), k, stride, pads)
SD_LIKE = [
    pytest.param(1, 64, 64, (16, 16), 3, 1, (1, 1, 1, 1), id="64ch-16x16"),
    pytest.param(2, 5, 7, (9, 7), 3, 1, (1, 1, 1, 1), id="odd-9x7-cin5"),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize(
    "bsz,cin,cout,hw,k,stride,pads",
    [
        *SD_LIKE,
        pytest.param(2, 32, 20, (9, 7), 1, 1, (0, 0, 0, 0), id="1x1"),
        pytest.param(1, 16, 24, (9, 8), 3, 2, (0, 1, 0, 1), id="stride2-vae-pad"),
        pytest.param(1, 12, 8, (11, 10), 3, 2, (1, 1, 1, 1), id="stride2-pad1"),
        pytest.param(1, 6, 5, (9, 7), 5, 1, (2, 2, 2, 2), id="5x5"),
    ],
)
def test_implicit_gemm(rt, pipelines, fresh_rng, dtype, bsz, cin, cout, hw, k, stride, pads):
    run_and_compare(rt, pipelines, fresh_rng, "implicit_gemm", dtype, bsz, cin, cout, hw, k, stride, pads)


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize(
    "bsz,cin,cout,hw,k,stride,pads",
    [
        pytest.param(2, 32, 4, (8, 8), 3, 1, (1, 1, 1, 1), id="unet-conv_out"),
        pytest.param(1, 16, 3, (12, 10), 3, 1, (1, 1, 1, 1), id="vae-conv_out"),
        pytest.param(1, 6, 1, (9, 7), 5, 1, (2, 2, 2, 2), id="5x5-one-channel"),
        pytest.param(2, 8, 2, (9, 8), 3, 2, (0, 1, 0, 1), id="stride2-vae-pad"),
        pytest.param(1, 5, 3, (7, 6), 1, 1, (0, 0, 0, 0), id="1x1"),
    ],
)
def test_narrow(rt, pipelines, fresh_rng, dtype, bsz, cin, cout, hw, k, stride, pads):
    run_and_compare(rt, pipelines, fresh_rng, "narrow", dtype, bsz, cin, cout, hw, k, stride, pads)


def test_narrow_refuses_more_output_channels_than_it_computes(rt, pipelines):
    ops = make_ops(rt, pipelines, "f32", "narrow")
    sel = ops.selection
    x, w = rt.upload(np.ones((1, 2, 4, 4), np.float32), "f32"), rt.upload(np.ones((5, 2, 1, 1), np.float32), "f32")
    with pytest.warns(UserWarning, match="at most 4 output channels"):
        y = ops.conv2d(x, w, None)
    assert np.array_equal(rt.read(y), np.full((1, 5, 4, 4), 2.0, np.float32))  # the reference ran it
    assert [d.variant for d in sel.decisions.values()] == ["reference"]


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize(
    "bsz,cin,cout,hw,k,stride,pads",
    [
        *SD_LIKE,
        pytest.param(1, 8, 12, (10, 6), 3, 1, (1, 1, 1, 1), id="edge-tiles-10x6"),
        pytest.param(2, 3, 4, (5, 13), 3, 1, (1, 1, 1, 1), id="edge-tiles-5x13-batch2"),
        pytest.param(1, 4, 4, (3, 3), 3, 1, (1, 1, 1, 1), id="one-partial-tile"),
    ],
)
def test_winograd(rt, pipelines, fresh_rng, dtype, bsz, cin, cout, hw, k, stride, pads):
    run_and_compare(rt, pipelines, fresh_rng, "winograd", dtype, bsz, cin, cout, hw, k, stride, pads)


@pytest.mark.parametrize("dtype", ["f16", "f32", "f16s"])
@pytest.mark.parametrize(
    "bsz,cin,cout,hw,constants",
    [
        pytest.param(1, 64, 64, (16, 16), {}, id="64ch-16x16"),
        pytest.param(2, 32, 20, (9, 7), {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16}, id="edge-tiles-cout20-batch2"),
        pytest.param(1, 128, 96, (12, 20), {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16}, id="128ch-12x20"),
        pytest.param(1, 5, 7, (9, 7), {}, id="cin5-falls-back"),
    ],
)
def test_winograd_2x2(rt, pipelines, fresh_rng, dtype, bsz, cin, cout, hw, constants):
    """Through the GEMM core (f16 models; f32 models and Cin % 4 != 0 take the f32 Winograd F(4x4))."""
    run_and_compare(rt, pipelines, fresh_rng, "winograd_2x2", dtype, bsz, cin, cout, hw, 3, 1, (1, 1, 1, 1),
                    constants=constants)


@pytest.mark.parametrize("dtype", ["f16", "f32", "f16s"])
@pytest.mark.parametrize(
    "bsz,cin,cout,hw,pads,constants",
    [
        pytest.param(2, 64, 40, (8, 12), (0, 0, 0, 0), {}, id="sd-like-batch2"),
        pytest.param(1, 96, 20, (6, 6), (0, 0, 0, 0), {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 4},
                     id="split-K"),
        pytest.param(1, 6, 5, (5, 5), (0, 0, 0, 0), {}, id="odd-falls-back"),
        pytest.param(1, 8, 8, (4, 4), (1, 1, 1, 1), {}, id="padded-falls-back"),
    ],
)
def test_pointwise(rt, pipelines, fresh_rng, dtype, bsz, cin, cout, hw, pads, constants):
    run_and_compare(rt, pipelines, fresh_rng, "pointwise", dtype, bsz, cin, cout, hw, 1, 1, pads, constants=constants)


@pytest.mark.parametrize("dtype", ["f16", "f32", "f16s"])
@pytest.mark.parametrize(
    "bsz,cin,cout,hw,k,stride,pads,constants",
    [
        # SD's stride-2 downsamplers (asymmetric padding), smaller, with split-K as tuned for them
        pytest.param(2, 64, 64, (16, 16), 3, 2, (0, 1, 0, 1), {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 8},
                     id="stride2-split-K"),
        pytest.param(2, 4, 32, (12, 8), 3, 1, (1, 1, 1, 1), {}, id="conv-in-cin4"),  # K = 36
        pytest.param(1, 8, 12, (9, 13), 3, 2, (1, 1, 1, 1), {}, id="odd-pixels-falls-back"),  # 5 x 7 pixels
        pytest.param(1, 12, 8, (6, 6), 1, 1, (0, 0, 0, 0), {}, id="1x1"),
    ],
)
def test_im2col(rt, pipelines, fresh_rng, dtype, bsz, cin, cout, hw, k, stride, pads, constants):
    run_and_compare(rt, pipelines, fresh_rng, "im2col", dtype, bsz, cin, cout, hw, k, stride, pads, constants=constants)


def test_winograd_2x2_in_chunks(rt, pipelines, fresh_rng, monkeypatch):
    """Small scratch bounds: three chunks of output channels, five of tiles, the last padded."""
    from engine.variants import conv2d

    monkeypatch.setattr(conv2d, "WINOGRAD_CORE_FILTER_BYTES", 16 * 48 * 2 * 64)  # 64 channels per chunk
    monkeypatch.setattr(conv2d, "WINOGRAD_CORE_TILE_BYTES", 16 * 64 * 2 * 14)  # 14 -> 12 tiles per chunk
    assert conv2d.winograd_core_chunks(48, 150, 50) == (64, 12)  # 2 x 5 x 5 tiles: the last chunk has 2 (+2 padding)
    # an Ops with scratch_scale 3 (as the VAE decoder's 4): every channel in one chunk, 16 tiles
    assert conv2d.winograd_core_chunks(48, 150, 50, 2, 3) == (150, 16)
    run_and_compare(rt, pipelines, fresh_rng, "winograd_2x2", "f16", 2, 48, 150, (10, 9), 3, 1, (1, 1, 1, 1))


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "channel-chunks"])
def test_winograd_2x2_pretransform_keeps_the_filters_once_made(rt, pipelines, fresh_rng, monkeypatch, chunked):
    """PRETRANSFORM 1 with somewhere to keep them (Ops.prepared, a generation's): the first call
    transforms the filters, the later ones run without the filter kernel and give the same
    bits; without a Prepared (or with PRETRANSFORM 0) every call transforms them again; a
    second weight tensor gets its own."""
    from engine.ops import Prepared
    from engine.variants import conv2d

    if chunked:  # 64 output channels per chunk: two kept chunks of filters
        monkeypatch.setattr(conv2d, "WINOGRAD_CORE_FILTER_BYTES", 16 * 32 * 2 * 64)
    ops = make_ops(rt, pipelines, "f16", "winograd_2x2", {"PRETRANSFORM": 1})
    x, w, b = conv_inputs(fresh_rng, 2, 32, 96, (10, 8), 3)
    xt, wt, bt = rt.upload(x, "f16"), rt.upload(w, "f16"), rt.upload(b, "f16")
    filters = []
    plain_dispatch = rt.dispatch
    monkeypatch.setattr(rt, "dispatch", lambda p, label, *a: (filters.append(label) if label ==
                        "conv2d_winograd_filter" else None) or plain_dispatch(p, label, *a))

    def run(w_t=wt):
        before = len(filters)
        y = rt.read(ops.conv2d(xt, w_t, bt, padding=1))
        return y, len(filters) - before

    y0, n0 = run()  # nowhere to keep them: made on every call
    assert n0 == (2 if chunked else 1) and run()[1] == n0
    ops.prepared = Prepared()
    y1, n1 = run()
    y2, n2 = run()
    assert (n1, n2) == (n0, 0)
    assert np.array_equal(y0, y1) and np.array_equal(y1, y2)
    assert len(ops.prepared) == n0
    expect = np_conv(x.astype(np.float16).astype(np.float64), w.astype(np.float16).astype(np.float64),
                     b.astype(np.float16).astype(np.float64), 1, (1, 1, 1, 1))
    assert rel_err(y2.astype(np.float64), expect) <= TOL[("winograd_2x2", "f16")]
    w_neg = rt.upload(-w, "f16")
    y3, n3 = run(w_neg)
    assert n3 == n0 and rel_err(y3.astype(np.float64), -expect + 2 * b.astype(np.float16)[None, :, None, None]) \
        <= TOL[("winograd_2x2", "f16")]
    plain = make_ops(rt, pipelines, "f16", "winograd_2x2")  # PRETRANSFORM 0 keeps nothing
    plain.prepared = Prepared()
    assert np.array_equal(rt.read(plain.conv2d(xt, wt, bt, padding=1)), y0) and not plain.prepared


@pytest.mark.parametrize("variant", ["implicit_gemm", "winograd"])
def test_320_channels_8x8_f32(rt, pipelines, fresh_rng, variant):
    run_and_compare(rt, pipelines, fresh_rng, variant, "f32", 1, 320, 320, (8, 8), 3, 1, (1, 1, 1, 1))


@pytest.mark.parametrize("variant", ["implicit_gemm", "winograd"])
def test_no_bias(rt, pipelines, fresh_rng, variant):
    run_and_compare(rt, pipelines, fresh_rng, variant, "f32", 1, 9, 10, (7, 9), 3, 1, (1, 1, 1, 1), bias=False)


@pytest.mark.parametrize("variant", ["implicit_gemm", "winograd"])
@pytest.mark.parametrize(
    "constants",
    [
        {"TILE_M": 32, "TILE_N": 16, "TILE_K": 8},
        {"TILE_M": 128, "TILE_N": 32, "TILE_K": 32},
        {"TILE_M": 64, "TILE_N": 64, "TILE_K": 8},
    ],
)
def test_tiling_constants(rt, pipelines, fresh_rng, variant, constants):
    run_and_compare(
        rt, pipelines, fresh_rng, variant, "f32", 2, 20, 36, (9, 7), 3, 1, (1, 1, 1, 1), constants=constants
    )


def test_bad_tiling_constant_is_named(rt, pipelines, fresh_rng):
    ops = make_ops(rt, pipelines, "f32", "implicit_gemm", {"TILE_M": 48})
    x, w, b = conv_inputs(fresh_rng, 1, 4, 4, (5, 5), 3)
    with pytest.raises(EngineError, match="TILE_M=48"):
        ops.conv2d(rt.upload(x), rt.upload(w), rt.upload(b), padding=1)


def test_winograd_keeps_no_weight_copy(rt, pipelines, fresh_rng):
    """The transformed filters are computed inside the GEMM: three dispatches per call, no
    memory held after the call, and a new weight tensor is honoured at once."""
    ops = make_ops(rt, pipelines, "f32", "winograd")
    x, w, b = conv_inputs(fresh_rng, 1, 8, 8, (8, 8), 3)
    xt, wt, bt = rt.upload(x), rt.upload(w), rt.upload(b)
    before, in_use = rt.dispatches, rt.pool.in_use_bytes
    y = rt.read(ops.conv2d(xt, wt, bt, padding=1)).astype(np.float64)
    assert rt.dispatches - before == 3
    assert rt.pool.in_use_bytes == in_use, "the call left GPU memory allocated"
    assert rel_err(y, np_conv(x.astype(np.float64), w, b, 1, (1, 1, 1, 1))) <= TOL[("winograd", "f32")]
    w2 = -w
    y2 = rt.read(ops.conv2d(xt, rt.upload(w2), bt, padding=1)).astype(np.float64)
    assert rel_err(y2, np_conv(x.astype(np.float64), w2, b, 1, (1, 1, 1, 1))) <= TOL[("winograd", "f32")]


def test_winograd_applies_only_to_3x3_stride1(rt, pipelines, fresh_rng):
    shape = {"cin": 64, "cout": 64, "h": 32, "w": 32, "k": 3, "stride": 1, "b": 1}
    assert winograd_applies(shape) is None
    assert "3x3 stride-1" in winograd_applies({**shape, "k": 1})
    assert "3x3 stride-1" in winograd_applies({**shape, "stride": 2})
    # Forced on a 1x1 convolution, the selection falls back to the reference, with a warning.
    ops = make_ops(rt, pipelines, "f32", "winograd")
    x, w, b = conv_inputs(fresh_rng, 1, 4, 4, (5, 5), 1)
    with pytest.warns(UserWarning, match="winograd needs a 3x3 stride-1"):
        y = ops.conv2d(rt.upload(x), rt.upload(w), rt.upload(b))
    assert next(iter(ops.selection.decisions.values())).variant == "reference"
    assert rel_err(rt.read(y).astype(np.float64), np_conv(x.astype(np.float64), w, b, 1, (0,) * 4)) <= 2e-5


def test_winograd_pays_follows_tflite():
    sd = {"cin": 320, "cout": 320, "h": 64, "w": 64, "k": 3, "stride": 1, "b": 2}
    assert winograd_pays(sd)
    assert not winograd_pays({**sd, "cin": 4})  # conv_in of the UNet
    assert not winograd_pays({**sd, "cout": 32})
    assert not winograd_pays({**sd, "stride": 2})
    assert not winograd_pays({**sd, "k": 1})
    assert not winograd_pays({**sd, "h": 16, "w": 28})  # 4 x 7 = 28 tiles < 32
    assert winograd_pays({**sd, "h": 16, "w": 29})  # 4 x 8 = 32 tiles
    assert not winograd_pays(sd, min_channels=512)
    assert not winograd_pays({**sd, "h": 32, "w": 32}, min_tiles=128)  # Adreno 6xx threshold


def test_winograd_error_is_bounded(rt, pipelines, fresh_rng, capsys):
    """Measure Winograd's error against float64 numpy on the same fp32-representable inputs,
    next to the direct (reference) kernel's. F(4x4, 3x3) adds rounding in its transforms
    (coefficients up to 8 in A^T, 5 in B^T). Its largest error stays within 1e-4 of the
    largest output; its RMS error within 10x the direct kernel's. The ratio is of RMS errors:
    a ratio of the two largest errors is a ratio of two extremes, 3-7x on 41 seeds but 10.4x
    on one (FARM_TEST_SEED=308736329: the direct kernel's largest error happened to be small);
    RMS ratios were 2.1-2.8 on the same 41 seeds and 2.5-2.9 on that one (lavapipe)."""
    ops = make_ops(rt, pipelines, "f32", "winograd")
    ref_ops = make_ops(rt, pipelines, "f32", "reference")

    def rms_err(got, exact) -> float:
        return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))

    for cin, hw in ((64, (16, 16)), (320, (8, 8))):
        x, w, b = conv_inputs(fresh_rng, 1, cin, cin, hw, 3)
        xt, wt, bt = rt.upload(x), rt.upload(w), rt.upload(b)
        exact = np_conv(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), 1, (1, 1, 1, 1))
        wino = rt.read(ops.conv2d(xt, wt, bt, padding=1)).astype(np.float64)
        direct = rt.read(ref_ops.conv2d(xt, wt, bt, padding=1)).astype(np.float64)
        err_wino, rms_wino, rms_direct = rel_err(wino, exact), rms_err(wino, exact), rms_err(direct, exact)
        ratio = rms_wino / max(rms_direct, 1e-12)
        with capsys.disabled():
            print(f"\nwinograd error, {cin} ch {hw[0]}x{hw[1]} fp32: largest {err_wino:.3g} (direct "
                  f"{rel_err(direct, exact):.3g}), RMS {rms_wino:.3g} (direct {rms_direct:.3g}), RMS ratio {ratio:.2f}")
        assert err_wino <= 1e-4, f"winograd fp32 error {err_wino:.3g} > 1e-4"
        assert ratio <= 10, f"winograd's RMS error is {ratio:.1f}x the direct kernel's"


def test_a_fractional_scratch_scale_shrinks_every_scratch_bound():
    """A plan for a tight memory budget divides its scratch scale: the core's chunks shrink
    with it (channels stay multiples of 64, tiles of 4)."""
    import engine.variants.conv2d as conv_mod

    whole = conv_mod.winograd_core_chunks(1280, 1280, 2048, 2, 1)
    half = conv_mod.winograd_core_chunks(1280, 1280, 2048, 2, 0.5)
    quarter = conv_mod.winograd_core_chunks(1280, 1280, 2048, 2, 0.25)
    assert whole[1] > half[1] > quarter[1] and quarter[1] % 4 == 0
    assert 16 * 1280 * 2 * half[1] <= conv_mod.WINOGRAD_CORE_INPUT_BYTES // 2


def test_winograd_walks_tiles_in_chunks(rt, pipelines, fresh_rng, monkeypatch):
    """With a small scratch bound the tiles are processed in several rounds (partial last
    round included) and the result is unchanged; no scratch buffer exceeds the bound."""
    import engine.variants.conv2d as conv_mod

    bsz, cin, cout, hw = 2, 6, 5, (21, 18)  # 6 x 5 = 30 tiles per image, 60 in all
    bound = conv_mod.WINOGRAD_POSITIONS * cin * 4 * 32  # 32 tiles per round: 60 = 32 + 28
    monkeypatch.setattr(conv_mod, "WINOGRAD_SCRATCH_BYTES", bound)
    sizes = []
    empty = rt.empty

    def spy(shape, dtype):
        if dtype == "f32" and len(shape) == 3 and shape[0] == conv_mod.WINOGRAD_POSITIONS:
            sizes.append(shape)
        return empty(shape, dtype)

    monkeypatch.setattr(rt, "empty", spy)
    constants = {"TILE_M": 32, "TILE_N": 16, "TILE_K": 8}
    run_and_compare(rt, pipelines, fresh_rng, "winograd", "f32", bsz, cin, cout, hw, 3, 1, (1, 1, 1, 1), constants=constants)
    assert [s[2] for s in sizes] == [32, 32, 28, 28], sizes
    # a scratch scale below 1 (a plan for a tight budget) shrinks the bound; above 1 never grows it
    sizes.clear()
    monkeypatch.setattr(conv_mod, "WINOGRAD_SCRATCH_BYTES", 2 * bound)
    run_and_compare(rt, pipelines, fresh_rng, "winograd", "f32", bsz, cin, cout, hw, 3, 1, (1, 1, 1, 1),
                    constants=constants, scratch_scale=0.5)
    assert [s[2] for s in sizes] == [32, 32, 28, 28], sizes


@pytest.mark.parametrize("dtype", ["f32", "f16s"])
def test_small_maps_run_tiles_no_taller_than_their_pixels(rt, pipelines, fresh_rng, monkeypatch, dtype):
    """SD's smallest maps give a convolution few output pixels (16, 4 and 1 on an 8x8 latent's
    4x4, 2x2 and 1x1 levels): the implicit GEMM runs them in tiles of the next multiple-of-4
    height (4, 8, 16, 32) instead of the default 64 (padding that every invocation would multiply
    through the whole of K), with the same result; a map of 64 pixels or more keeps the chosen
    tiles."""
    tiles = []
    get = pipelines.get

    def recording(variant, dtype, constants=None, entry=None):
        if variant.name == "implicit_gemm":
            tiles.append((constants or {}).get("TILE_M"))
        return get(variant, dtype, constants, entry)

    monkeypatch.setattr(pipelines, "get", recording)
    for bsz, hw, want in ((1, (1, 1), 4), (1, (2, 2), 4), (2, (2, 3), 16), (2, (4, 4), 32), (1, (9, 7), 64)):
        run_and_compare(rt, pipelines, fresh_rng, "implicit_gemm", dtype, bsz, 12, 20, hw, 3, 1, (1, 1, 1, 1))
        assert tiles[-1] == want, (bsz, hw, tiles)


@pytest.mark.parametrize("last_use", [False, True])
def test_a_residual_added_by_a_kernel_after_lets_a_last_use_input_go_first(gpu, pipelines, fresh_rng, last_use):
    """A variant without the epilogue (the reference) adds the residual by a kernel after the
    convolution. With last_use the input's buffer goes back to the pool before that add, which
    takes it, as the unfused ResNet block's own `h = conv2(h)` let it go: one buffer fewer (SD
    1.4's VAE decode on a phone's profile held 235 MB more without it). The sum is numpy's."""
    rt = GpuContext(gpu, poison=True)  # a pool of its own, to count its buffers
    ops = make_ops(rt, pipelines, "f32", "reference")
    x, w, b = conv_inputs(fresh_rng, 1, 8, 8, (6, 6), 3)
    r = fresh_rng.standard_normal((1, 8, 6, 6)).astype(np.float32)
    xt, rt_r = rt.upload(x, "f32"), rt.upload(r, "f32")
    wt, bt = rt.upload(w, "f32", static=True), rt.upload(b, "f32", static=True)
    before = rt.pool.created
    y = ops.conv2d(xt, wt, bt, padding=1, residual=rt_r, last_use=last_use)
    assert rt.pool.created - before == (1 if last_use else 2)  # the conv's output, then the add's
    np.testing.assert_allclose(rt.read(y), np_conv(x, w, b, 1, (1, 1, 1, 1)) + r, rtol=0, atol=2e-5 * 8)
    if last_use:
        assert xt.storage is None  # the caller's view let go: it must not be used again
