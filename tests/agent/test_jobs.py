"""agent.jobs: every kind on the tiny model yields a valid JobResult with raw samples per
repetition and hashed artifacts; the device lock (busy, stale, overdue), the time limit, the
cool-down and engine failures all end in a result.json and a released lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ci_support import missing

from agent import jobs
from agent.child import ChildJob
from agent.jobs import AgentBusy, cooling_rate, run_job
from agent.protocol import (
    Battery,
    Cooldown,
    DeviceInfo,
    JobResult,
    JobSpec,
    Manifest,
    ProtocolError,
    ThermalZone,
    from_json,
)


def spec(**kw) -> JobSpec:
    base = {"job_id": "j1", "kind": "generate", "model": "models/tiny", "precision": "fp32", "steps": 2,
            "scheduler": "euler"}
    return JobSpec(**(base | kw))


def read_result(out: Path) -> JobResult:
    return from_json(JobResult, (out / "result.json").read_text())


def check_artifacts(out: Path, result: JobResult) -> None:
    for a in result.artifacts:
        path = out / a.path
        assert path.is_file(), a
        assert jobs.sha256_file(path) == a.sha256 and path.stat().st_size == a.size, a


def lock_path(root: Path) -> Path:
    return root / "locks" / jobs.LOCK_NAME


def write_lock(root: Path, **record) -> None:
    lock_path(root).parent.mkdir(parents=True, exist_ok=True)
    lock_path(root).write_text(json.dumps({"job_id": "other", "pid": os.getpid(), "started_at": time.time(),
                                           "time_limit_s": 60.0} | record))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---- the kinds, on the GPU --------------------------------------------------------------------


@pytest.mark.gpu
def test_generate_job_writes_image_samples_and_result(tiny_model_dir, tmp_path):
    events = []
    out = tmp_path / "out"
    result = run_job(spec(model=str(tiny_model_dir), prompt="a red bicycle", seed=3), out, tmp_path / "root",
                     progress=events.append)
    assert result.status == "succeeded", result.error + result.log_tail
    assert read_result(out) == result
    metrics = {s.metric for s in result.samples}
    assert {"e2e_ms", "text_encoder_ms", "unet_total_ms", "vae_decode_ms", "peak_gpu_bytes",
            "unet_peak_gpu_bytes"} <= metrics
    assert "unet_step_ms" not in metrics  # a median over steps: latency jobs time single steps
    assert all(s.value > 0 for s in result.samples if s.metric in ("e2e_ms", "peak_gpu_bytes"))
    image = next(a for a in result.artifacts if a.kind == "image")
    assert image.path == "image.png"
    check_artifacts(out, result)
    from PIL import Image

    assert Image.open(out / "image.png").size == (64, 64)
    assert result.engine["profile"] and result.engine["precision"] == "fp32"
    assert result.engine["adapter"]["device"] == result.device and result.engine["selection"]
    assert result.finished_at >= result.started_at > 0
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished" and "step" in kinds
    assert all(e["job_id"] == "j1" for e in events)
    assert not lock_path(tmp_path / "root").exists()
    assert "generate" in (out / "job.log").read_text()
    # One profiled UNet step after the generation: its kernels, each once (lavapipe has timestamps).
    assert result.kernel_timings and {k.repetition for k in result.kernel_timings} == {0}
    assert len({k.kernel for k in result.kernel_timings}) == len(result.kernel_timings)
    assert all(k.calls > 0 and k.total_ms >= 0 for k in result.kernel_timings)
    assert result.engine["kernel_timing"].startswith("gpu timestamp queries")


@pytest.mark.gpu
def test_latency_job_has_one_sample_per_repetition(tiny_model_dir, tmp_path, gpu):
    s = spec(kind="latency", model=str(tiny_model_dir), warmup=1, unet_repetitions=3, repetitions=2, steps=1,
             height=32, width=32)
    result = run_job(s, tmp_path / "out", tmp_path / "root")
    assert result.status == "succeeded", result.error + result.log_tail
    reps = {}
    for smp in result.samples:
        reps.setdefault(smp.metric, []).append(smp.repetition)
    assert sorted(reps["unet_step_ms"]) == [0, 1, 2]
    assert sorted(reps["e2e_ms"]) == [0, 1] and sorted(reps["peak_gpu_bytes"]) == [0, 1]
    assert reps["unet_step_peak_gpu_bytes"] == [0]
    if gpu.caps.has_timestamps:
        assert {k.repetition for k in result.kernel_timings} == {0, 1, 2}
        per_rep = [k for k in result.kernel_timings if k.repetition == 0]
        assert len({k.kernel for k in per_rep}) == len(per_rep) and all(k.calls > 0 for k in per_rep)
        assert result.engine["kernel_timing_repetitions"] == 3
    assert result.engine["unet_batch"] == 2 and result.engine["height"] == 32
    check_artifacts(tmp_path / "out", result)


@pytest.mark.gpu
def test_a_latency_job_profiles_as_many_steps_as_it_is_told(tiny_model_dir, tmp_path, gpu):
    """kernel_repetitions profiled steps, apart from the timed ones (3 timed, 1 profiled)."""
    s = spec(kind="latency", model=str(tiny_model_dir), warmup=0, unet_repetitions=3, kernel_repetitions=1,
             repetitions=1, steps=1, height=32, width=32)
    result = run_job(s, tmp_path / "out", tmp_path / "root")
    assert result.status == "succeeded", result.error + result.log_tail
    assert sorted(smp.repetition for smp in result.samples if smp.metric == "unet_step_ms") == [0, 1, 2]
    if not gpu.caps.has_timestamps:
        missing("this adapter has no timestamp-query", "lavapipe has it")
    assert {k.repetition for k in result.kernel_timings} == {0} and result.engine["kernel_timing_repetitions"] == 1
    for bad in (0, -1):
        with pytest.raises(ProtocolError, match="kernel_repetitions"):
            spec(kind="latency", kernel_repetitions=bad)


@pytest.mark.gpu
def test_tune_job_writes_a_valid_profile(tiny_model_dir, tmp_path):
    from engine.profiles import load_profile_file

    s = spec(kind="tune", model=str(tiny_model_dir), warmup=0, tune_repeats=1, tune_time_budget_s=0.5)
    out = tmp_path / "out"
    result = run_job(s, out, tmp_path / "root")
    assert result.status == "succeeded", result.error + result.log_tail
    prof = next(a for a in result.artifacts if a.kind == "profile")
    check_artifacts(out, result)
    profile = load_profile_file(out / prof.path)
    assert profile.name == result.engine["profile"] and profile.measurements
    assert [s.metric for s in result.samples] == ["tune_ms"]
    # The UNet's kernels under the new profile, one profiled step.
    labels = {k.kernel.split("/")[0] for k in result.kernel_timings}
    assert all(k.calls > 0 and k.repetition == 0 for k in result.kernel_timings)
    assert {"conv2d", "attention", "group_norm"} <= labels, labels
    assert result.engine["kernel_timing"].startswith("gpu timestamp queries")


@pytest.mark.gpu
def test_engine_failure_is_a_failed_result_with_the_log(tiny_model_dir, tmp_path):
    result = run_job(spec(model=str(tiny_model_dir), scheduler="no-such-scheduler"), tmp_path / "out",
                     tmp_path / "root")
    assert result.status == "failed"
    assert "no-such-scheduler" in result.error and "Traceback" not in result.error
    assert "InputError" in result.log_tail  # the traceback is in the log, not in the error
    assert read_result(tmp_path / "out") == result
    assert not lock_path(tmp_path / "root").exists()


@pytest.mark.gpu
def test_time_limit_kills_the_job_and_releases_the_lock(tiny_model_dir, tmp_path):
    s = spec(kind="latency", model=str(tiny_model_dir), unet_repetitions=100000, time_limit_s=2.0)
    t0 = time.monotonic()
    result = run_job(s, tmp_path / "out", tmp_path / "root")
    assert time.monotonic() - t0 < 20
    assert result.status == "failed" and result.error == "time limit of 2 s exceeded"
    assert "killed the job process" in result.log_tail
    pid = int(result.log_tail.split("killed the job process ")[1].split(":")[0])
    assert not jobs.pid_alive(pid)
    assert not lock_path(tmp_path / "root").exists()
    assert read_result(tmp_path / "out").error == result.error


# ---- planning, locks, cool-down: no GPU needed -------------------------------------------------


def test_relative_model_without_a_build_fails_cleanly(tmp_path):
    result = run_job(spec(), tmp_path / "out", tmp_path / "root")
    assert result.status == "failed" and "no build is installed" in result.error
    assert read_result(tmp_path / "out").error == result.error
    assert (tmp_path / "out" / "job.log").is_file() and result.log_tail
    assert not lock_path(tmp_path / "root").exists()


def test_model_and_profile_resolve_against_the_installed_build(tmp_path, monkeypatch):
    from agent import bundle

    build = tmp_path / "root" / "builds" / "b7"
    (build / "models" / "tiny").mkdir(parents=True)
    (build / "profiles").mkdir()
    (build / "profiles" / "mine.json").write_text("{}")
    # files: none listed, so the check of a build's files before a run has nothing to hash
    installed = bundle.InstalledBuild("b7", build, manifest=Manifest(build="b7", version="0", created=0.0, files=[]))
    monkeypatch.setattr(bundle, "current_build", lambda root: installed)
    monkeypatch.setattr(bundle, "list_builds", lambda root: [installed])
    task = jobs.make_task(spec(profile="profiles/mine.json"), tmp_path / "root", tmp_path / "out")
    assert task.model == str(build / "models" / "tiny") and task.build == "b7"
    assert task.profile == str(build / "profiles" / "mine.json")
    assert jobs.make_task(spec(build="b7", profile="adreno"), tmp_path / "root", tmp_path).profile == "adreno"
    with pytest.raises(jobs.JobError, match="build 'b9' is not installed.*installed: b7"):
        jobs.make_task(spec(build="b9"), tmp_path / "root", tmp_path)
    with pytest.raises(jobs.JobError, match="not found in build 'b7'"):
        jobs.make_task(spec(model="models/sd14"), tmp_path / "root", tmp_path)
    # a model or profile named relative to the build stays in it, on any device
    (tmp_path / "root" / "secret.json").write_text("{}")
    for field in ({"model": "../../secret.json"}, {"profile": "../../secret.json"}):
        with pytest.raises(jobs.JobError, match="leads outside the build"):
            jobs.make_task(spec(**field), tmp_path / "root", tmp_path)


def test_busy_device_raises_and_leaves_the_output_alone(tmp_path):
    root = tmp_path / "root"
    write_lock(root, job_id="nightly-7")
    with pytest.raises(AgentBusy, match="device busy with job 'nightly-7' since"):
        run_job(spec(), tmp_path / "out", root)
    assert not (tmp_path / "out").exists()
    assert json.loads(lock_path(root).read_text())["job_id"] == "nightly-7"


@pytest.mark.parametrize("stale", ["dead_pid", "overdue"])
def test_stale_lock_is_recovered_with_a_log_line(tmp_path, stale):
    root = tmp_path / "root"
    if stale == "dead_pid":
        write_lock(root, pid=dead_pid())
    else:  # a live holder far past its time limit
        write_lock(root, started_at=time.time() - 3600, time_limit_s=60.0)
    result = run_job(spec(), tmp_path / "out", root)
    assert "no build is installed" in result.error  # it ran (and failed for its own reason)
    assert "recovered stale lock of job 'other'" in result.log_tail
    assert "recovered stale lock" in (root / "logs" / "agent.log").read_text()
    assert not lock_path(root).exists()


def test_cooldown_waits_until_cool(tmp_path):
    readings = iter([48.0, 44.0, 39.5, 30.0])
    calls = []

    def thermal():
        calls.append(time.monotonic())
        return next(readings)

    events = []
    s = spec(cooldown=Cooldown(max_celsius=40.0, max_wait_s=30.0, poll_s=0.05))
    result = run_job(s, tmp_path / "out", tmp_path / "root", progress=events.append, thermal=thermal)
    assert len(calls) == 3 and result.cooldown_timed_out is False
    assert 0.09 <= result.cooldown_wait_s < 5
    assert [e["celsius"] for e in events if e["event"] == "cooldown"] == [48.0, 44.0, 39.5]
    assert "cool-down: 39.5 C <= 40.0 C" in result.log_tail
    assert read_result(tmp_path / "out").cooldown_wait_s == result.cooldown_wait_s


def test_cooldown_times_out_and_runs_anyway(tmp_path):
    s = spec(cooldown=Cooldown(max_celsius=40.0, max_wait_s=0.3, poll_s=0.05))
    result = run_job(s, tmp_path / "out", tmp_path / "root", thermal=lambda: 71.0)
    assert result.cooldown_timed_out is True and 0.3 <= result.cooldown_wait_s < 5
    assert "running anyway" in result.log_tail
    assert "no build is installed" in result.error  # the job itself still ran


def test_cooldown_without_sensors_does_not_wait(tmp_path):
    s = spec(cooldown=Cooldown(max_celsius=40.0, max_wait_s=30.0, poll_s=5.0))
    result = run_job(s, tmp_path / "out", tmp_path / "root", thermal=lambda: None)
    assert result.cooldown_wait_s < 1 and result.cooldown_timed_out is False


def test_child_records_thermal_readings_before_and_after(monkeypatch, tmp_path):
    from agent import deviceinfo

    info = DeviceInfo(serial="s", model="m", manufacturer="x", os="linux", os_version="6", adapter={},
                      thermal=[ThermalZone("gpu", 41.5), ThermalZone("cpu", 39.0)],
                      battery=Battery(celsius=31.0))
    monkeypatch.setattr(deviceinfo, "collect_local", lambda adapter=None: info)
    task = jobs.ChildTask(spec=JobSpec(job_id="t", kind="generate", model="/m"), model="/m", profile="auto",
                          tuned_profiles=[], build=None, build_path=None, out_dir=str(tmp_path), root=str(tmp_path),
                          confined=False)
    child = ChildJob(task, emit=lambda e: None)
    child.thermal("before")
    child.thermal("after")
    got = [(r.phase, r.zone, r.celsius) for r in child.result.thermal]
    assert got == [("before", "gpu", 41.5), ("before", "cpu", 39.0), ("before", "battery", 31.0),
                   ("after", "gpu", 41.5), ("after", "cpu", 39.0), ("after", "battery", 31.0)]


def test_cooling_rate_is_the_least_squares_slope_of_the_window():
    rng = np.random.default_rng()
    t = np.sort(rng.uniform(0, 100, 40))
    c = 70 - 0.3 * t + rng.normal(0, 0.5, t.size)
    readings = list(zip(t.tolist(), c.tolist(), strict=True))
    recent = t >= t[-1] - 30.0
    expected = -np.polyfit(t[recent], c[recent], 1)[0] * 60.0
    assert cooling_rate(readings, 30.0) == pytest.approx(expected, rel=1e-9)
    assert cooling_rate(readings[:2], 0.0) is None  # fewer than three readings
    assert cooling_rate([(0.0, 50.0), (1.0, 49.0), (2.0, 48.0)], 5.0) is None  # the window is not covered yet


def _readings(values):
    it = iter(values)
    last = [values[-1]]

    def thermal():
        last[0] = next(it, last[0])
        return last[0]
    return thermal


def test_cooldown_stops_waiting_once_the_device_has_settled_above_the_limit(tmp_path):
    # Cools 60 -> 51 C, then stays there: it idles above 40 C, and waiting the full 30 s would
    # not make it cooler.
    s = spec(cooldown=Cooldown(max_celsius=40.0, max_wait_s=30.0, poll_s=0.05, settle_window_s=0.3,
                               settle_c_per_min=0.5))
    events = []
    result = run_job(s, tmp_path / "out", tmp_path / "root", progress=events.append,
                     thermal=_readings([60.0, 55.0, 52.0, 51.0] + [51.0] * 100))
    assert result.cooldown_timed_out is False and 0.3 <= result.cooldown_wait_s < 5
    assert "cool-down: settled at 51.0 C (> 40.0 C)" in result.log_tail
    assert events[-1]["event"] != "cooldown" and any("c_per_min" in e for e in events if e["event"] == "cooldown")


def test_cooldown_keeps_waiting_while_the_device_still_cools(tmp_path):
    # Falls 1 C per poll (1200 C/min at 0.05 s polls): never settled, so it waits for 40 C.
    s = spec(cooldown=Cooldown(max_celsius=40.0, max_wait_s=30.0, poll_s=0.05, settle_window_s=0.2))
    result = run_job(s, tmp_path / "out", tmp_path / "root", thermal=_readings([50.0 - i for i in range(20)]))
    assert result.cooldown_timed_out is False
    assert "cool-down: 40.0 C <= 40.0 C" in result.log_tail


def test_cooldown_does_not_wait_out_a_device_warmed_by_something_else(tmp_path):
    # Warming while idle (a neighbour's work heats it): the trend says waiting will not help.
    s = spec(cooldown=Cooldown(max_celsius=40.0, max_wait_s=30.0, poll_s=0.05, settle_window_s=0.2))
    result = run_job(s, tmp_path / "out", tmp_path / "root", thermal=_readings([45.0 + 0.1 * i for i in range(200)]))
    assert result.cooldown_timed_out is False and result.cooldown_wait_s < 5
    assert "settled at" in result.log_tail


@pytest.mark.gpu
def test_img2img_job_starts_from_the_image_it_carries(tiny_model_dir, tmp_path):
    import base64
    import io

    from PIL import Image

    from engine import load_pipeline

    rng = np.random.default_rng()
    init = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(init).save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    out = tmp_path / "out"
    s = spec(model=str(tiny_model_dir), prompt="a red bicycle", seed=5, init_image=uri, strength=0.6)
    result = run_job(s, out, tmp_path / "root")
    assert result.status == "succeeded", result.error + result.log_tail
    assert np.array_equal(np.asarray(Image.open(out / "init_image.png")), init)  # the image it started from
    meta = Image.open(out / "image.png").text
    assert meta["strength"] == "0.6" and meta["init_image_sha256"] == jobs.sha256_file(out / "init_image.png")
    # The engine called directly with the same image and settings: the same picture (one
    # adapter, one kernel selection: at most 1 of 255 apart per channel).
    pipe = load_pipeline(str(tiny_model_dir), precision="fp32", profile=result.engine["profile"])
    direct = pipe.generate("a red bicycle", steps=2, seed=5, height=64, width=64, scheduler="euler",
                           init_image=init, strength=0.6).image
    job_image = np.asarray(Image.open(out / "image.png").convert("RGB")).astype(int)
    assert np.abs(job_image - direct.astype(int)).max() <= 1
    txt2img = pipe.generate("a red bicycle", steps=2, seed=5, height=64, width=64, scheduler="euler").image
    assert np.abs(job_image - txt2img.astype(int)).max() > 8  # the init image changed the picture


def test_an_init_image_is_checked_before_it_travels():
    with pytest.raises(ProtocolError, match="strength must be in"):
        spec(init_image="data:image/png;base64,AAAA", strength=1.5)
    with pytest.raises(ProtocolError, match="for generate jobs"):
        spec(kind="latency", init_image="data:image/png;base64,AAAA")
    with pytest.raises(ProtocolError, match="data: URI must be"):
        spec(init_image="data:text/html;base64,AAAA")


def _install(tmp_path: Path, model: Path, tuned: dict) -> Path:
    """A build of `model` carrying `tuned` under profiles/tuned/, installed in an agent root."""
    from agent import bundle as B
    from agent.packing import build_bundle

    (tmp_path / "tuned").mkdir()
    (tmp_path / "tuned" / f"{tuned['name']}.json").write_text(json.dumps(tuned))
    B.generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    build_bundle({"models/tiny": model, "profiles/tuned": tmp_path / "tuned"}, tmp_path / "bundle", "b1",
                   "0.1.0", tmp_path / "farm.key")
    root = tmp_path / "root"
    B.install_bundle(tmp_path / "bundle", root, B.load_public_key(tmp_path / "farm.pub"))
    return root


@pytest.mark.gpu
def test_auto_runs_the_builds_profile_tuned_on_this_gpu_and_family_does_not(tiny_model_dir, tmp_path, gpu):
    import re

    from engine.profiles import SCHEMA_ID, auto_profile

    caps = gpu.caps
    tuned = {"schema": SCHEMA_ID, "name": "tuned-here", "priority": 100,
             "match": {"vendor_id": [caps.vendor_id], "device": f"^{re.escape(caps.device)}$"},
             "rules": [{"op": "attention", "variant": "reference"}], "measurements": []}
    root = _install(tmp_path, tiny_model_dir, tuned)
    results = {}
    for profile in ("auto", "family"):
        s = spec(build="b1", profile=profile, steps=1, job_id=f"j-{profile}")
        results[profile] = run_job(s, tmp_path / f"out-{profile}", root)
        assert results[profile].status == "succeeded", results[profile].error + results[profile].log_tail
    assert results["auto"].engine["profile"] == "tuned-here"
    assert results["family"].engine["profile"] == auto_profile(caps, tuned=False).name

    # Another GPU's tuned profile in the build: auto falls back to the family's.
    other = tmp_path / "other"
    other.mkdir()
    root = _install(other, tiny_model_dir, tuned | {"name": "tuned-elsewhere",
                                                    "match": {"device": "^Some Other GPU$"}})
    result = run_job(spec(build="b1", steps=1), other / "out", root)
    assert result.engine["profile"] == auto_profile(caps).name != "tuned-elsewhere"


@pytest.mark.gpu
def test_a_profile_sent_with_the_job_is_the_one_it_runs(tiny_model_dir, tmp_path):
    from engine.profiles import SCHEMA_ID

    sent = {"schema": SCHEMA_ID, "name": "tuned-sent", "rules": [{"op": "attention", "variant": "reference"}]}
    result = run_job(spec(model=str(tiny_model_dir), steps=1, profile="tuned", profile_document=sent),
                     tmp_path / "out", tmp_path / "root")
    assert result.status == "succeeded", result.error + result.log_tail
    assert result.engine["profile"] == "tuned-sent" and result.engine["requested_profile"] == "tuned"
    assert json.loads((tmp_path / "out" / "profile-used.json").read_text()) == sent
    result = run_job(spec(model=str(tiny_model_dir), profile="tuned", job_id="j2"), tmp_path / "out2",
                     tmp_path / "root")
    assert result.status == "failed" and "chosen by the farm" in result.error
