"""GPU memory: the buffer pool's size classes and trimming, staged weight residency (same
image as resident, lower peak), per-stage peaks, and the shape-only estimate
(benchmarks/memory_estimate.py) agreeing with the real GPU context's accounting."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from script_support import load_script

import engine
from engine.gpu import CLASSES_PER_DOUBLING, MIN_CLASS_BYTES, GpuContext, size_class
from engine.models.config import load_model_config
from engine.pipeline import Pipeline

STAGES = {"text_encoder", "unet_context", "unet", "vae_decode"}


def test_size_classes_round_up_by_at_most_one_class_step():
    assert size_class(1) == MIN_CLASS_BYTES
    prev = 0
    for n in sorted({*range(1, 5000, 7), *(2**k + d for k in range(12, 31) for d in (-1, 0, 1, 2**k // 3))}):
        c = size_class(n)
        assert n <= c and c - n < max(MIN_CLASS_BYTES, n // CLASSES_PER_DOUBLING + 1), n
        assert c % 16 == 0 and size_class(c) == c and c >= prev  # classes are fixed points, in order
        prev = c
    assert size_class(2**20) == 2**20 and size_class(2**20 + 1) == 2**20 + 2**18


@pytest.fixture
def rt(gpu):
    return GpuContext(gpu, poison=True)


@pytest.mark.gpu
def test_pool_reuses_a_buffer_for_a_nearby_size_and_binds_only_the_tensor(rt, fresh_rng):
    from engine.kernels import PipelineCache, Selection
    from engine.ops import Ops

    a = rt.empty((1000,), "f32")  # 4000 B -> the 4096 B class
    buf, size = a.buffer, a.storage.nbytes
    assert size == size_class(4000) and rt.pool.pooled_bytes == size
    del a
    gc.collect()
    b = rt.empty((1010,), "f32")  # 4040 B: another size, the same class
    assert b.buffer is buf and rt.pool.created == 1 and rt.pool.pooled_bytes == size
    assert b.binding_bytes == 4048 < size
    # a kernel on a tensor in a larger buffer reads and writes the tensor's elements only
    ops = Ops(rt, PipelineCache(rt.gpu), Selection(frozenset(rt.caps.features)), "f32")
    x = fresh_rng.standard_normal(1010).astype(np.float32)
    y = fresh_rng.standard_normal(1010).astype(np.float32)
    out = ops.add(rt.upload(x), rt.upload(y))
    assert out.storage.nbytes > out.nbytes
    np.testing.assert_allclose(rt.read(out), x + y, rtol=1e-6)


@pytest.mark.gpu
def test_a_tensor_collected_with_a_reference_cycle_returns_a_live_buffer(rt):
    """An exception's traceback holding the frame that holds a tensor is a reference cycle:
    the collector finalises all it reaches at once, and the buffer's own wrapper must not be
    released before the tensor hands the buffer back (the next tensor of that class got a
    dead buffer: wgpu raised on the poisoning write)."""
    gc.disable()  # collect only when the test says so
    try:
        def fails_holding_a_tensor():
            t = rt.empty((3000,), "f32")  # noqa: F841 (held by the frame)
            raise ValueError("boom")

        try:
            fails_holding_a_tensor()
        except ValueError as exc:
            cycle = [exc]
            cycle.append(cycle)  # a cycle that reaches the frame through the traceback
        del cycle
        gc.collect()
    finally:
        gc.enable()
    assert rt.pool.in_use_bytes == 0
    t = rt.empty((3000,), "f32")  # the same class: the pooled buffer, poisoned on the way out
    assert rt.pool.created == 1
    assert np.isnan(rt.read(t)).all()


@pytest.mark.gpu
def test_trim_destroys_free_buffers_only_and_peak_counts_what_is_allocated(rt):
    live = rt.empty((256, 256), "f32")
    for n in (1000, 3000, 9000):
        rt.empty((n,), "f32")  # freed at once
    gc.collect()
    held = rt.pool.pooled_bytes
    assert held == sum(size_class(n) for n in (256 * 256 * 4, 4000, 12000, 36000))
    assert rt.peak_bytes == rt.static_bytes + held
    rt.trim()
    assert rt.pool.pooled_bytes == live.storage.nbytes == rt.pool.in_use_bytes
    with rt.watch_peak() as w:
        rt.empty((100,), "f32")
    assert w.peak_bytes == rt.static_bytes + live.storage.nbytes + size_class(400)
    np.testing.assert_array_equal(rt.read(rt.upload(np.arange(5, dtype=np.float32))), np.arange(5))


@pytest.mark.gpu
def test_released_weights_leave_the_accounting(rt):
    w = [rt.upload(np.ones((64, 64), np.float32), static=True) for _ in range(3)]
    assert rt.static_bytes == 3 * 64 * 64 * 4
    rt.release_weights([w[0], w[1], w[1].reshape(-1)])
    assert rt.static_bytes == 64 * 64 * 4 and w[0].buffer is None
    with pytest.raises(ValueError, match="pooled activation"):
        rt.release_weights([rt.empty((4,))])


@pytest.mark.gpu
def test_a_staging_ring_delivers_every_byte_across_its_chunks(gpu):
    """engine.gpu.StagingRing with 64-byte chunks in 2 slots (so slots are reused, waiting for
    their copies): weights of odd sizes (padded to 4 bytes), one spanning many chunks, and one
    of 0 bytes, arrive exactly; then upload_weights over a ring equals one over write_buffer."""
    from engine.gpu import GpuContext, StagingRing

    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in (3, 100, 64, 1001, 0, 17)]
    usage = wgpu_usage()
    buffers = [gpu.device.create_buffer(size=max(4, (a.nbytes + 3) & ~3), usage=usage) for a in arrays]
    ring = StagingRing(gpu.device, chunk=64, slots=2)
    for buf, a in zip(buffers, arrays, strict=True):
        ring.write(buf, a)
    ring.flush()
    ring.destroy()
    for buf, a in zip(buffers, arrays, strict=True):
        got = np.frombuffer(gpu.device.queue.read_buffer(buf), np.uint8)
        np.testing.assert_array_equal(got[:a.nbytes], a)
    weights = {f"w{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate([(3,), (40, 33), (7, 5, 3)])}
    rt = GpuContext(gpu)
    rt.upload_way = "write"
    by_write = rt.upload_weights(weights, "f16")
    written = rt.static_bytes
    rt.upload_way = "ring"
    by_ring = rt.upload_weights(weights, "f16")
    for name, a in weights.items():
        np.testing.assert_array_equal(rt.read(by_ring[name]), a.astype(np.float16))
        np.testing.assert_array_equal(rt.read(by_ring[name]), rt.read(by_write[name]))
    assert rt.static_bytes == 2 * written  # accounted alike


def wgpu_usage():
    import wgpu

    return wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


@pytest.fixture(scope="module")
def pipes(tiny_model_dir, gpu):
    return {r: engine.load_pipeline(tiny_model_dir, residency=r, profile="reference") for r in ("resident", "staged")}


@pytest.mark.gpu
def test_staged_weights_give_the_same_image_at_a_lower_peak(pipes):
    res = {r: p.generate("a red fox", steps=2, height=64, width=64, seed=3) for r, p in pipes.items()}
    np.testing.assert_array_equal(res["staged"].image, res["resident"].image)
    np.testing.assert_array_equal(res["staged"].latents, res["resident"].latents)
    resident, staged = res["resident"], res["staged"]
    assert staged.peak_gpu_bytes < resident.peak_gpu_bytes
    for r in (resident, staged):
        assert set(r.stage_peak_gpu_bytes) == STAGES
        assert r.peak_gpu_bytes == max(r.stage_peak_gpu_bytes.values())
    assert staged.timings["weights_upload_ms"] > 0 and "weights_upload_ms" not in resident.timings
    # staged: nothing on the GPU between generations; each stage holds only its own network
    p = pipes["staged"]
    # 2 x 32: two 16-byte placeholders (read-only and writable, never one buffer in a dispatch) of
    # each Ops, the pipeline's and the VAE decoder's (its own scratch bound)
    assert p.rt.static_bytes == 2 * 32 and p.rt.pool.pooled_bytes == 0
    w = {n: sum(t.nbytes for t in g.tensors.values()) for n, g in p.weights.items()}
    assert w == {"text_encoder": 0, "unet": 0, "vae": 0}
    assert staged.stage_peak_gpu_bytes["text_encoder"] < resident.stage_peak_gpu_bytes["text_encoder"]


@pytest.mark.gpu
def test_staged_network_calls_upload_and_release_their_weights(pipes):
    p, q = pipes["staged"], pipes["resident"]
    ids = p.tokenize(["a cat"])
    np.testing.assert_array_equal(p.encode_text(ids), q.encode_text(ids))
    z = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(p.decode(z), q.decode(z))
    idle = p.rt.static_bytes
    unet = sum(t.nbytes for t in q.weights["unet"].tensors.values())
    # the loop's weights and the context's projections: the whole UNet; nested holds upload once
    with p.weights_on_gpu("unet", "unet_context"), p.weights_on_gpu("unet_context", "unet"):
        assert unet <= p.rt.static_bytes - idle < unet + 16 * len(q.weights["unet"].tensors)
    assert p.rt.static_bytes == idle


@pytest.mark.gpu
def test_img2img_reports_the_vae_encode_stage(pipes):
    img = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    res = {r: p.generate("a boat", steps=2, height=64, width=64, init_image=img, strength=0.5) for r, p in pipes.items()}
    np.testing.assert_array_equal(res["staged"].image, res["resident"].image)
    assert set(res["staged"].stage_peak_gpu_bytes) == STAGES | {"vae_encode"}


def _memory_estimate():
    return load_script("benchmarks/memory_estimate.py")


@pytest.mark.gpu
@pytest.mark.parametrize("residency", ["resident", "staged"])
def test_shape_only_estimate_matches_the_gpu_context_on_the_tiny_model(tiny_model_dir, pipes, residency):
    real = pipes[residency].generate("any prompt", steps=3, height=64, width=64, seed=1)
    config = load_model_config(tiny_model_dir)
    est = _memory_estimate().estimate(config, pipes[residency].rt.caps, "fp32", residency, 64, 64, "reference")
    assert est["peak_gpu_bytes"] == real.peak_gpu_bytes
    assert est["stage_peak_gpu_bytes"] == real.stage_peak_gpu_bytes
    weights = est["weights_bytes"]
    if residency == "staged":  # the UNet stage holds the UNet's weights and nothing else
        assert real.stage_peak_gpu_bytes["unet"] > weights["unet"]


def test_sd14_estimate_runs_on_shapes_alone(tmp_path):
    """SD 1.4 at 512x512 fp16 on the H100's capabilities, in about a second on any machine."""
    me = _memory_estimate()
    out = tmp_path / "est.json"
    me.main(["--preset", "sd14", "--precision", "fp16", "--profile", "reference", "--json", str(out)])
    import json

    rows = {r["residency"]: r for r in json.loads(out.read_text())}
    w = rows["resident"]["weights_bytes"]
    assert 1.6e9 < w["unet"] < 1.8e9  # 860M fp16 parameters
    assert rows["staged"]["peak_gpu_bytes"] < rows["resident"]["peak_gpu_bytes"]
    assert rows["staged"]["stage_peak_gpu_bytes"]["unet"] > w["unet"]


def test_shape_only_pipeline_needs_no_adapter():
    me = _memory_estimate()
    p = Pipeline.shape_only(me.config_for(None, "tiny"), me.H100, "fp16", "staged", "reference")
    r = p.generate("x", steps=1, height=64, width=64)
    assert r.image.shape == (64, 64, 3) and r.peak_gpu_bytes > 0 and p.rt.dispatches > 0
