"""PlanExecutor.kernel_times: per-kernel GPU times of a plan's stage from timestamp queries, as
BrowserExecutor's and as the native executor's profiling gives them: the same kernel labels with
the same call counts as the eager UNet's profiled step, every dispatch counted once per
repetition, and the executor unchanged afterwards (a replay still equals the eager UNet)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def native(tiny_model_dir, gpu):
    return engine.load_pipeline(tiny_model_dir, precision="fp32")


@pytest.fixture(scope="module")
def planned(tiny_model_dir, gpu):
    return engine.load_pipeline(tiny_model_dir, precision="fp32", executor="plan")


def test_kernel_times_count_every_dispatch_of_the_stage(planned, native, gpu, fresh_rng):
    if not gpu.caps.has_timestamps:
        assert planned.plan_executor(64, 64).kernel_times("unet_step") is None
        return
    ex = planned.plan_executor(64, 64)
    dispatches = Counter(c["label"] for c in ex.plan["stages"]["unet_step"]["commands"] if c["op"] == "dispatch")
    times = ex.kernel_times("unet_step", repetitions=2)
    assert {k: t["calls"] for k, t in times.items()} == {k: 2 * n for k, n in dispatches.items()}
    assert all(t["total_ms"] >= 0 for t in times.values()) and sum(t["total_ms"] for t in times.values()) > 0

    # the eager UNet's profiled step runs the same kernels as often, on the context's keys and
    # values projected before it, as a generation's loop does (the plan: stage unet_context)
    ids = native.tokenize(["", "a small house"])
    ctx_np = native.encode_text(ids)
    sample = fresh_rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    rt = native.rt
    kv = native.unet_model.context_kv(rt.upload(ctx_np, native.dtype))
    rt.set_profiling(True)
    try:
        rt.take_kernel_times()
        native._unet(sample, 501, kv)
        eager = {k: kt.calls for k, kt in rt.take_kernel_times().items()}
    finally:
        rt.set_profiling(False)
    assert {k: t["calls"] // 2 for k, t in times.items()} == eager

    # profiling left the executor as it was: a replay (of the executor profiled) still gives
    # the eager UNet's bits
    np.testing.assert_array_equal(planned.unet(sample, 501, ctx_np), native.unet(sample, 501, ctx_np))
