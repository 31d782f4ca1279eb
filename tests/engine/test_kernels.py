"""Every reference kernel against numpy on fresh random inputs, outputs poisoned with NaN.

Tolerances: fp32 results within 2e-5 relative (to the largest reference magnitude) of a
float64 numpy reference; fp16 results within 1e-2 relative of the same reference computed
from the fp16-rounded inputs (fp16 stores 11 significant bits; accumulation is f32); f16s
(f16-storage: packed halves, f32 arithmetic, no shader-f16) to the same tolerance."""

from __future__ import annotations

import numpy as np
import pytest
from ci_support import F16_HINT, missing

from engine.gpu import GpuContext
from engine.kernels import PipelineCache, Selection
from engine.ops import Ops

pytestmark = pytest.mark.gpu

TOL = {"f32": 2e-5, "f16": 1e-2, "f16s": 1e-2}
NP = {"f32": np.float32, "f16": np.float16, "f16s": np.float16}


@pytest.fixture(scope="module")
def rt(gpu):
    return GpuContext(gpu, poison=True)


@pytest.fixture(params=["f32", "f16", "f16s"])
def ops(request, rt, gpu):
    if request.param == "f16" and not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    return Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), request.param)


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def up(ops, a):
    return ops.rt.upload(a, ops.dtype)


def q(ops, a):
    """The value the kernel actually sees: rounded to the storage type, then float64."""
    return np.asarray(a, dtype=NP[ops.dtype]).astype(np.float64)


def check(ops, out, ref):
    got = ops.rt.read(out).astype(np.float64)
    assert got.shape == ref.shape
    assert np.isfinite(got).all(), "kernel left poisoned (NaN) elements or overflowed"
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err <= TOL[ops.dtype], f"max relative error {err:.3g} > {TOL[ops.dtype]}"


def np_conv(x, w, b, stride, pads):
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


