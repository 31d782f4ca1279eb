"""agent.jobs on the engine's plan and browser executors (JobSpec.executor), on the tiny model:

- plan (lavapipe): latency and generate jobs give the native executor's sample metrics, units
  and repetitions, per-kernel GPU times with the native executor's kernels and call counts, and
  the native executor's image bit for bit (one adapter, the same kernels in the same order:
  engine/plan_exec.py);
- browser (headless Chromium on SwiftShader, fp32): a latency job gives one unet_step_ms per
  repetition and per-kernel times, an environment naming the browser and none of this host's
  OS or temperatures; a generate job's image is within 40 dB PSNR of the plan executor's;
- a tune job off the native executor, an executor that does not exist, or a configured browser
  page for a job of another executor end as a failed result saying why, before any engine work;
- the child's task file (ChildTask) reads back as written, and holds the configured page URL
  for its owner's eyes only."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from ci_support import missing

from agent import jobs
from agent.jobs import run_job
from agent.protocol import (
    AGENT_CONFIG_FILE,
    AgentConfig,
    Cooldown,
    JobResult,
    JobSpec,
    ProtocolError,
    from_dict,
    to_dict,
    to_json,
)


def spec(**kw) -> JobSpec:
    base = {"job_id": "rt", "kind": "generate", "precision": "fp32", "steps": 2, "scheduler": "euler",
            "prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "seed": 5}
    return JobSpec(**(base | kw))


def latency_spec(model: Path) -> JobSpec:
    return spec(kind="latency", model=str(model), warmup=1, unet_repetitions=3, repetitions=2, height=32,
                width=32)


def run_on(executor: str, s: JobSpec, out: Path) -> JobResult:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FARM_BROWSER_WEBGPU_ADAPTER", "swiftshader")  # the adapter test_browser.py checks
        result = run_job(dataclasses.replace(s, executor=executor), out, out.parent / "root")
    assert result.status == "succeeded", (result.error or "") + result.log_tail
    return result


def image(result: JobResult, out: Path) -> np.ndarray:
    from PIL import Image

    art = next(a for a in result.artifacts if a.kind == "image")
    return np.asarray(Image.open(out / art.path).convert("RGB"))


def metrics(result: JobResult) -> dict[tuple[str, str], list[int]]:
    """(metric, unit) -> the repetitions sampled."""
    out: dict[tuple[str, str], list[int]] = {}
    for s in result.samples:
        out.setdefault((s.metric, s.unit), []).append(s.repetition)
    return {k: sorted(v) for k, v in out.items()}


def kernels(result: JobResult, repetition: int) -> dict[str, int]:
    return {k.kernel: k.calls for k in result.kernel_timings if k.repetition == repetition}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Each executor's jobs, run once: {(executor, kind): (result, out_dir)}."""
    made = {}

    def get(executor: str, kind: str):
        if (executor, kind) not in made:
            out = tmp_path_factory.mktemp(f"{executor}-{kind}") / "out"
            s = latency_spec(tiny_model_dir) if kind == "latency" else spec(model=str(tiny_model_dir))
            made[(executor, kind)] = run_on(executor, s, out), out
        return made[(executor, kind)]

    return get


def need_chromium() -> str:
    from engine.browser import find_chromium

    chromium = find_chromium()
    if not chromium:
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    return chromium


# ---- the plan executor -------------------------------------------------------------------------


@pytest.mark.gpu
def test_plan_latency_job_measures_what_native_measures(runs):
    native, _ = runs("native", "latency")
    planned, out = runs("plan", "latency")
    assert metrics(planned) == metrics(native)
    assert metrics(planned)[("unet_step_ms", "ms")] == [0, 1, 2]
    assert all(s.value > 0 for s in planned.samples if s.metric in ("unet_step_ms", "unet_step_peak_gpu_bytes"))
    assert planned.engine["executor"] == "plan" and planned.engine["unet_batch"] == 2
    for key in ("profile", "precision", "selection"):  # from the plans, as native reads its selection
        assert planned.engine[key] == native.engine[key], key
    assert planned.environment.runtime["kind"] == "plan" and planned.environment.runtime.get("version")
    assert json.loads((out / jobs.TASK_FILE).read_text())["spec"]["executor"] == "plan"
    # the plan's UNet step runs the native executor's kernels, as often, in each profiled repetition
    assert planned.engine["kernel_timing"].startswith("gpu timestamp queries")
    assert planned.engine["kernel_timing_repetitions"] == 3
    for r in range(3):
        assert kernels(planned, r) == kernels(native, r) != {}


