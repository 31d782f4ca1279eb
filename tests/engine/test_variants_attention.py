"""The attention variants of engine/variants/attention.py (partial_softmax, flash) against a
float64 numpy reference and against the reference variant, on fresh random inputs with
poisoned outputs. Tolerances as in test_kernels.py: fp32 within 2e-5 and fp16 within 1e-2
relative to the largest reference magnitude."""

from __future__ import annotations

import numpy as np
import pytest
from ci_support import F16_HINT, missing

from engine.errors import EngineError
from engine.gpu import GpuContext
from engine.kernels import PipelineCache, Selection, variants
from engine.ops import Ops
from engine.variants import attention as attn

pytestmark = pytest.mark.gpu

TOL = {"f32": 2e-5, "f16": 1e-2, "f16s": 1e-2}
NP = {"f32": np.float32, "f16": np.float16, "f16s": np.float16}
VARIANTS = ["partial_softmax", "flash", "flash_gemm", "flash_packed"]


@pytest.fixture(scope="module")
def rt(gpu):
    return GpuContext(gpu, poison=True)


def make_ops(rt, gpu, dtype, variant=None):
    if dtype == "f16" and not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    features = gpu.caps.features
    selection = Selection.forcing(features, {"attention": variant}) if variant else Selection(frozenset(features))
    return Ops(rt, PipelineCache(gpu), selection, dtype)


def np_attention(qx, kx, vx, heads, causal=False):
    b, tq, c = qx.shape
    dh = c // heads
    qh = qx.reshape(b, tq, heads, dh).transpose(0, 2, 1, 3)  # (B, H, Tq, dh)
    kh = kx.reshape(b, -1, heads, dh).transpose(0, 2, 1, 3)  # (B, H, Tk, dh)
    vh = vx.reshape(b, -1, heads, dh).transpose(0, 2, 1, 3)
    s = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(dh)  # (B, H, Tq, Tk)
    if causal:
        s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).reshape(b, tq, c)


def rel_err(got, ref):
    return np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)


def run(ops, arrays, heads, causal):
    y = ops.attention(*(ops.rt.upload(a, ops.dtype) for a in arrays), heads, causal=causal)
    got = ops.rt.read(y).astype(np.float64)
    assert np.isfinite(got).all(), "kernel left poisoned (NaN) elements or overflowed"
    return got


def check_setting(rt, gpu, rng, name, dtype, shape, consts):
    """Variant `name` with override constants `consts` on fresh random inputs of `shape` (b, tq,
    tk, heads, dh, causal), against numpy on what the element type holds of them."""
    b, tq, tk, heads, dh, causal = shape
    ops = make_ops(rt, gpu, dtype)
    variant = variants("attention")[name]
    qx, kx, vx = (rng.standard_normal((b, t, heads * dh)).astype(np.float32) for t in (tq, tk, tk))
    seen = [np.asarray(a, NP[dtype]).astype(np.float64) for a in (qx, kx, vx)]
    tensors = [rt.upload(a, dtype) for a in (qx, kx, vx)]
    got = rt.read(variant.launch(ops, variant, consts, *tensors, heads, causal, dh**-0.5)).astype(np.float64)
    assert np.isfinite(got).all(), "kernel left poisoned (NaN) elements or overflowed"
    err = rel_err(got, np_attention(*seen, heads, causal))
    assert err <= TOL[dtype], f"{name} {consts} vs numpy: max relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "b,tq,tk,heads,dh,causal",
    [
        (2, 64, 64, 2, 40, False),  # SD's 64x64 level head dim
        (2, 48, 48, 1, 80, False),  # 32x32 level
        (1, 40, 40, 2, 160, False),  # 16x16 level
        (2, 77, 77, 2, 64, True),  # CLIP's causal self-attention
        (2, 256, 77, 1, 40, False),  # cross-attention to the text tokens
        (2, 33, 19, 3, 24, False),  # odd sizes, partial tiles everywhere
        (1, 33, 33, 1, 8, True),  # odd causal, the smallest head dim
        (1, 17, 21, 2, 7, False),  # an odd head dim: outputs stored an element at a time, not in pairs
        (1, 1024, 1024, 2, 40, False),  # SD-like, larger
    ],
)
def test_attention_variant(rt, gpu, fresh_rng, variant, dtype, b, tq, tk, heads, dh, causal):
    ops = make_ops(rt, gpu, dtype, variant)
    ref_ops = make_ops(rt, gpu, dtype)
    qx, kx, vx = (fresh_rng.standard_normal((b, t, heads * dh)).astype(np.float32) for t in (tq, tk, tk))
    seen = [np.asarray(a, NP[dtype]).astype(np.float64) for a in (qx, kx, vx)]
    got = run(ops, (qx, kx, vx), heads, causal)
    assert {d.variant for d in ops.selection.decisions.values()} == {variant}
    err = rel_err(got, np_attention(*seen, heads, causal))
    assert err <= TOL[dtype], f"{variant} vs numpy: max relative error {err:.3g} > {TOL[dtype]}"
    err = rel_err(got, run(ref_ops, (qx, kx, vx), heads, causal))
    assert err <= TOL[dtype], f"{variant} vs reference variant: max relative error {err:.3g} > {TOL[dtype]}"


