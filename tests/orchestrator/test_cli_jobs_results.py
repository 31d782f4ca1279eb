"""`farm jobs ...` and `farm results ...` through CliRunner on a fresh migrated SQLite store
filled through the store's own functions (JobResults written by hand): the listings, their
filters and --json, show, logs, the CSV export, cancel and its refusals, every user error as
one line with exit 1, and submit making one batch and one job per device. One test submits
through a real worker process and --wait, on a local-transport device (the worker machinery
of test_tasks.py)."""

from __future__ import annotations

import csv
import io
import json

import pytest
from page_devices import add_page_devices
from sqlalchemy import select
from test_tasks import deployed, farm  # noqa: F401  (fixtures: a real worker and a deployed build)
from typer.testing import CliRunner

from agent.protocol import (
    Artifact,
    JobResult,
    JobSpec,
    KernelTiming,
    Manifest,
    ManifestFile,
    Sample,
    ThermalReading,
)
from orchestrator import store
from orchestrator.cli import app
from orchestrator.store import queries
from orchestrator.store.models import Batch, DeviceState, Job, JobState

GIB = 2**30



def _one_error(result, *fragments: str) -> None:
    """Exit 3 (bad input), one line, naming what was wrong."""
    assert result.exit_code == 3, result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output


def _manifest(name: str, created: float) -> Manifest:
    return Manifest(build=name, version="0.1.0", created=created, files=[
        ManifestFile("engine/__init__.py", "a" * 64, 10),
        ManifestFile("models/tiny/model_index.json", "b" * 64, 20),
        ManifestFile("models/tiny/unet/diffusion_pytorch_model.safetensors", "c" * 64, 1000)])


def _run(session, job_id: int, result: JobResult) -> None:
    """What a worker does with one attempt: running, the result recorded, the final state."""
    store.transition_job(session, job_id, JobState.running, worker="w1@testhost")
    store.record_result(session, job_id, result)
    state = JobState.succeeded if result.status == "succeeded" else JobState.failed
    store.transition_job(session, job_id, state, error=result.error, log_tail=result.log_tail)


@pytest.fixture
def seeded(cli):
    """Two phones and a quarantined one, builds b1 then b2, and five jobs:
    1 latency on phone-1/b1 succeeded (unet_step_ms 10, 12, 11, 50; two kernel repetitions),
    2 generate on phone-2/b2 succeeded (an image), 3 latency on phone-1/b2 failed,
    4 generate on phone-2/b2 queued, 5 latency on phone-1/b2 running; 2 and 3 in batch "nightly"."""
    with cli.Session() as s, s.begin():
        p1 = store.upsert_device(s, "phone-1", "adb", "127.0.0.1:5555", host="testhost")
        p2 = store.upsert_device(s, "phone-2", "adb", "127.0.0.1:5556", host="testhost")
        q3 = store.upsert_device(s, "phone-3", "adb", "127.0.0.1:5557", host="testhost")
        for d in (p1, p2):
            store.set_device_state(s, d.id, DeviceState.available)
        store.set_device_state(s, q3.id, DeviceState.quarantined, "battery swollen", force=True)
        b1 = store.create_build(s, _manifest("b1", 1_700_000_000.0))
        b2 = store.create_build(s, _manifest("b2", 1_700_100_000.0))
        batch = Batch(name="nightly", build_id=b2.id)
        s.add(batch)
        s.flush()
        spec = {"model": "models/tiny", "precision": "fp32", "steps": 2}
        jobs = [store.create_job(s, kind, spec, dev.id, build.id) for kind, dev, build in
                [("latency", p1, b1), ("generate", p2, b2), ("latency", p1, b2), ("generate", p2, b2),
                 ("latency", p1, b2)]]
        jobs[1].batch_id = jobs[2].batch_id = batch.id
        s.flush()
        ids = [j.id for j in jobs]
        _run(s, ids[0], JobResult(
            job_id="job1-a1", kind="latency", status="succeeded", started_at=1_700_000_100.0,
            finished_at=1_700_000_160.0, device="Adreno (TM) 740", cooldown_wait_s=3.5,
            engine={"profile": "adreno", "precision": "fp32", "height": 64, "width": 64},
            samples=[*(Sample("unet_step_ms", v, "ms", r) for r, v in enumerate([10.0, 12.0, 11.0, 50.0])),
                     *(Sample("e2e_ms", v, "ms", r) for r, v in enumerate([100.0, 110.0, 105.0])),
                     Sample("peak_gpu_bytes", GIB, "bytes")],
            kernel_timings=[KernelTiming("conv2d", 10, 5.0, 0), KernelTiming("conv2d", 10, 7.0, 1),
                            KernelTiming("attention/flash", 4, 2.0, 0), KernelTiming("attention/flash", 4, 2.0, 1)],
            thermal=[ThermalReading("before", "gpu", 31.0), ThermalReading("after", "gpu", 44.5)],
            log_tail="[job] load\n[job] unet_step\n[job] done\n"))
        _run(s, ids[1], JobResult(
            job_id="job2-a1", kind="generate", status="succeeded", started_at=1_700_100_100.0,
            finished_at=1_700_100_130.0, device="Mali-G710",
            samples=[Sample("e2e_ms", 200.0, "ms"), Sample("peak_gpu_bytes", 2 * GIB, "bytes"),
                     Sample("load_ms", 40.0, "ms")],
            artifacts=[Artifact("image.png", "d" * 64, 4096, "image")]))
        _run(s, ids[2], JobResult(
            job_id="job3-a1", kind="latency", status="failed", error="out of GPU memory\nat unet",
            samples=[Sample("load_ms", 41.0, "ms")], log_tail="[job] load\nout of GPU memory\n"))
        store.transition_job(s, ids[4], JobState.running, worker="w1@testhost")
        store.record_job_progress(s, ids[4], 1, {"attempt": 1, "phase": "unet_step", "done": 4, "total": 10})
        store.record_job_progress(s, ids[3], 1, {"attempt": 1, "phase": "ignored"})  # not running: left alone
    cli.ids, cli.batch_id = ids, batch.id
    return cli


