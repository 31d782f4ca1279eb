"""Faults with real worker processes (started as `farm worker`) on the embedded broker and a
SQLite store: a worker SIGKILLed in the middle of a job leaves the job to the reconciler,
which reruns it on another worker (one result stored, never two); a suite over two devices
where one cannot be reached fails that device's deployment with its reason and its jobs as
infrastructure failures, while the other device deploys and runs, and the batch is analysed
once everything has settled; a schedule that beat missed fires once, not once per miss."""

from __future__ import annotations

import datetime as dt
import signal
import time

import pytest
from sqlalchemy import select
from worker_farm import Workers, kill_group, logs, wait

from agent.bundle import (
    current_build,
    generate_keypair,
    install_bundle,
    load_private_key,
    provision_public_key,
)
from agent.packing import build_bundle
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import DEFAULT_QUEUE, make_celery
from orchestrator.jobs.jobservice import launch_suite, send_jobs
from orchestrator.services.stack import settings_env
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import (
    Batch,
    Deployment,
    DeploymentStatus,
    Device,
    DeviceState,
    Job,
    JobState,
    Run,
)

pytestmark = pytest.mark.gpu
HOST = "faulthost"
SLOW_SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 20, "scheduler": "euler", "time_limit_s": 120.0}
QUICK_SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "scheduler": "euler", "time_limit_s": 120.0}


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("fault-farm")
    settings = Settings(data_dir=tmp / "data", config_dir=tmp / "config", host_name=HOST, stale_after_s=2.0)
    upgrade(settings.database_url)
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    manifest = build_bundle({"models/tiny": tiny_model_dir}, settings.data_dir / "builds" / "b1", "b1", "0.1.0", key)
    provision_public_key(tmp / "phone", tmp / "farm.pub")
    install_bundle(settings.data_dir / "builds" / "b1", tmp / "phone")  # deployed (the deploy task is tested elsewhere)
    engine = make_engine(settings.database_url)
    Session = make_session_factory(engine)  # noqa: N806
    with Session() as session, session.begin():
        device_id = store.upsert_device(session, "local-1", "local", str(tmp / "phone"), host=HOST).id
        build_id = store.create_build(session, manifest).id
    workers = Workers(tmp, settings)
    app = make_celery(settings)
    try:
        yield {"app": app, "Session": Session, "device_id": device_id, "build_id": build_id, "tmp": tmp,
               "start_worker": workers.start, "settings": settings, "tiny_model_dir": tiny_model_dir}
    finally:
        workers.stop()
        engine.dispose()


def test_worker_killed_mid_job_reruns_it_once(farm):
    first = farm["start_worker"]("worker-a")
    with farm["Session"]() as session, session.begin():
        job_id = store.create_job(session, "generate", SLOW_SPEC, farm["device_id"], farm["build_id"]).id
    send_jobs(farm["app"], [job_id])
    wait(farm, lambda s: s.get(Job, job_id).state == JobState.running, "the job to start")
    time.sleep(1.0)  # in the middle of the generation
    kill_group(first, signal.SIGKILL)  # the worker, its pool and the agent it started
    first.wait()

    with farm["Session"]() as session:
        job = session.get(Job, job_id)
        assert job.state == JobState.running and job.attempts == 1  # nothing recorded it as done
        assert session.scalars(select(Run).where(Run.job_id == job_id)).all() == []

    farm["start_worker"]("worker-b")
    # The heartbeat stopped with the worker: once it is older than stale_after_s, beat's
    # reconciler (sent here directly) requeues the job, and the new worker runs it.
    time.sleep(3.0)
    report = farm["app"].signature("orchestrator.tasks.reconcile").apply_async(queue=DEFAULT_QUEUE).get(timeout=60)
    assert report["jobs_requeued"] == [job_id]
    job = wait(farm, lambda s: (j := s.get(Job, job_id)).state in store.SETTLED_STATES and j, "the rerun")
    assert job.state == JobState.succeeded, f"{job.error}\n{logs(farm)}"
    assert job.attempts == 2
    with farm["Session"]() as session:
        runs = session.scalars(select(Run).where(Run.job_id == job_id)).all()
        assert [r.attempt for r in runs] == [2]
        assert session.get(Device, farm["device_id"]).lease_holder is None


def test_unreachable_device_fails_its_deployment_not_the_others(farm):
    farm["start_worker"]("worker-c")
    with farm["Session"]() as session, session.begin():
        # Nothing listens on port 9 of localhost: connection refused, as for a phone that is gone.
        store.upsert_device(session, "gone-phone", "adb", "127.0.0.1:9", host=HOST)
    jobs = [{"kind": "generate", "spec": QUICK_SPEC}, {"kind": "generate", "spec": QUICK_SPEC | {"seed": 1}}]
    batch_id = launch_suite(farm["app"], "fault suite", jobs, build="b1", devices=["local-1", "gone-phone"])

    batch = wait(farm, lambda s: (b := s.get(Batch, batch_id)).summary is not None and b, "the batch's analysis")
    with farm["Session"]() as session:
        deployments = {session.get(Device, d.device_id).serial: d for d in
                       session.scalars(select(Deployment).where(Deployment.batch_id == batch_id))}
        assert deployments["local-1"].status == DeploymentStatus.succeeded
        assert deployments["gone-phone"].status == DeploymentStatus.failed
        assert "gone-phone" in deployments["gone-phone"].error
        states = {(session.get(Device, j.device_id).serial, j.id): j for j in
                  session.scalars(select(Job).where(Job.batch_id == batch_id))}
        for (serial, _), job in states.items():
            if serial == "local-1":
                assert job.state == JobState.succeeded, job.error
            else:
                assert job.state == JobState.infra_failed and job.attempts == 0
                assert "deployment of b1 to gone-phone failed" in job.error
        assert session.scalar(select(Device).where(Device.serial == "gone-phone")).state == DeviceState.offline
    assert batch.finished_at is not None
    assert batch.summary["states"] == {"succeeded": 2, "infra_failed": 2}
    # The report is written once the analysis has committed the summary: a moment later.
    report = farm["settings"].data_dir / "reports" / f"batch-{batch_id}.json"
    wait(farm, lambda s: report.is_file(), "the batch's report")
    assert '"infra_failed"' in report.read_text()