def test_flash_packed_sums_in_f16_within_tolerance_for_large_logits(rt, gpu, fresh_rng):
    """flash_packed sums S's partial dot products in f16 (every FLUSH_DV vec4 columns into f32):
    its error grows with the logits' magnitude. Q and K of standard deviation 2 (logits of
    standard deviation 4, a sharper softmax than SD's) stay within the fp16 tolerance."""
    ops = make_ops(rt, gpu, "f16", "flash_packed")
    heads, dh = 2, 40
    qx, kx = (2 * fresh_rng.standard_normal((1, 1024, heads * dh)).astype(np.float32) for _ in range(2))
    vx = fresh_rng.standard_normal((1, 1024, heads * dh)).astype(np.float32)
    seen = [np.asarray(a, np.float16).astype(np.float64) for a in (qx, kx, vx)]
    err = rel_err(run(ops, (qx, kx, vx), heads, False), np_attention(*seen, heads))
    assert err <= TOL["f16"], f"flash_packed at logits of std 4: max relative error {err:.3g} > {TOL['f16']}"


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
def test_flash_packed_head_dim_not_in_vec4s(rt, gpu, fresh_rng, dtype):
    """flash_packed reads Q, K and V as vec4s; a head dim that is no multiple of 4 (rows that
    start inside a vec4) runs flash_gemm's scalar loads instead, and stays right."""
    ops = make_ops(rt, gpu, dtype, "flash_packed")
    heads, dh = 3, 6
    qx, kx, vx = (fresh_rng.standard_normal((2, t, heads * dh)).astype(np.float32) for t in (45, 37, 37))
    seen = [np.asarray(a, NP[dtype]).astype(np.float64) for a in (qx, kx, vx)]
    got = run(ops, (qx, kx, vx), heads, False)
    assert {d.variant for d in ops.selection.decisions.values()} == {"flash_packed"}
    err = rel_err(got, np_attention(*seen, heads))
    assert err <= TOL[dtype], f"flash_packed (head dim 6) vs numpy: max relative error {err:.3g} > {TOL[dtype]}"