# ---- jobs ---------------------------------------------------------------------------------


def test_jobs_list_filters_and_json(seeded):
    cli, ids = seeded, seeded.ids
    listing = json.loads(cli("jobs", "list", "--json").output)
    assert [j["id"] for j in listing] == ids[::-1]
    by_id = {j["id"]: j for j in listing}
    assert (by_id[ids[0]]["state"], by_id[ids[0]]["device"], by_id[ids[0]]["build"]) == ("succeeded", "phone-1", "b1")
    assert by_id[ids[0]]["attempts"] == 1 and by_id[ids[0]]["finished_at"] is not None
    assert by_id[ids[3]]["state"] == "queued" and by_id[ids[3]]["attempts"] == 0

    def ids_of(*args):
        return [j["id"] for j in json.loads(cli("jobs", "list", "--json", *args).output)]

    assert ids_of("--state", "running") == [ids[4]]
    assert ids_of("--device", "phone-2") == [ids[3], ids[1]]
    assert ids_of("--build", "b1") == [ids[0]]
    assert ids_of("--batch", str(cli.batch_id)) == [ids[2], ids[1]]
    assert ids_of("--device", "phone-1", "--build", "b2", "--state", "failed") == [ids[2]]
    assert ids_of("--limit", "2") == [ids[4], ids[3]]
    assert ids_of("--device", "phone-3") == []

    text = cli("jobs", "list").output
    assert "phone-1" in text and "succeeded" in text and "queued" in text
    assert "no jobs match" in cli("jobs", "list", "--device", "phone-3").output