@pytest.mark.parametrize("m,k,n,bias", [(77, 768 // 8, 37, True), (130, 40, 64, False), (1, 320, 1280 // 4, True)])
def test_linear(ops, fresh_rng, m, k, n, bias):
    x, w, b = rand(fresh_rng, 2, m, k), rand(fresh_rng, n, k, scale=k**-0.5), rand(fresh_rng, n)
    y = ops.linear(up(ops, x), up(ops, w), up(ops, b) if bias else None)
    ref = q(ops, x) @ q(ops, w).T + (q(ops, b) if bias else 0)
    check(ops, y, ref)


@pytest.mark.parametrize(
    "cin,cout,hw,k,stride,pads",
    [
        (8, 6, (9, 7), 3, 1, (1, 1, 1, 1)),  # odd sizes
        (64, 64, (16, 16), 3, 1, (1, 1, 1, 1)),  # where Winograd will apply later
        (16, 24, (9, 11), 3, 2, (1, 1, 1, 1)),  # UNet downsampler
        (8, 8, (16, 16), 3, 2, (0, 1, 0, 1)),  # VAE downsampler: asymmetric padding
        (32, 12, (5, 6), 1, 1, (0, 0, 0, 0)),  # 1x1 projection
    ],
)
def test_conv2d(ops, fresh_rng, cin, cout, hw, k, stride, pads):
    x = rand(fresh_rng, 2, cin, *hw)
    w = rand(fresh_rng, cout, cin, k, k, scale=(cin * k * k) ** -0.5)
    b = rand(fresh_rng, cout)
    y = ops.conv2d(up(ops, x), up(ops, w), up(ops, b), stride=stride, padding=pads)
    check(ops, y, np_conv(q(ops, x), q(ops, w), q(ops, b), stride, pads))


# (an odd element count, 1 x 9 x 15: the last element is written alone, the rest in pairs)
@pytest.mark.parametrize("bsz,c,groups,hw,eps,silu", [(2, 64, 32, (8, 8), 1e-5, True), (2, 12, 4, (5, 3), 1e-6, False),
                                                      (1, 9, 3, (5, 3), 1e-5, True)])
def test_group_norm(ops, fresh_rng, bsz, c, groups, hw, eps, silu):
    x = rand(fresh_rng, bsz, c, *hw, scale=3.0) + 1.5
    g, b = rand(fresh_rng, c) + 1, rand(fresh_rng, c)
    y = ops.group_norm(up(ops, x), up(ops, g), up(ops, b), groups, eps, silu)
    xr = q(ops, x).reshape(bsz, groups, -1)
    ref = ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + eps)).reshape(x.shape)
    ref = ref * q(ops, g)[None, :, None, None] + q(ops, b)[None, :, None, None]
    if silu:
        ref = ref / (1 + np.exp(-ref))
    check(ops, y, ref)


@pytest.mark.parametrize("rows,d", [(77, 32), (9, 768), (3, 1000), (5, 37)])  # odd rows are written an element at a time
def test_layer_norm(ops, fresh_rng, rows, d):
    x = rand(fresh_rng, 2, rows, d, scale=2.0) + 0.5
    g, b = rand(fresh_rng, d) + 1, rand(fresh_rng, d)
    y = ops.layer_norm(up(ops, x), up(ops, g), up(ops, b), 1e-5)
    xq = q(ops, x)
    ref = (xq - xq.mean(-1, keepdims=True)) / np.sqrt(xq.var(-1, keepdims=True) + 1e-5) * q(ops, g) + q(ops, b)
    check(ops, y, ref)


def _gelu(x):
    from math import erf

    return x * 0.5 * (1 + np.vectorize(erf)(x / np.sqrt(2)))


@pytest.mark.parametrize("kind", ["silu", "gelu", "quick_gelu"])
def test_activation(ops, fresh_rng, kind):
    x = rand(fresh_rng, 3, 1001, scale=4.0)
    y = ops.activation(up(ops, x), kind)
    xq = q(ops, x)
    ref = {"silu": xq / (1 + np.exp(-xq)), "gelu": _gelu(xq), "quick_gelu": xq / (1 + np.exp(-1.702 * xq))}[kind]
    check(ops, y, ref)


def test_gelu_erf_approximation_bound(rt, gpu):
    """The erf approximation's documented bound (A&S 7.1.26: 1.5e-7) holds on a dense grid."""
    ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f32")
    x = np.linspace(-10, 10, 200_001, dtype=np.float32)
    y = rt.read(ops.activation(rt.upload(x), "gelu")).astype(np.float64)
    exact = _gelu(x.astype(np.float64))
    # |x * 0.5 * (erf error)| <= 0.5 * |x| * 1.5e-7, plus f32 rounding of the result
    bound = 0.5 * np.abs(x) * 1.5e-7 + 4 * np.finfo(np.float32).eps * np.maximum(np.abs(exact), 1)
    assert (np.abs(y - exact) <= bound).all(), np.abs(y - exact).max()


def test_geglu(ops, fresh_rng):
    x = rand(fresh_rng, 2, 17, 2 * 40, scale=2.0)
    y = ops.geglu(up(ops, x))
    xq = q(ops, x)
    check(ops, y, xq[..., :40] * _gelu(xq[..., 40:]))


@pytest.mark.parametrize("shape", [(2, 6, 5, 7), (1, 3, 5, 7)])  # 105 elements: the last is written alone
def test_add_and_broadcast(ops, fresh_rng, shape):
    a, b, c = rand(fresh_rng, *shape), rand(fresh_rng, *shape), rand(fresh_rng, *shape[:2])
    check(ops, ops.add(up(ops, a), up(ops, b)), q(ops, a) + q(ops, b))
    check(ops, ops.add(up(ops, a), up(ops, c)), q(ops, a) + q(ops, c)[:, :, None, None])


@pytest.mark.parametrize("hw,size", [((4, 5), (8, 10)), ((3, 4), (5, 7))])
def test_upsample_nearest(ops, fresh_rng, hw, size):
    x = rand(fresh_rng, 2, 3, *hw)
    y = ops.upsample_nearest(up(ops, x), size)
    iy = np.arange(size[0]) * hw[0] // size[0]
    ix = np.arange(size[1]) * hw[1] // size[1]
    check(ops, y, q(ops, x)[:, :, iy][:, :, :, ix])


def test_concat_and_transpose(ops, fresh_rng):
    a, b = rand(fresh_rng, 2, 3, 4, 5), rand(fresh_rng, 2, 6, 4, 5)
    check(ops, ops.concat_channels(up(ops, a), up(ops, b)), np.concatenate([q(ops, a), q(ops, b)], 1))
    a, b = rand(fresh_rng, 1, 3, 1, 5), rand(fresh_rng, 1, 2, 1, 5)  # 25 elements: the last is written alone
    check(ops, ops.concat_channels(up(ops, a), up(ops, b)), np.concatenate([q(ops, a), q(ops, b)], 1))
    x = rand(fresh_rng, 2, 7, 13)
    check(ops, ops.transpose(up(ops, x)), q(ops, x).transpose(0, 2, 1))


def test_embedding(ops, fresh_rng):
    ids = fresh_rng.integers(0, 50, size=(2, 9)).astype(np.uint32)
    tok, pos = rand(fresh_rng, 50, 16), rand(fresh_rng, 77, 16)
    y = ops.embedding(ops.rt.upload(ids, "u32"), up(ops, tok), up(ops, pos))
    check(ops, y, q(ops, tok)[ids] + q(ops, pos)[None, :9])


def np_attention(qx, kx, vx, heads, causal=False):
    b, tq, c = qx.shape
    dh = c // heads
    qh = qx.reshape(b, tq, heads, dh).transpose(0, 2, 1, 3)  # (B, H, Tq, dh)
    kh = kx.reshape(b, -1, heads, dh).transpose(0, 2, 1, 3)
    vh = vx.reshape(b, -1, heads, dh).transpose(0, 2, 1, 3)
    s = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(dh)  # (B, H, Tq, Tk)
    if causal:
        s = np.where(np.triu(np.ones(s.shape[-2:], bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).reshape(b, tq, c)


@pytest.mark.parametrize(
    "tq,tk,heads,dh,causal",
    [(64, 77, 8, 40, False), (77, 77, 4, 8, True), (256, 256, 2, 80, False), (33, 19, 1, 160, False)],
)
def test_attention(ops, fresh_rng, tq, tk, heads, dh, causal):
    qx, kx, vx = (rand(fresh_rng, 2, t, heads * dh) for t in (tq, tk, tk))
    y = ops.attention(up(ops, qx), up(ops, kx), up(ops, vx), heads, causal=causal)
    check(ops, y, np_attention(q(ops, qx), q(ops, kx), q(ops, vx), heads, causal))


def test_attention_splits_score_matrix_over_binding_limit(rt, gpu, fresh_rng, monkeypatch):
    """With a tiny binding limit the (batch, head) pairs run in several chunks, same result."""
    ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f32")
    qx, kx, vx = (rand(fresh_rng, 2, 40, 3 * 8) for _ in range(3))
    ref = np_attention(qx.astype(np.float64), kx.astype(np.float64), vx.astype(np.float64), 3)
    limits = dict(gpu.caps.limits, **{"max-storage-buffer-binding-size": 2 * 40 * 40 * 4})
    monkeypatch.setattr(rt, "caps", type(gpu.caps)(**{**gpu.caps.__dict__, "limits": limits}))
    before = rt.dispatches
    y = ops.attention(rt.upload(qx), rt.upload(kx), rt.upload(vx), 3)
    assert rt.dispatches - before == 3 * 3  # 6 pairs in chunks of 2, three dispatches each
    check(ops, y, ref)


def test_attention_keeps_its_score_chunks_within_the_scratch_bound(rt, gpu, fresh_rng, monkeypatch):
    """The score matrices stored at once stay under SCORE_SCRATCH_BYTES times the Ops'
    scratch_scale (a plan for a tight budget halves it), one (batch, head) pair at least."""
    import engine.ops as ops_mod

    qx, kx, vx = (rand(fresh_rng, 2, 40, 3 * 8) for _ in range(3))
    ref = np_attention(qx.astype(np.float64), kx.astype(np.float64), vx.astype(np.float64), 3)
    monkeypatch.setattr(ops_mod, "SCORE_SCRATCH_BYTES", 4 * 40 * 40 * 4)  # 4 pairs
    for scale, chunks in ((1, 2), (0.5, 3), (0.125, 6)):  # 6 pairs: 4 + 2, 2 + 2 + 2, one each
        ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f32", scratch_scale=scale)
        before = rt.dispatches
        y = ops.attention(rt.upload(qx), rt.upload(kx), rt.upload(vx), 3)
        assert rt.dispatches - before == 3 * chunks
        check(ops, y, ref)


def test_oversized_activation_is_refused_with_a_clear_message(rt):
    from engine.errors import GPUError

    limit = rt.caps.max_binding_bytes
    with pytest.raises(GPUError, match="max-storage-buffer-binding-size"):
        rt.empty((limit // 4 + 1,), "f32")


def test_chained_kernels_across_submit_batches(ops, fresh_rng, monkeypatch):
    """Recorded work is submitted every SUBMIT_EVERY dispatches: a chain of dependent kernels
    split over many submits, reusing pooled buffers, still computes the chain."""
    import engine.gpu

    monkeypatch.setattr(engine.gpu, "SUBMIT_EVERY", 3)
    a, b = rand(fresh_rng, 4, 33), rand(fresh_rng, 4, 33)
    y, bt = up(ops, a), up(ops, b)
    for _ in range(10):
        y = ops.add(y, bt)
    check(ops, y, q(ops, a) + 10 * q(ops, b))


def test_kernels_compiled_without_run_time_checks_compute_the_checked_bits(gpu, fresh_rng, monkeypatch):
    """wgpu-native compiles the engine's kernels without WebGPU's run-time checks (index clamps,
    loop bounds); FARM_SHADER_CHECKS=1 keeps them. Where every index is in bounds the two give
    the same bits: the GEMM core, Winograd, flash attention and group norm on partial tiles,
    unchecked (the default device) against a second device with the checks."""
    from engine.device import create_gpu

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    assert gpu.unchecked, "wgpu-native should compile the engine's kernels unchecked"
    monkeypatch.setenv("FARM_SHADER_CHECKS", "1")
    checked = create_gpu()
    assert not checked.unchecked
    choice = {"linear": "gemm", "conv2d": "winograd_2x2", "attention": "flash_packed", "group_norm": "fused"}
    x = fresh_rng.standard_normal((1, 8, 13, 11)).astype(np.float32)
    gamma, beta = fresh_rng.standard_normal(8).astype(np.float32), fresh_rng.standard_normal(8).astype(np.float32)
    w = 0.2 * fresh_rng.standard_normal((12, 8, 3, 3)).astype(np.float32)
    q, k, v = (fresh_rng.standard_normal((2, t, 2 * 40)).astype(np.float32) for t in (70, 45, 45))
    a, wl = fresh_rng.standard_normal((37, 64)).astype(np.float32), fresh_rng.standard_normal((52, 64)).astype(np.float32)
    outs = []
    for device in (gpu, checked):
        rt = GpuContext(device, poison=True)
        ops = Ops(rt, PipelineCache(device), Selection.forcing(device.caps.features, choice), "f16")
        t = {name: rt.upload(arr, "f16") for name, arr in dict(a=a, wl=wl, x=x, w=w, q=q, k=k, v=v, gamma=gamma,
                                                                  beta=beta).items()}
        y = [ops.linear(t["a"], t["wl"]), ops.conv2d(t["x"], t["w"], None, padding=1),
             ops.attention(t["q"], t["k"], t["v"], 2), ops.group_norm(t["x"], t["gamma"], t["beta"], 4, 1e-6, silu=True)]
        assert {d.variant for d in ops.selection.decisions.values()} == set(choice.values())
        outs.append([rt.read(t) for t in y])
    for name, got, want in zip(choice, *outs, strict=True):
        assert np.isfinite(got).all() and np.array_equal(got, want), f"{name}: unchecked and checked differ"