@pytest.mark.gpu
def test_plan_generate_job_makes_the_native_image(runs):
    native, native_out = runs("native", "generate")
    planned, out = runs("plan", "generate")
    assert metrics(planned) == metrics(native)
    assert {"e2e_ms", "unet_total_ms", "unet_peak_gpu_bytes"} <= {s.metric for s in planned.samples}
    np.testing.assert_array_equal(image(planned, out), image(native, native_out))
    assert (out / "image.png").is_file()
    assert planned.engine["executor"] == "plan" and native.engine["executor"] == "native"
    assert planned.engine["precision"] == "fp32" and planned.engine["warnings"] == []
    assert planned.engine["kernel_timing"].startswith("gpu timestamp queries") and kernels(planned, 0)
    # the plan runs on this host's GPU: its zones are the device's, read as the native executor reads them
    assert {t.zone for t in planned.thermal} == {t.zone for t in native.thermal}


@pytest.mark.gpu
def test_a_generate_job_under_a_gpu_budget_stages_its_weights_or_fails_at_once(runs, tiny_model_dir, tmp_path):
    """gpu_budget_bytes below what the plan holds with every weight resident: the job's plan
    stages its weights, holds no more than the budget, and makes the same image; a budget too
    small for any residency fails the job with the reasons, and the native executor, which keeps
    no budget, refuses one."""
    resident, resident_out = runs("plan", "generate")
    peak = {s.metric: s.value for s in resident.samples}["peak_gpu_bytes"]
    budget = int(peak) - 1
    staged = run_on("plan", spec(model=str(tiny_model_dir), gpu_budget_bytes=budget), tmp_path / "staged")
    got = {s.metric: s.value for s in staged.samples}
    assert staged.engine["residency"] == "staged" and resident.engine["residency"] == "resident"
    assert got["peak_gpu_bytes"] <= budget and got["weight_upload_ms"] > 0
    np.testing.assert_array_equal(image(staged, tmp_path / "staged"), image(resident, resident_out))
    tight = run_job(spec(model=str(tiny_model_dir), gpu_budget_bytes=2**20, executor="plan"), tmp_path / "tight",
                    tmp_path / "root")
    assert tight.status == "failed" and "the plan does not fit: peak GPU memory" in tight.error
    assert "(staged) > the budget of 1,048,576" in tight.error
    native = run_job(spec(model=str(tiny_model_dir), gpu_budget_bytes=budget), tmp_path / "n", tmp_path / "root")
    assert native.status == "failed" and "kept by the plan and browser executors" in native.error
    with pytest.raises(ProtocolError, match="gpu_budget_bytes"):
        spec(model="m", gpu_budget_bytes=1000)


def test_tune_runs_on_the_native_executor_only(tiny_model_dir, tmp_path):
    from agent.protocol import EXECUTORS
    from engine.load import EXECUTORS as ENGINE_EXECUTORS

    assert EXECUTORS == ENGINE_EXECUTORS
    result = run_job(spec(kind="tune", model=str(tiny_model_dir), executor="plan"), tmp_path / "out",
                     tmp_path / "root")
    assert result.status == "failed"
    assert result.error.startswith("tune jobs run on the native executor (the farm tunes on the GPU host), "
                                   "not on the plan executor")
    assert "Traceback" not in result.log_tail
    assert not (tmp_path / "out" / jobs.TASK_FILE).exists()  # refused before any work
    assert not (tmp_path / "root" / "locks" / jobs.LOCK_NAME).exists()


def test_the_executor_is_part_of_the_job_spec():
    """Who runs the model travels in the spec, which the farm fills in at submission (a browser
    device's jobs say "browser"); an agent run by hand runs native unless told."""
    assert spec(model="m").executor == "native"
    with pytest.raises(ProtocolError, match="executor 'webgl' is not one of native, plan, browser"):
        spec(model="m", executor="webgl")