def test_jobs_show_logs(seeded):
    cli, ids = seeded, seeded.ids
    shown = json.loads(cli("jobs", "show", str(ids[0]), "--json").output)
    # the whole spec as the device ran it: what was asked, the protocol's defaults, its job's names
    assert shown["spec"] | {"model": "models/tiny", "precision": "fp32", "steps": 2} == shown["spec"]
    assert (shown["spec"]["job_id"], shown["spec"]["kind"], shown["spec"]["scheduler"]) == (f"job{ids[0]}", "latency", "pndm")
    assert shown["state"] == "succeeded" and shown["attempts"] == 1 and shown["worker"] == "w1@testhost"
    assert shown["worker_losses"] == 0
    (run,) = shown["runs"]
    assert run["status"] == "succeeded" and run["attempt"] == 1
    assert run["medians"] == {"unet_step_ms": 11.5, "e2e_ms": 105.0, "peak_gpu_bytes": float(GIB)}

    failed = json.loads(cli("jobs", "show", str(ids[2]), "--json").output)
    assert failed["state"] == "failed" and failed["error"].startswith("out of GPU memory")
    assert failed["runs"][0]["status"] == "failed" and failed["batch_id"] == cli.batch_id
    queued = json.loads(cli("jobs", "show", str(ids[3]), "--json").output)
    assert queued["runs"] == [] and queued["started_at"] is None and queued["progress"] is None
    running = json.loads(cli("jobs", "show", str(ids[4]), "--json").output)
    assert running["progress"] == {"attempt": 1, "phase": "unet_step", "done": 4, "total": 10}
    assert "unet_step 4/10" in cli("jobs", "show", str(ids[4])).output

    text = cli("jobs", "show", str(ids[0])).output
    assert "unet_step_ms" in text and "11.5" in text and "models/tiny" in text
    assert "no runs yet" in cli("jobs", "show", str(ids[3])).output

    logs = cli("jobs", "logs", str(ids[0])).output
    assert "[job] unet_step" in logs and "attempt 1" in logs
    last = cli("jobs", "logs", str(ids[0]), "-n", "1").output
    assert "[job] done" in last and "[job] unet_step" not in last
    failed_logs = cli("jobs", "logs", str(ids[2])).output
    assert "out of GPU memory" in failed_logs and "error:" in failed_logs
    assert "no log yet" in cli("jobs", "logs", str(ids[3])).output


def test_cancel_queued_and_running_jobs_and_refusals(seeded):
    cli, ids = seeded, seeded.ids
    assert f"job {ids[3]} cancelled" in cli("jobs", "cancel", str(ids[3])).output
    assert f"job {ids[4]} cancelled" in cli("jobs", "cancel", str(ids[4])).output
    with cli.Session() as s:
        for job_id in (ids[3], ids[4]):
            job = s.get(Job, job_id)
            assert job.state == JobState.cancelled and job.finished_at is not None
            assert job.error == "cancelled by operator"
        # the worker that was running job 5 cannot record its outcome over the cancel
        with pytest.raises(store.InvalidTransition):
            store.transition_job(s, ids[4], JobState.succeeded)
    _one_error(cli("jobs", "cancel", str(ids[0]), ok=False), f"job {ids[0]} is succeeded", "queued or running")
    _one_error(cli("jobs", "cancel", str(ids[3]), ok=False), "is cancelled")
    _one_error(cli("jobs", "cancel", "9999", ok=False), "no job 9999")


def test_unknown_references_are_one_error_each(seeded):
    cli = seeded
    for args, *fragments in [
        (["jobs", "show", "9999"], "no job 9999"),
        (["jobs", "logs", "9999"], "no job 9999"),
        (["jobs", "list", "--device", "nope"], "no device 'nope'"),
        (["jobs", "list", "--build", "nope"], "no build 'nope'"),
        (["results", "list", "--device", "nope"], "no device 'nope'"),
        (["results", "list", "--build", "nope"], "no build 'nope'"),
        (["results", "export", "--csv", str(cli.tmp / "x.csv"), "--build", "nope"], "no build 'nope'"),
        (["results", "show", "9999"], "no run 9999"),
        (["jobs", "submit", "latency", "--build", "nope", "--all"], "no build 'nope'"),
        (["jobs", "submit", "latency", "--device", "nope"], "no device 'nope'"),
        (["jobs", "submit", "latency"], "--device SERIAL"),
        (["jobs", "submit", "latency", "--all", "--device", "phone-1"], "not both"),
        (["jobs", "submit", "latency", "--device", "phone-3"], "quarantined", "battery swollen"),
        (["jobs", "submit", "latency", "--all", "--precision", "fp8"], "precision"),
        (["jobs", "submit", "latency", "--all", "--steps", "0"], "steps must be at least 1"),
        (["jobs", "submit", "latency", "--all", "--scheduler", "magic"], "--scheduler 'magic'"),
        (["jobs", "submit", "latency", "--all", "--resolution", "500x512"], "multiples of 8"),
        (["jobs", "submit", "latency", "--all", "--timeout", "5"], "--wait"),
    ]:
        _one_error(cli(*args, ok=False), *fragments)
    assert not (cli.tmp / "x.csv").exists()
    with cli.Session() as s:  # nothing was queued by the refused submits
        assert len(s.scalars(select(Job)).all()) == len(cli.ids)
    assert cli("jobs", "list", "--state", "nope", ok=False).exit_code == 3  # a usage error: bad input