def test_due_schedule_fires_once_through_beats_task(farm):
    farm["start_worker"]("worker-d")
    suite = {"build": None, "devices": ["local-1"], "jobs": [{"kind": "generate", "spec": QUICK_SPEC}]}
    with farm["Session"]() as session, session.begin():
        # Daily at 03:00 UTC, last fired five days ago (beat was down): four missed firings. A
        # daily time keeps the two ticks below from straddling a new firing (an every-minute
        # cron made the second tick legitimately fire again when a minute turned in between).
        schedule = store.create_schedule(session, "nightly", "0 3 * * *", "UTC", suite)
        schedule.last_run_at = store.utcnow() - dt.timedelta(days=5)
        schedule_id = schedule.id
    tick = farm["app"].signature("orchestrator.tasks.check_schedules")
    first = tick.clone().apply_async(queue=DEFAULT_QUEUE).get(timeout=60)
    second = tick.clone().apply_async(queue=DEFAULT_QUEUE).get(timeout=60)
    assert len(first) == 1 and second == []  # the missed firings fire once, and only once
    batch = wait(farm, lambda s: (b := s.get(Batch, first[0])).summary is not None and b, "the schedule's batch")
    assert batch.schedule_id == schedule_id and batch.build_id == farm["build_id"]
    assert batch.summary["states"] == {"succeeded": 1}, batch.summary
    with farm["Session"]() as session:
        schedule = store.get_schedule(session, schedule_id)
        # It fired for the latest missed 03:00, not for the oldest.
        assert schedule.last_run_at == store.last_fire_time("0 3 * * *", "UTC", store.utcnow())
        (job,) = session.scalars(select(Job).where(Job.batch_id == batch.id)).all()
        assert job.schedule_id == schedule_id and job.idempotency_key.startswith(f"schedule{schedule_id}:")


def test_farm_deploy_reports_each_device(farm, monkeypatch):
    import json

    from typer.testing import CliRunner

    from orchestrator.cli import app

    farm["start_worker"]("worker-e")
    with farm["Session"]() as session, session.begin():
        store.upsert_device(session, "gone-phone", "adb", "127.0.0.1:9", host=HOST)
    for name, value in settings_env(farm["settings"]).items():
        if name.startswith("FARM_"):
            monkeypatch.setenv(name, value)
    runner = CliRunner()
    ok = runner.invoke(app, ["deploy", "b1", "--device", "local-1"])
    assert ok.exit_code == 0 and "succeeded" in ok.output, ok.output
    mixed = runner.invoke(app, ["deploy", "b1", "--device", "local-1", "--device", "gone-phone", "--json"])
    assert mixed.exit_code == 4, mixed.output  # a deployment failed: could not run
    rows = {r["device"]: r for r in json.loads(mixed.output)}
    assert rows["local-1"]["status"] == "succeeded" and rows["local-1"]["files_sent"] == 0  # already there
    assert rows["local-1"]["files_skipped"] > 0
    assert rows["gone-phone"]["status"] == "failed" and "gone-phone" in rows["gone-phone"]["error"]
    text = runner.invoke(app, ["deploy", "b1", "--device", "gone-phone"])
    assert text.exit_code == 4 and "error: gone-phone" in text.output and "Traceback" not in text.output
    bad = runner.invoke(app, ["deploy", "nope", "--all"])
    assert bad.exit_code == 3 and "no build 'nope'" in bad.output
    neither = runner.invoke(app, ["deploy", "b1"])
    assert neither.exit_code == 3 and "--all" in neither.output
    # A newer build, then b1 again: the older build goes in beside, the newer stays current
    # until --allow-downgrade.
    newer = build_bundle({"models/tiny": farm["tiny_model_dir"]}, farm["settings"].data_dir / "builds" / "b2",
                         "b2", "0.2.0", load_private_key(farm["tmp"] / "farm.key"))
    with farm["Session"]() as session, session.begin():
        store.create_build(session, newer)
    assert runner.invoke(app, ["deploy", "b2", "--device", "local-1"]).exit_code == 0
    beside = runner.invoke(app, ["deploy", "b1", "--device", "local-1"])
    assert beside.exit_code == 0, beside.output
    assert "installed beside the device's current build b2" in " ".join(beside.output.split())
    root = farm["tmp"] / "phone"
    assert current_build(root).build_id == "b2"
    assert runner.invoke(app, ["deploy", "b1", "--device", "local-1", "--allow-downgrade"]).exit_code == 0
    assert current_build(root).build_id == "b1"