def test_a_configured_browser_page_refuses_a_job_of_another_executor(tiny_model_dir, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / AGENT_CONFIG_FILE).write_text(to_json(AgentConfig(browser_page="http://127.0.0.1:9/ctl/p1?key=k")))
    result = run_job(spec(model=str(tiny_model_dir)), tmp_path / "out", root)
    assert result.status == "failed"
    assert "names a browser page (agent.json), which runs jobs on the browser executor; this job asks for " \
           "the native executor" in result.error
    (root / AGENT_CONFIG_FILE).write_text('{"browser_page": 7}')
    result = run_job(spec(model=str(tiny_model_dir)), tmp_path / "out", root)
    assert result.status == "failed" and "the agent's configuration" in result.error and "browser_page" in result.error


def test_the_childs_task_reads_back_as_written_and_keeps_the_page_private(tiny_model_dir, tmp_path):
    config = AgentConfig(browser_page="http://127.0.0.1:9/ctl/p1?key=secret")
    s = spec(model=str(tiny_model_dir), executor="browser")
    task = jobs.make_task(s, tmp_path / "root", tmp_path, config=config)
    assert task.browser_page == config.browser_page and task.spec == s
    path = tmp_path / jobs.TASK_FILE
    jobs.atomic_write(path, json.dumps(to_dict(task)).encode(), mode=0o600)
    assert from_dict(jobs.ChildTask, json.loads(path.read_text())) == task
    assert os.stat(path).st_mode & 0o077 == 0
    # the page goes only to jobs on the browser executor
    assert jobs.make_task(dataclasses.replace(s, executor="plan"), tmp_path / "root", tmp_path,
                          config=config).browser_page is None


# ---- the browser executor ----------------------------------------------------------------------


@pytest.mark.gpu
def test_browser_latency_job_records_the_browser_not_this_host(tiny_model_dir, tmp_path):
    chromium = need_chromium()
    s = latency_spec(tiny_model_dir)
    s.cooldown = Cooldown(max_celsius=-30.0, max_wait_s=60.0, poll_s=0.1)  # this host's zones must not count
    result = run_on("browser", s, tmp_path / "out")
    assert metrics(result)[("unet_step_ms", "ms")] == [0, 1, 2]
    assert all(smp.value > 0 for smp in result.samples if smp.metric == "unet_step_ms")
    assert ("unet_step_peak_gpu_bytes", "bytes") in metrics(result)
    # per-kernel times from the page's timestamp queries, one set per repetition
    assert {k.repetition for k in result.kernel_timings} == {0, 1, 2}
    assert all(k.calls > 0 and k.total_ms >= 0 for k in result.kernel_timings)
    assert result.engine["kernel_timing"].startswith("gpu timestamp queries")
    assert result.engine["executor"] == "browser" and result.engine["adapter"]["architecture"] == "swiftshader"
    assert len(result.engine["plans"]) == 1  # the generation's plan is the timed step's: one on the page
    # the browser's environment: its name and version, none of this host's OS, clocks or zones
    env = result.environment
    version = subprocess.run([chromium, "--version"], capture_output=True, text=True).stdout  # "Chromium 156.0..."
    major = next(w for w in version.split() if w[:1].isdigit()).split(".")[0]
    assert env.runtime["kind"] == "browser" and env.runtime["name"] == "HeadlessChrome"
    assert env.runtime["version"].split(".")[0] == major
    assert (env.os, env.os_version, env.os_build, env.kernel, env.clocks_mhz) == ("", "", "", "", {})
    assert env.adapter["architecture"] == "swiftshader" and "adapter_id" not in env.adapter
    assert result.thermal == [] and result.cooldown_wait_s is None
    assert "this host's temperatures are not its device's" in result.log_tail


@pytest.mark.gpu
def test_browser_generate_job_matches_the_plan_executor(runs):
    need_chromium()
    planned, plan_out = runs("plan", "generate")
    browser, out = runs("browser", "generate")
    assert metrics(browser) == metrics(planned)
    a, b = image(planned, plan_out).astype(np.float64) / 255, image(browser, out).astype(np.float64) / 255
    mse = float(np.mean((a - b) ** 2))
    assert mse == 0 or 10 * np.log10(1.0 / mse) >= 40.0, f"{10 * np.log10(1.0 / mse):.1f} dB"
    assert browser.engine["executor"] == "browser" and browser.thermal == []
    assert browser.kernel_timings and {k.repetition for k in browser.kernel_timings} == {0}