# ---- results ------------------------------------------------------------------------------


def test_results_list_filters_and_json(seeded):
    cli, ids = seeded, seeded.ids
    rows = json.loads(cli("results", "list", "--json").output)
    assert [r["job_id"] for r in rows] == [ids[2], ids[1], ids[0]]
    latency, generate, failed = rows[2], rows[1], rows[0]
    assert (latency["device"], latency["build"], latency["kind"], latency["status"]) == \
        ("phone-1", "b1", "latency", "succeeded")
    assert latency["medians"] == {"unet_step_ms": 11.5, "e2e_ms": 105.0, "peak_gpu_bytes": float(GIB)}
    assert latency["finished_at"].startswith("2023-11-14T22:")
    assert generate["medians"] == {"e2e_ms": 200.0, "peak_gpu_bytes": float(2 * GIB)}
    assert failed["status"] == "failed" and failed["medians"] == {}

    def jobs_of(*args):
        return [r["job_id"] for r in json.loads(cli("results", "list", "--json", *args).output)]

    assert jobs_of("--device", "phone-1") == [ids[2], ids[0]]
    assert jobs_of("--build", "b2") == [ids[2], ids[1]]
    assert jobs_of("--kind", "generate") == [ids[1]]
    assert jobs_of("--metric", "unet_step_ms") == [ids[0]]
    assert jobs_of("--limit", "1") == [ids[2]]
    load = json.loads(cli("results", "list", "--json", "--metric", "load_ms").output)
    assert [(r["job_id"], r["medians"]["load_ms"]) for r in load] == [(ids[2], 41.0), (ids[1], 40.0)]

    text = cli("results", "list").output
    assert "unet_step_ms" in text and "11.50 ms" in text and "1.00 GiB" in text  # orchestrator/cli/numbers.py
    assert "no runs match" in cli("results", "list", "--device", "phone-3").output


def test_results_show(seeded):
    cli = seeded
    run_id = json.loads(cli("results", "list", "--json", "--build", "b1").output)[0]["run_id"]
    shown = json.loads(cli("results", "show", str(run_id), "--json").output)
    assert (shown["device"], shown["build"], shown["kind"], shown["adapter"]) == \
        ("phone-1", "b1", "latency", "Adreno (TM) 740")
    metrics = {m["metric"]: m for m in shown["metrics"]}
    assert metrics["unet_step_ms"] == {"metric": "unet_step_ms", "unit": "ms", "n": 4, "median": 11.5,
                                       "min": 10.0, "max": 50.0}
    assert (metrics["e2e_ms"]["n"], metrics["e2e_ms"]["median"]) == (3, 105.0)
    assert metrics["peak_gpu_bytes"]["unit"] == "bytes"
    assert shown["kernels"] == [
        {"kernel": "conv2d", "calls": 20, "total_ms": 12.0, "repetitions": 2, "ms_per_repetition": 6.0},
        {"kernel": "attention/flash", "calls": 8, "total_ms": 4.0, "repetitions": 2, "ms_per_repetition": 2.0}]
    assert shown["thermal"] == [{"phase": "before", "zone": "gpu", "celsius": 31.0},
                                {"phase": "after", "zone": "gpu", "celsius": 44.5}]
    assert shown["cooldown"] == {"wait_s": 3.5, "timed_out": False}
    assert shown["engine"]["profile"] == "adreno" and shown["images"] == []

    text = cli("results", "show", str(run_id)).output
    for fragment in ("unet_step_ms", "50.000", "conv2d", "6.000", "44.5", "waited 3.5 s", "adreno"):
        assert fragment in text, text

    generate_run = json.loads(cli("results", "list", "--json", "--kind", "generate").output)[0]["run_id"]
    image = json.loads(cli("results", "show", str(generate_run), "--json").output)["images"]
    # the prompt and seed the image was made with: the protocol's defaults, which the stored spec holds
    assert image == [{"path": "image.png", "sha256": "d" * 64, "size": 4096, "prompt": JobSpec.prompt, "seed": 0}]
    assert "image: image.png" in cli("results", "show", str(generate_run)).output