# flash_packed.wgsl's own paths: 8 keys of S per invocation (blocks of 8 TX keys, masked past Tk
# and causally), the unrolled S loop's shorter last flush (16 vec4 columns: 5 + 5 + 5 + 1) and
# another summation length (the remainder loop alone), 1 to 4 accumulator columns.
PACKED_SETTINGS = [
    ((2, 64, 64, 2, 40, False), {"KPI": 8}),
    ((1, 77, 77, 2, 64, True), {"KPI": 8}),
    ((1, 77, 77, 2, 64, True), {}),
    ((1, 45, 37, 1, 80, False), {"KPI": 8, "TX": 5, "BQ": 16}),
    ((1, 33, 50, 1, 96, False), {"KPI": 8, "TX": 8, "BQ": 4}),
    ((1, 70, 90, 2, 40, False), {"FLUSH_DV": 3}),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize("shape,consts", PACKED_SETTINGS)
def test_flash_packed_settings_against_numpy(rt, gpu, fresh_rng, dtype, shape, consts):
    check_setting(rt, gpu, fresh_rng, "flash_packed", dtype, shape, consts)


def test_flash_packed_refuses_keys_per_invocation_it_has_no_code_for(rt, gpu, fresh_rng):
    ops = make_ops(rt, gpu, "f32")
    variant = variants("attention")["flash_packed"]
    tensors = [rt.upload(fresh_rng.standard_normal((1, 8, 16)).astype(np.float32), "f32") for _ in range(3)]
    with pytest.raises(EngineError, match="KPI=6; use 4 or 8"):
        variant.launch(ops, variant, {"KPI": 6}, *tensors, 1, False, 0.25)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_flash_packed_blocks_too_large_for_the_adapter(rt, gpu, fresh_rng, monkeypatch, dtype):
    """Profiles tune flash_packed's blocks in f16, whose staged operands take half the workgroup
    memory of f32's. An f32 model keeps the blocks where they fit and otherwise takes the
    defaults for the adapter; an f16 model is refused by name, never silently changed."""
    ops = make_ops(rt, gpu, dtype)
    heads, dh = 2, 40
    qx, kx, vx = (fresh_rng.standard_normal((1, 70, heads * dh)).astype(np.float32) for _ in range(3))
    limit = attn.gemm_workgroup_bytes(128, 10, 1, 8 if dtype == "f16" else 16) - 16
    limits = dict(gpu.caps.limits, **{"max-compute-workgroup-storage-size": limit})
    monkeypatch.setattr(rt, "caps", type(gpu.caps)(**{**gpu.caps.__dict__, "limits": limits}))
    variant = variants("attention")["flash_packed"]
    tensors = [rt.upload(a, dtype) for a in (qx, kx, vx)]
    if dtype == "f16":
        with pytest.raises(EngineError, match="max-compute-workgroup-storage-size"):
            variant.launch(ops, variant, {"BQ": 128, "TX": 10}, *tensors, heads, False, dh**-0.5)
        return
    got = rt.read(variant.launch(ops, variant, {"BQ": 128, "TX": 10}, *tensors, heads, False, dh**-0.5)).astype(np.float64)
    ref = np_attention(*(a.astype(np.float64) for a in (qx, kx, vx)), heads)
    assert rel_err(got, ref) <= TOL["f32"]


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])  # f16: partial_softmax's f32 scores
@pytest.mark.parametrize(
    "b,tq,tk,dh,causal",
    [
        (1, 256, 256, 512, False),  # the VAE's mid-block attention, smaller
        (2, 77, 76, 64, True),  # causal, Tq != Tk, rows not a multiple of the core's tiles
        (2, 33, 20, 8, False),  # odd sizes, partial tiles everywhere
    ],
)
def test_gemm_softmax_one_head(rt, gpu, fresh_rng, dtype, b, tq, tk, dh, causal):
    ops = make_ops(rt, gpu, dtype, "gemm_softmax")
    ref_ops = make_ops(rt, gpu, dtype)
    qx, kx, vx = (fresh_rng.standard_normal((b, t, dh)).astype(np.float32) for t in (tq, tk, tk))
    seen = [np.asarray(a, NP[dtype]).astype(np.float64) for a in (qx, kx, vx)]
    got = run(ops, (qx, kx, vx), 1, causal)
    assert {d.variant for d in ops.selection.decisions.values() if d.op == "attention"} == {"gemm_softmax"}
    err = rel_err(got, np_attention(*seen, 1, causal))
    assert err <= TOL[dtype], f"gemm_softmax vs numpy: max relative error {err:.3g} > {TOL[dtype]}"
    err = rel_err(got, run(ref_ops, (qx, kx, vx), 1, causal))
    assert err <= TOL[dtype], f"gemm_softmax vs reference variant: max relative error {err:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", ["f16", "f16s"])
