"""Results the store cannot keep, on SQLite and PostgreSQL: a NaN sample (SQLite stores it as
NULL and refuses the row), NaN in the engine's JSON, a NUL character (PostgreSQL refuses it),
and a database error while recording. Each made the job stay `running`, the reconciler call it
"worker lost" and run it again, 8 times, recording nothing. Now the attempt ends once, failed,
with the reason, and the device is free. The protocol refuses NaN, infinities and NUL where a
result is read (from_json), with the field named."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from sqlalchemy.exc import OperationalError

from agent.protocol import BadValue, JobResult, Manifest, ManifestFile, Sample, from_json
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs import reconciler, worker
from orchestrator.jobs.celery_app import make_celery
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import DeviceState, Job, JobState, Run

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 1, "scheduler": "euler", "time_limit_s": 120.0}


@pytest.fixture
def farm(tmp_path, db_url):
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="badhost",
                        database_url=db_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    yield SimpleNamespace(settings=settings, Session=make_session_factory(engine), app=make_celery(settings))
    engine.dispose()


class OneResult:
    """A device whose every run returns `result` (with the job's id)."""

    def __init__(self, result: JobResult):
        self.result, self.runs = result, 0

    def __call__(self, device, settings):  # make_transport's signature
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def run(self, spec, out_dir, progress=None):
        self.runs += 1
        self.result.job_id, self.result.kind = spec.job_id, spec.kind
        return self.result


def _job(farm) -> tuple[int, int]:
    manifest = Manifest(build="b-bad", version="0.1.0", created=1_700_000_000.0,
                        files=[ManifestFile("engine/a.py", "a" * 64, 10)])
    with farm.Session() as s, s.begin():
        build_id = store.create_build(s, manifest).id
        device = store.upsert_device(s, "p-bad", "local", "/tmp/p-bad", host="badhost")
        device.state = DeviceState.available  # as a probe would have found it
        s.flush()
        return store.create_job(s, "latency", SPEC, device.id, build_id).id, device.id


def _ok() -> JobResult:
    return JobResult(job_id="j", kind="latency", status="succeeded",
                     samples=[Sample("unet_step_ms", 12.5, "ms", 0)])


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda r: r.samples.append(Sample("unet_step_ms", float("nan"), "ms", 1)),
     "result.samples[1].value must be a finite number, got nan"),
    (lambda r: r.samples.append(Sample("e2e_ms", float("inf"), "ms", 0)), "must be a finite number, got inf"),
    (lambda r: r.engine.update(timings={"unet": [1.0, float("nan")]}), "result.engine.timings.unet[1]"),
    (lambda r: setattr(r, "error", "bad\x00byte"), "result.error: contains a NUL character"),
    (lambda r: r.engine.update(note="a\x00b"), "result.engine.note: contains a NUL character"),
])
def test_a_result_the_store_cannot_keep_ends_the_job_once_as_failed(farm, monkeypatch, damage, reason):
    job_id, device_id = _job(farm)
    result = _ok()
    damage(result)
    device = OneResult(result)
    monkeypatch.setattr(worker, "make_transport", device)
    assert worker.run_attempt(farm.app, job_id, worker="test") == "failed"
    assert worker.run_attempt(farm.app, job_id, worker="test") == "skipped"  # nothing to run again
    report = reconciler.reconcile(farm.app)  # the reconciler finds nothing lost either
    assert not report.get("requeued") and not report.get("worker_lost"), report
    assert device.runs == 1
    with farm.Session() as s:
        job = s.get(Job, job_id)
        assert (job.state, job.attempts, job.worker_losses) == (JobState.failed, 1, 0)
        assert "cannot be stored" in job.error and reason in job.error, job.error
        assert s.query(Run).filter_by(job_id=job_id).count() == 0
        assert store.get_device(s, device_id).lease_holder is None  # given back


def test_a_database_error_while_recording_ends_the_attempt_once(farm, monkeypatch):
    job_id, device_id = _job(farm)
    device = OneResult(_ok())
    monkeypatch.setattr(worker, "make_transport", device)

    def disk_full(*args, **kwargs):
        raise OperationalError("INSERT INTO runs ...", {}, Exception("database or disk is full"))

    monkeypatch.setattr(store, "record_result", disk_full)
    assert worker.run_attempt(farm.app, job_id, worker="test") == "failed"
    monkeypatch.undo()
    assert device.runs == 1
    with farm.Session() as s:
        job = s.get(Job, job_id)
        assert (job.state, job.attempts) == (JobState.failed, 1)
        assert job.error.startswith("the store could not record the result (OperationalError: ")
        assert "database or disk is full" in job.error
        assert store.get_device(s, device_id).lease_holder is None


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"job_id": "j", "kind": "latency", "status": "succeeded", "samples": '
     '[{"metric": "unet_step_ms", "value": NaN, "unit": "ms"}]}', "NaN is not a number JSON has"),
    ('{"job_id": "j", "kind": "latency", "status": "succeeded", "started_at": Infinity}', "Infinity"),
    (json.dumps({"job_id": "j", "kind": "latency", "status": "succeeded", "log_tail": "x\x00y"}),
     "JobResult.log_tail: contains a NUL character"),
    (json.dumps({"job_id": "j", "kind": "latency", "status": "succeeded", "engine": {"k\x00": 1}}),
     "NUL"),
])
def test_the_protocol_refuses_nan_infinity_and_nul_where_a_result_is_read(text, fragment):
    with pytest.raises(BadValue) as caught:
        from_json(JobResult, text)
    assert fragment in str(caught.value), str(caught.value)


class BusyThenDone(OneResult):
    """A device still running `busy_with` for its first `busy` runs, then a job that succeeds."""

    def __init__(self, busy_with: str, busy: int):
        super().__init__(_ok())
        self.busy_with, self.busy = busy_with, busy

    def run(self, spec, out_dir, progress=None):
        from orchestrator.transports import DeviceBusy

        if self.runs < self.busy:
            self.runs += 1
            raise DeviceBusy("p-bad", f"device busy with job {self.busy_with!r} since "
                                      "2026-11-27T16:30:25 (agent pid 11658); retry when it has finished")
        return super().run(spec, out_dir, progress)


def test_an_earlier_attempt_still_running_is_waited_for_not_charged(farm, monkeypatch):
    """A worker cut off from the store (PostgreSQL restarting) left its attempt running on the
    device; the reconciler sent the job again, and each new attempt found the device busy with
    that attempt: three such finds ended the job infra_failed (the fault suite's db-restart, on
    a slow machine). Finding its own earlier attempt is now waited out like a lost worker: not
    one of the job's 3 attempts. Busy with another job still counts."""
    job_id, _ = _job(farm)
    device = BusyThenDone(f"job{job_id}-a1", busy=4)
    monkeypatch.setattr(worker, "make_transport", device)
    outcomes = [worker.run_attempt(farm.app, job_id, worker="test") for _ in range(5)]
    assert outcomes == ["requeued"] * 4 + ["succeeded"]
    with farm.Session() as s:
        job = s.get(Job, job_id)
        assert (job.state, job.attempts, job.worker_losses) == (JobState.succeeded, 5, 4)
    other_id, _ = _job(farm)
    monkeypatch.setattr(worker, "make_transport", BusyThenDone("job999-a1", busy=5))
    outcomes = [worker.run_attempt(farm.app, other_id, worker="test") for _ in range(3)]
    assert outcomes == ["requeued", "requeued", "infra_failed"]  # 3 attempts, as before