def test_results_export_csv(seeded):
    cli, ids = seeded, seeded.ids
    out = cli.tmp / "samples.csv"
    assert "wrote 12 samples of 3 runs" in cli("results", "export", "--csv", str(out)).output
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(queries.EXPORT_COLUMNS)
    assert len(rows) == 12
    unet = [r for r in rows if r["metric"] == "unet_step_ms"]
    assert [(float(r["value"]), int(r["repetition"])) for r in unet] == [(10.0, 0), (12.0, 1), (11.0, 2), (50.0, 3)]
    assert {(r["job_id"], r["device"], r["build"], r["kind"], r["unit"]) for r in unet} == \
        {(str(ids[0]), "phone-1", "b1", "latency", "ms")}
    assert unet[0]["run_finished_at"].startswith("2023-11-14T22:")

    cli("results", "export", "--csv", str(out), "--device", "phone-1", "--metric", "e2e_ms")
    with out.open(newline="") as f:
        assert [float(r["value"]) for r in csv.DictReader(f)] == [100.0, 110.0, 105.0]
    cli("results", "export", "--csv", str(out), "--build", "b2", "--kind", "latency")
    with out.open(newline="") as f:
        assert [(r["metric"], r["value"]) for r in csv.DictReader(f)] == [("load_ms", "41.0")]

    stdout = cli("results", "export", "--csv", "-", "--kind", "generate").output
    assert [r["metric"] for r in csv.DictReader(io.StringIO(stdout))] == ["e2e_ms", "peak_gpu_bytes", "load_ms"]

    # chunked reading (one run per transaction) gives the same rows as one chunk
    one_by_one = list(queries.iter_samples(cli.Session, runs_per_chunk=1))
    assert one_by_one == list(queries.iter_samples(cli.Session, runs_per_chunk=1000))
    assert len(one_by_one) == 12 and [r[0] for r in one_by_one] == sorted(r[0] for r in one_by_one)

    _one_error(cli("results", "export", "--csv", str(cli.tmp / "no" / "dir.csv"), ok=False), "cannot write")


def test_metric_series_along_builds(seeded):
    cli = seeded
    with cli.Session() as s, s.begin():
        p1 = store.get_device(s, "phone-1")
        b2 = store.get_build(s, "b2")
        job = store.create_job(s, "latency", {"model": "models/tiny"}, p1.id, b2.id)
        _run(s, job.id, JobResult(job_id="x", kind="latency", status="succeeded",
                                  samples=[Sample("unet_step_ms", 9.0, "ms", 0), Sample("unet_step_ms", 8.0, "ms", 1)]))
    with cli.Session() as s:
        series = queries.metric_series(s, p1.id, "unet_step_ms")
        assert [(b, v) for b, _, _, _, v in series] == [("b1", 10.0), ("b1", 12.0), ("b1", 11.0), ("b1", 50.0),
                                                         ("b2", 9.0), ("b2", 8.0)]
        newest = queries.metric_series(s, p1.id, "unet_step_ms", limit_builds=1)
        assert [(b, v) for b, _, _, _, v in newest] == [("b2", 9.0), ("b2", 8.0)]


# ---- submit -------------------------------------------------------------------------------