def test_gemm_softmax_keeps_scores_in_f32_where_halves_overflow(rt, gpu, fresh_rng, dtype):
    """A model of halves with scores beyond f16's range (|Q K^T| up to about 2e5, f16's largest
    65,504) and a small scale: the logits are ordinary, the products in halves would be inf."""
    ops = make_ops(rt, gpu, dtype, "gemm_softmax")
    b, tq, tk, dh, scale = 1, 48, 64, 256, 1e-4
    qx, kx, vx = (fresh_rng.standard_normal((b, t, dh)).astype(np.float32) * m for t, m in ((tq, 50), (tk, 50), (tk, 1)))
    seen = [np.asarray(a, NP[dtype]).astype(np.float64) for a in (qx, kx, vx)]
    scores = seen[0] @ seen[1].transpose(0, 2, 1)
    assert np.abs(scores).max() > 65504, "the case must overflow halves"
    y = ops.attention(*(rt.upload(a, dtype) for a in (qx, kx, vx)), 1, scale=scale)
    got = rt.read(y).astype(np.float64)
    assert {d.variant for d in ops.selection.decisions.values() if d.op == "attention"} == {"gemm_softmax"}
    p = np.exp(scores * scale - (scores * scale).max(-1, keepdims=True))
    ref = (p / p.sum(-1, keepdims=True)) @ seen[2]
    assert np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err <= TOL[dtype], f"max relative error {err:.3g} > {TOL[dtype]}"


def test_gemm_softmax_refuses_several_heads_and_falls_back_where_the_core_cannot_run(rt, gpu, fresh_rng, monkeypatch):
    v = variants("attention")["gemm_softmax"]
    assert "one-head" in v.applies({"heads": 8, "dh": 40, "tk": 4096, "tq": 4096})
    assert v.applies({"heads": 1, "dh": 512, "tk": 4096, "tq": 4096}) is None
    ran = []
    real = attn.attention_partial_softmax
    monkeypatch.setattr(attn, "attention_partial_softmax", lambda *a: ran.append(a[1].name) or real(*a))
    # 37 keys are not the core's vec4 rows: partial_softmax runs instead; 36 keys go through the
    # core, in f16 too (in f32 copies of Q, K and V)
    for dtype, tk, expect in (("f32", 37, ["partial_softmax"]), ("f16", 37, ["partial_softmax"]), ("f16", 36, []),
                              ("f32", 36, [])):
        ran.clear()
        ops = make_ops(rt, gpu, dtype)
        qx, kx, vx = (fresh_rng.standard_normal((1, t, 16)).astype(np.float32) for t in (30, tk, tk))
        y = v.launch(ops, v, {}, *(rt.upload(a, dtype) for a in (qx, kx, vx)), 1, False, 0.25)
        assert ran == expect, (dtype, tk)
        seen = [np.asarray(a, NP[dtype]).astype(np.float64) for a in (qx, kx, vx)]
        assert rel_err(rt.read(y).astype(np.float64), np_attention(*seen, 1)) <= TOL[dtype]


@pytest.mark.parametrize("variant,per_chunk", [("partial_softmax", 3), ("flash", None)])
def test_attention_variant_over_binding_limit(rt, gpu, fresh_rng, monkeypatch, variant, per_chunk):
    """With a tiny binding limit partial_softmax splits the (batch, head) pairs into chunks;
    flash stores no score matrix and runs in one dispatch. Same result either way."""
    ops = make_ops(rt, gpu, "f32", variant)
    qx, kx, vx = (fresh_rng.standard_normal((2, 40, 3 * 8)).astype(np.float32) for _ in range(3))
    ref = np_attention(qx.astype(np.float64), kx.astype(np.float64), vx.astype(np.float64), 3)
    limits = dict(gpu.caps.limits, **{"max-storage-buffer-binding-size": 2 * 40 * 40 * 4})
    monkeypatch.setattr(rt, "caps", type(gpu.caps)(**{**gpu.caps.__dict__, "limits": limits}))
    before = rt.dispatches
    got = run(ops, (qx, kx, vx), 3, False)
    expected = 3 * per_chunk if per_chunk else 1  # 6 pairs in chunks of 2
    assert rt.dispatches - before == expected
    assert rel_err(got, ref) <= TOL["f32"]