def test_submit_makes_one_batch_and_one_job_per_device(seeded, monkeypatch):
    cli = seeded
    sent: list[list[int]] = []
    monkeypatch.setattr("orchestrator.jobs.jobservice.send_jobs", lambda app, job_ids, strict: sent.append(list(job_ids)))

    out = json.loads(cli("jobs", "submit", "latency", "--all", "--precision", "fp32", "--steps", "4",
                         "--resolution", "64x96", "--repetitions", "6", "--warmup", "0", "--cooldown", "38",
                         "--no-kernel-timings", "--time-limit", "90", "--gpu-budget-mb", "2093", "--json").output)
    assert out["build"] == "b2" and out["kind"] == "latency"  # the newest build by default
    assert [j["device"] for j in out["jobs"]] == ["phone-1", "phone-2"]  # not the quarantined phone-3
    job_ids = [j["id"] for j in out["jobs"]]
    assert sent == [job_ids]
    with cli.Session() as s:
        batch = s.get(Batch, out["batch_id"])
        assert batch.build.name == "b2" and batch.name.startswith("latency b2 ")
        assert [j.id for j in batch.jobs] == job_ids
        for job in batch.jobs:
            assert (job.state, job.kind, job.build.name) == (JobState.queued, "latency", "b2")
            spec = job.spec
            assert spec["model"] == "models/tiny" and spec["build"] == "b2"  # the build's only model
            assert (spec["precision"], spec["steps"], spec["height"], spec["width"]) == ("fp32", 4, 64, 96)
            assert (spec["repetitions"], spec["warmup"], spec["kernel_timings"], spec["time_limit_s"]) == \
                (6, 0, False, 90.0)
            assert spec["cooldown"]["max_celsius"] == 38.0
            assert spec["gpu_budget_bytes"] == 2_093_000_000
            assert (spec["job_id"], spec["kind"], spec["executor"]) == (f"job{job.id}", "latency", "native")  # whole

    text = cli("jobs", "submit", "generate", "--build", "b1", "--device", "phone-2", "--device", "phone-2",
               "--name", "smoke", "--model", "models/other").output
    assert "smoke" in text and "b1" in text and "on phone-2" in text
    assert len(sent) == 2 and len(sent[1]) == 1  # a device named twice gets one job
    (job,) = json.loads(cli("jobs", "list", "--json", "--limit", "1").output)
    assert (job["kind"], job["build"], job["device"]) == ("generate", "b1", "phone-2")
    assert json.loads(cli("jobs", "show", str(job["id"]), "--json").output)["spec"]["model"] == "models/other"


@pytest.mark.parametrize(("args", "fragment"), [
    (["--time-limit", "nan"], "time_limit_s must be a finite number"),  # Popen.wait(timeout=nan) never expires
    (["--time-limit", "inf"], "time_limit_s must be a finite number"),
    (["--time-limit", "864000"], "time_limit_s must be in (0, 604800]"),
    (["--guidance-scale", "nan"], "guidance_scale must be a finite number"),
    (["--guidance-scale", "-1"], "guidance_scale must be in [0, 100]"),
    (["--steps", "1000000000"], "steps must be in [1, 1000], got 1000000000"),
    (["--resolution", "65536x65536"], "height must be in [8, 4096], got 65536"),
    (["--repetitions", "100000000"], "repetitions must be in [0, 1000000], got 100000000"),
    (["--seed", "-5"], "seed must be in [0, 18446744073709551615], got -5"),
    (["--cooldown", "nan"], "max_celsius must be a finite number"),
    (["--cooldown", "40", "--cooldown-wait", "inf"], "max_wait_s must be a finite number"),
    (["--tune-budget", "nan"], "tune_time_budget_s must be a finite number"),
    (["--gpu-budget-mb", "nan"], "--gpu-budget-mb nan: expected a positive number of MB"),
    (["--gpu-budget-mb", "0.5"], "gpu_budget_bytes must be in [1048576, 1099511627776], got 500000"),
])
def test_submit_refuses_numbers_that_never_end_or_cannot_run(seeded, monkeypatch, args, fragment):
    """`--time-limit nan` was stored (inf was refused) and no timer would ever end that job;
    NaN guidance, a billion steps and 65536x65536 were accepted too. One line each, and nothing
    is queued."""
    cli = seeded
    sent = []
    monkeypatch.setattr("orchestrator.jobs.jobservice.send_jobs", lambda app, job_ids, strict: sent.append(job_ids))
    before = json.loads(cli("jobs", "list", "--json").output)
    _one_error(cli("jobs", "submit", "latency", "--device", "phone-1", *args, ok=False), fragment)
    assert json.loads(cli("jobs", "list", "--json").output) == before and sent == []


def test_submit_refuses_a_job_a_browser_device_cannot_hold(cli, tiny_model_dir, monkeypatch):
    """A phone's page that cannot hold the job's plan (the adapter its discovery recorded, the
    job's GPU budget) would fail only on the phone: `farm jobs submit` records the plan for that
    adapter, says what does not fit on which device, and queues nothing."""
    sent = []
    monkeypatch.setattr("orchestrator.jobs.jobservice.send_jobs", lambda app, job_ids, strict: sent.append(list(job_ids)))
    add_page_devices(cli, _manifest("b9", 1_700_000_000.0), tiny_model_dir)
    submit = ("jobs", "submit", "generate", "--build", "b9", "--precision", "fp32", "--steps", "2",
              "--scheduler", "euler")

    over = cli(*submit, "--device", "page-1", "--gpu-budget-mb", "2", ok=False)
    assert over.exit_code == 3 and "nothing queued: the job does not fit page-1 (peak GPU memory" in over.output
    assert "> the budget of 2,000,000" in over.output
    narrow_out = cli(*submit, "--device", "page-1", "--device", "page-2", ok=False)
    assert narrow_out.exit_code == 3 and "page-2 (max binding bytes" in narrow_out.output
    assert "page-1" not in narrow_out.output.split("does not fit")[1]  # page-1 can hold it
    assert sent == [] and json.loads(cli("jobs", "list", "--json").output) == []
    queued = json.loads(cli(*submit, "--device", "page-1", "--gpu-budget-mb", "100", "--json").output)
    assert [j["device"] for j in queued["jobs"]] == ["page-1"] and len(sent) == 1


def test_submit_that_cannot_reach_the_workers_cancels_its_jobs(seeded, monkeypatch):
    cli = seeded

    def broker_down(app, job_ids, strict):
        raise ConnectionError("broker down")

    monkeypatch.setattr("orchestrator.jobs.jobservice.send_jobs", broker_down)
    unsent = cli("jobs", "submit", "latency", "--device", "phone-1", ok=False)
    assert unsent.exit_code == 4, unsent.output  # the farm could not run it, the input was fine
    assert "broker down" in unsent.output and "cancelled" in unsent.output and len(unsent.output.splitlines()) == 1
    (job,) = json.loads(cli("jobs", "list", "--json", "--limit", "1").output)
    assert job["state"] == "cancelled" and "not sent" in job["error"]


def test_a_broker_failing_part_way_through_a_submit_leaves_the_job_a_worker_started(seeded, monkeypatch):
    """The first job went out and a worker started it before the broker failed on the second:
    cancelling it too would stop work that is under way (a running job is stopped on its
    device when cancelled)."""
    cli = seeded

    def first_then_down(app, job_ids, strict):
        with cli.Session() as session, session.begin():
            store.transition_job(session, job_ids[0], JobState.running, worker="w1")  # a worker took it
        raise ConnectionError("broker down after the first message")

    monkeypatch.setattr("orchestrator.jobs.jobservice.send_jobs", first_then_down)
    out = cli("jobs", "submit", "latency", "--device", "phone-1", "--device", "phone-2", ok=False).output
    assert "1 unsent job(s) are cancelled" in " ".join(out.split()) and "reached a worker and go on" in out
    first, second = sorted(json.loads(cli("jobs", "list", "--json", "--limit", "2").output), key=lambda j: j["id"])
    assert first["state"] == "running" and second["state"] == "cancelled"