# flash.wgsl's code paths: SPLIT invocations per row (1: no partial-dot reduction; 2, 4), RPI
# rows per invocation, a head dim below MAX_DH (zero-padded vec4 columns) and not a multiple
# of 4 (the scalar tail of the loads and stores), Tq / Tk not multiples of BR / BC, Tk < BC,
# causal with Tq != Tk.
FLASH_SETTINGS = [
    ((1, 70, 50, 2, 36, True), {"SPLIT": 2, "RPI": 2, "BR": 16, "BC": 8}),
    ((1, 37, 29, 1, 20, True), {"SPLIT": 4, "BR": 8, "BC": 16}),
    ((2, 45, 9, 2, 40, False), {"RPI": 2, "BR": 32, "BC": 32}),
    ((1, 50, 77, 1, 24, False), {"MAX_DH": 40, "RPI": 2, "BC": 64}),
    ((1, 40, 40, 1, 128, False), {}),
    ((1, 23, 31, 2, 156, True), {"RPI": 2, "BR": 16}),
    ((1, 24, 24, 1, 60, False), {"MAX_DH": 64, "SPLIT": 1, "BC": 16}),
    ((1, 30, 30, 1, 3, True), {}),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize("shape,consts", FLASH_SETTINGS)
def test_flash_settings_against_numpy(rt, gpu, fresh_rng, dtype, shape, consts):
    check_setting(rt, gpu, fresh_rng, "flash", dtype, shape, consts)


def test_flash_default_blocks_fit_every_webgpu_adapter():
    """For every head dim flash serves, the defaults stay within WebGPU's guaranteed 16 KiB of
    workgroup memory and 256 invocations per workgroup, and within the shader's register arrays."""
    for dh in range(1, max(attn.FLASH_MAX_DH) + 1):
        cfg = attn.flash_config(dh, {})
        assert cfg["MAX_DH"] >= dh and cfg["MAX_DH"] - dh < 4 * cfg["SPLIT"]
        need = attn.flash_workgroup_bytes(cfg["BR"], cfg["BC"], cfg["MAX_DH"], cfg["SPLIT"])
        assert need <= attn.WEBGPU_MIN_WORKGROUP_STORAGE, (dh, cfg, need)
        assert cfg["BR"] // cfg["RPI"] * cfg["SPLIT"] <= 256
        assert cfg["MAX_DH"] // 4 // cfg["SPLIT"] <= attn.FLASH_MAX_DVS


def test_flash_register_bounds_match_the_shader():
    import re

    source = variants("attention")["flash"].path.read_text()
    for name in ("MAX_DVS", "MAX_RPI", "MAX_BC"):
        found = re.search(rf"const {name} = (\d+)u;", source)
        assert found and int(found.group(1)) == getattr(attn, f"FLASH_{name}"), name


@pytest.mark.parametrize(
    "dh,consts,match",
    [
        (160, {"SPLIT": 2}, "SPLIT=2"),
        (40, {"MAX_DH": 40, "SPLIT": 4}, "divides 10"),
        (80, {"MAX_DH": 64}, "below the head dim"),
        (40, {"RPI": 2, "BR": 9}, "RPI=2"),
    ],
)
def test_flash_rejects_constants_that_cannot_serve_the_head_dim(dh, consts, match):
    from engine.errors import EngineError

    with pytest.raises(EngineError, match=match):
        attn.flash_config(dh, consts)


def test_flash_profile_constants_of_the_old_kernel_still_run():
    """The H100 profile's {"BC": 8, "BR": 32, "MAX_DH": 40} keeps its meaning (rows per
    workgroup, keys per block, padded head dim)."""
    assert attn.flash_config(40, {"BC": 8, "BR": 32, "MAX_DH": 40}) == {
        "BR": 32, "BC": 8, "MAX_DH": 40, "SPLIT": 1, "RPI": 1,
    }


def test_flash_falls_back_for_head_dims_it_cannot_hold(gpu):
    selection = Selection.forcing(gpu.caps.features, {"attention": "flash"})
    with pytest.warns(UserWarning, match="head dims up to 160"):
        chosen = selection.variant("attention", {"tq": 16, "tk": 16, "dh": 256, "heads": 1, "b": 1, "causal": 0})
    assert chosen.name == "reference"
    assert selection.variant("attention", {"tq": 16, "tk": 16, "dh": 160, "heads": 1, "b": 1, "causal": 0}).name == "flash"


def test_flash_refuses_blocks_beyond_the_workgroup_storage_limit(rt, gpu, monkeypatch):
    from engine.errors import EngineError
    from engine.kernels import Rule

    limits = dict(gpu.caps.limits, **{"max-compute-workgroup-storage-size": 8192})
    monkeypatch.setattr(rt, "caps", type(gpu.caps)(**{**gpu.caps.__dict__, "limits": limits}))
    selection = Selection(frozenset(gpu.caps.features), [Rule("attention", "flash")])
    ops = Ops(rt, PipelineCache(gpu), selection, "f32")
    x = rt.upload(np.zeros((1, 8, 160), np.float32))
    with pytest.raises(EngineError, match="max-compute-workgroup-storage-size"):
        ops.attention(x, x, x, 1)


# flash_gemm.wgsl's code paths: 1 to 4 accumulator columns per invocation, invocations per row (TX) that
# do or do not divide the head dim's vec4 count (zero-padded columns), head dims not a multiple
# of 4 (scalar tails), Tq / Tk not multiples of BQ / BK, Tk < BK, causal with Tq != Tk, and
# SD's head dims at their own settings.
GEMM_SETTINGS = [
    ((1, 70, 50, 2, 36, True), {"BQ": 16, "TX": 3}),
    ((1, 37, 29, 1, 20, True), {"BQ": 8, "TX": 2}),
    ((2, 45, 9, 2, 40, False), {"BQ": 32}),
    ((1, 50, 77, 1, 24, False), {"TX": 5}),
    ((1, 40, 40, 1, 80, False), {"BQ": 16, "TX": 5}),
    ((1, 23, 31, 2, 156, True), {}),
    ((1, 33, 40, 1, 160, False), {"BQ": 4, "TX": 10}),
    ((1, 30, 30, 1, 3, True), {}),
    ((1, 20, 20, 1, 44, False), {"BQ": 4, "TX": 4}),
]


@pytest.mark.parametrize("dtype", ["f32", "f16", "f16s"])
@pytest.mark.parametrize("shape,consts", GEMM_SETTINGS)
def test_flash_gemm_settings_against_numpy(rt, gpu, fresh_rng, dtype, shape, consts):
    check_setting(rt, gpu, fresh_rng, "flash_gemm", dtype, shape, consts)


def test_flash_gemm_defaults_fit_the_adapter_limits():
    """Up to head dim 80 the chosen defaults fit WebGPU's guaranteed 16 KiB of workgroup memory
    and 256 invocations, up to 160 they fit 32 KiB (lavapipe's limit), always within the
    shader's accumulator columns; on a 48 KiB adapter SD's 40 and 80 get 64-row blocks."""
    for dh in range(1, attn.GEMM_MAX_DH + 1):
        limit = attn.WEBGPU_MIN_WORKGROUP_STORAGE if dh <= 80 else 32768
        cfg = attn.gemm_config(dh, {}, limit, 256)
        assert 4 * cfg["TX"] * cfg["CO"] >= dh and cfg["CO"] <= attn.GEMM_MAX_CO, (dh, cfg)
        need = attn.gemm_workgroup_bytes(cfg["BQ"], cfg["TX"], cfg["CO"])
        assert need <= limit and cfg["TX"] * cfg["BQ"] // 4 <= 256, (dh, cfg)
    assert attn.gemm_config(40, {}, 49152, 1024) == {"BQ": 64, "TX": 10, "CO": 1}
    assert attn.gemm_config(80, {}, 49152, 1024) == {"BQ": 64, "TX": 10, "CO": 2}


def test_flash_gemm_register_bounds_match_the_shader():
    import re

    source = variants("attention")["flash_gemm"].path.read_text()
    for name in ("MAX_CO",):
        found = re.search(rf"const {name} = (\d+)u;", source)
        assert found and int(found.group(1)) == getattr(attn, f"GEMM_{name}"), name


@pytest.mark.parametrize(
    "dh,consts,limit,match",
    [
        (160, {"TX": 5}, 49152, "TX=5"),
        (40, {"BQ": 6}, 49152, "BQ=6"),
        (160, {"BQ": 64, "TX": 10}, 49152, "max-compute-workgroup-storage-size"),
    ],
)
def test_flash_gemm_rejects_constants_it_cannot_run(dh, consts, limit, match):
    from engine.errors import EngineError

    with pytest.raises(EngineError, match=match):
        attn.gemm_config(dh, consts, limit, 256)