def test_submit_img2img_carries_its_image_in_the_job(cli_db, monkeypatch):
    import base64

    import numpy as np
    from PIL import Image

    cli = cli_db
    monkeypatch.setattr("orchestrator.jobs.jobservice.send_jobs", lambda app, job_ids, strict: None)
    with cli.Session() as s, s.begin():
        store.set_device_state(s, store.upsert_device(s, "phone-1", "adb", "127.0.0.1:5555", host="testhost").id,
                               DeviceState.available)
        store.create_build(s, _manifest("b1", 1_700_000_000.0))
    image = cli.tmp / "start.png"
    Image.fromarray(np.random.default_rng().integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(image)
    out = json.loads(cli("jobs", "submit", "generate", "--device", "phone-1", "--init-image", str(image),
                         "--strength", "0.55", "--json").output)
    with cli.Session() as s:
        spec = s.get(Job, out["jobs"][0]["id"]).spec
    kind, _, payload = spec["init_image"].partition(",")
    assert kind == "data:image/png;base64" and base64.b64decode(payload) == image.read_bytes()
    assert spec["strength"] == 0.55
    plain = json.loads(cli("jobs", "submit", "generate", "--device", "phone-1", "--json").output)
    with cli.Session() as s:
        assert s.get(Job, plain["jobs"][0]["id"]).spec["init_image"] is None

    Image.new("RGB", (8, 8)).save(cli.tmp / "start.gif")
    (cli.tmp / "notes.png").write_text("not an image")
    for args, fragment in [(["--strength", "0.5"], "--strength needs --init-image"),
                           (["--init-image", str(image), "--strength", "1.5"], "strength must be in (0, 1]"),
                           (["--init-image", str(cli.tmp / "notes.png")], "not a readable image"),
                           (["--init-image", str(cli.tmp / "start.gif")], "give a PNG or JPEG"),
                           (["--init-image", str(cli.tmp / "missing.png")], "missing.png")]:
        _one_error(cli("jobs", "submit", "generate", "--device", "phone-1", *args, ok=False), fragment)
    _one_error(cli("jobs", "submit", "latency", "--device", "phone-1", "--init-image", str(image), ok=False),
               "--init-image is for generate jobs")


def test_submit_with_no_builds_is_one_error(cli):
    _one_error(cli("jobs", "submit", "generate", "--all", ok=False), "no builds yet")


# ---- a real worker --------------------------------------------------------------------------


@pytest.mark.gpu
def test_submit_wait_on_a_real_worker(deployed, monkeypatch):  # noqa: F811  (the fixture imported above)
    settings = deployed["app"].farm_settings
    for key, value in {"FARM_DATABASE_URL": settings.database_url, "FARM_DATA_DIR": str(settings.data_dir),
                       "FARM_CONFIG_DIR": str(settings.config_dir), "FARM_HOST_NAME": settings.host_name}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("FARM_BROKER_URL", raising=False)
    runner = CliRunner()

    def farm_cli(*args):
        return runner.invoke(app, list(args))

    common = ["--device", "local-1", "--build", "b1", "--precision", "fp32", "--steps", "2", "--scheduler",
              "euler", "--time-limit", "120", "--wait", "--timeout", "120"]
    done = farm_cli("jobs", "submit", "generate", *common)
    assert done.exit_code == 0, done.output + deployed["log"].read_text()[-3000:]
    assert "succeeded" in done.output and "1/1 ended" in done.output

    (row,) = json.loads(farm_cli("results", "list", "--json", "--limit", "1").output)
    assert row["device"] == "local-1" and row["status"] == "succeeded" and row["medians"]["e2e_ms"] > 0
    shown = json.loads(farm_cli("results", "show", str(row["run_id"]), "--json").output)
    assert {"e2e_ms", "peak_gpu_bytes", "load_ms"} <= {m["metric"] for m in shown["metrics"]}
    assert shown["images"] and shown["images"][0]["seed"] == 0
    job = json.loads(farm_cli("jobs", "show", str(row["job_id"]), "--json").output)
    assert job["state"] == "succeeded" and job["batch_id"] is not None and job["spec"]["model"] == "models/tiny"
    assert farm_cli("jobs", "logs", str(row["job_id"])).exit_code == 0

    # a job that fails on the device makes --wait exit 4 (could not run), as JSON too
    failed = farm_cli("jobs", "submit", "generate", *common, "--model", "models/missing", "--json")
    assert failed.exit_code == 4, failed.output
    (outcome,) = json.loads(failed.output)["jobs"]
    assert outcome["state"] == "failed" and outcome["error"]
