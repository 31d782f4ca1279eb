"""The reliability promise (docs/reliability.md), fault by fault, with real processes: the
embedded broker keeps a message a SIGKILLed consumer held and gives it to the next one; a job
whose busy-device retry a killed worker held still runs; work whose message was never sent (a
crash after the commit) or whose deployment's worker died is sent again by the reconciler; a
wait for a busy device ends with its reason instead of for ever; a replaced attempt cannot
settle the job; Redis redelivers after the longest job, not after six hours."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kombu import Connection
from sqlalchemy import select, update
from worker_farm import Workers, kill_group, logs, wait

from agent.bundle import generate_keypair, install_bundle, provision_public_key
from agent.jobs import read_lock
from agent.packing import build_bundle
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import (
    DEFAULT_QUEUE,
    _embedded_broker,
    make_celery,
    visibility_timeout_s,
)
from orchestrator.jobs.jobservice import cancel_job, check_time_limit, send_jobs
from orchestrator.jobs.reconciler import reconcile
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import (
    Deployment,
    DeploymentStatus,
    Device,
    Job,
    JobState,
    Run,
    utcnow,
)

# `alone`: scripts/test.sh runs this file with no other test beside it: its leases and reconciler deadlines are seconds long.
pytestmark = pytest.mark.alone

HOST = "relhost"
REPO = Path(__file__).resolve().parents[2]
QUICK_SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 1, "scheduler": "euler", "time_limit_s": 120.0,
              "height": 64, "width": 64}


# ---- the embedded broker ------------------------------------------------------------------

CONSUMER = textwrap.dedent("""
    import sys, time
    from kombu import Connection
    from orchestrator.jobs.celery_app import _embedded_broker
    from orchestrator.infra.settings import Settings
    url, options, _ = _embedded_broker(Settings(data_dir=sys.argv[1], config_dir=sys.argv[1]))
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue("work", no_ack=False)
        message = queue.get(timeout=30)
        print(message.payload, flush=True)
        time.sleep(600)  # holds it, unacknowledged, until killed
""")


@pytest.fixture
def broker(tmp_path):
    url, options, _ = _embedded_broker(Settings(data_dir=tmp_path, config_dir=tmp_path))
    with Connection(url, transport_options=options) as conn:
        yield conn, tmp_path


def test_a_message_held_by_a_killed_consumer_comes_back(broker):
    conn, root = broker
    conn.SimpleQueue("work", no_ack=False).put({"job": 1})
    consumer = subprocess.Popen([sys.executable, "-c", CONSUMER, str(root)], stdout=subprocess.PIPE, text=True,
                                cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)})
    try:
        assert consumer.stdout.readline().strip() == "{'job': 1}"
        queue = conn.SimpleQueue("work", no_ack=False)
        with pytest.raises(queue.Empty):
            queue.get(timeout=1.5)  # claimed by a live consumer: invisible to others
        consumer.send_signal(signal.SIGKILL)
        consumer.wait()
        message = queue.get(timeout=10)  # its owner is gone: put back and delivered again
        assert message.payload == {"job": 1}
        message.ack()
        assert list((root / "broker" / "processed").iterdir()) == []  # acked: gone for good
        with pytest.raises(queue.Empty):
            queue.get(timeout=1.5)
    finally:
        consumer.kill()
        consumer.wait()


def test_reject_with_requeue_and_closing_give_the_message_back(broker):
    conn, root = broker
    queue = conn.SimpleQueue("requeued", no_ack=False)
    queue.put({"n": 1})
    (name,) = os.listdir(root / "broker" / "queue")
    first = queue.get(timeout=5)
    assert os.listdir(root / "broker" / "queue") == [] and len(os.listdir(root / "broker" / "processed")) == 1
    first.requeue()
    assert os.listdir(root / "broker" / "queue") == [name]  # back under its own name: its place in line
    again = queue.get(timeout=5)
    assert again.payload == {"n": 1}
    conn.release()  # the channel closes with the message unacknowledged: it goes back
    assert os.listdir(root / "broker" / "queue") == [name]
    assert os.listdir(root / "broker" / "processed") == []


# ---- jobs with real workers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("reliability-farm")
    settings = Settings(data_dir=tmp / "data", config_dir=tmp / "config", host_name=HOST,
                        stale_after_s=3.0, message_grace_s=3.0, max_queue_wait_s=8.0)
    upgrade(settings.database_url)
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    manifest = build_bundle({"models/tiny": tiny_model_dir}, settings.data_dir / "builds" / "b1", "b1", "0.1.0", key)
    for phone in ("phone", "phone-2"):
        provision_public_key(tmp / phone, tmp / "farm.pub")
    install_bundle(settings.data_dir / "builds" / "b1", tmp / "phone")
    engine = make_engine(settings.database_url)
    Session = make_session_factory(engine)  # noqa: N806
    with Session() as session, session.begin():
        device_id = store.upsert_device(session, "local-1", "local", str(tmp / "phone"), host=HOST).id
        fresh_id = store.upsert_device(session, "local-2", "local", str(tmp / "phone-2"), host=HOST).id
        build_id = store.create_build(session, manifest).id
    workers = Workers(tmp, settings)
    try:
        yield {"app": make_celery(settings), "Session": Session, "device_id": device_id, "fresh_id": fresh_id,
               "build_id": build_id, "tmp": tmp, "start_worker": workers.start, "settings": settings}
    finally:
        workers.stop()
        engine.dispose()


def _settled(farm, job_id: int) -> Job:
    return wait(farm, lambda s: (j := s.get(Job, job_id)).state in store.SETTLED_STATES and j, f"job {job_id}")


def _runs(farm, job_id: int) -> list[Run]:
    with farm["Session"]() as session:
        return list(session.scalars(select(Run).where(Run.job_id == job_id)))


def _reconcile(farm) -> dict:
    return farm["app"].signature("orchestrator.tasks.reconcile").apply_async(queue=DEFAULT_QUEUE).get(timeout=60)


def test_a_job_waiting_for_a_device_whose_holder_died_still_runs_once(farm):
    # The job finds its device held and waits in the store with no message: nothing of it is
    # in any broker or worker. Its worker is SIGKILLed, and the holder dies without handing the
    # device over (its lease just runs out). The reconciler sees the device free and sends it.
    with farm["Session"]() as session, session.begin():
        # A lease long enough that a slow machine's worker still finds it held; it is made to
        # run out below, once the first worker is dead.
        assert store.acquire_device_lease(session, farm["device_id"], "holder-that-dies", 600)
        job_id = store.create_job(session, "generate", QUICK_SPEC, farm["device_id"], farm["build_id"]).id
    first = farm["start_worker"]("worker-wait")
    send_jobs(farm["app"], [job_id])
    deadline = time.monotonic() + 60
    while True:
        with farm["Session"]() as session:
            job = session.get(Job, job_id)
            if job.due_at is not None and job.due_at <= utcnow():  # it ran, found the device busy, waits
                break
        assert time.monotonic() < deadline, f"the job never found the device busy\n{logs(farm)}"
        time.sleep(0.1)
    kill_group(first, signal.SIGKILL)
    first.wait()
    assert job_id not in reconcile(farm["app"])["jobs_resent"]  # the lease has not run out: still held
    with farm["Session"]() as session, session.begin():  # the holder's lease runs out
        session.execute(update(Device).where(Device.id == farm["device_id"])
                        .values(lease_until=utcnow() - dt.timedelta(seconds=1)))
    farm["start_worker"]("worker-wait-2")
    deadline = time.monotonic() + 30
    while job_id not in reconcile(farm["app"])["jobs_resent"]:
        assert time.monotonic() < deadline, "the reconciler never sent the waiting job"
        time.sleep(0.5)
    job = _settled(farm, job_id)
    assert (job.state, job.attempts) == (JobState.succeeded, 1), f"{job.error}\n{logs(farm)}"
    assert [r.attempt for r in _runs(farm, job_id)] == [1]


def test_work_never_sent_after_its_commit_is_sent_by_the_reconciler(farm):
    # A crash between the commit and the send: the job is in the store, no message exists.
    farm["start_worker"]("worker-outbox")
    with farm["Session"]() as session, session.begin():
        job_id = store.create_job(session, "generate", QUICK_SPEC, farm["device_id"], farm["build_id"],
                                  due_at=utcnow() - dt.timedelta(seconds=1)).id
    assert job_id in _reconcile(farm)["jobs_resent"]
    job = _settled(farm, job_id)
    assert (job.state, job.attempts, len(_runs(farm, job_id))) == (JobState.succeeded, 1, 1), job.error


def test_deployment_of_a_dead_worker_is_resent_and_its_jobs_run(farm):
    # A deployment left running by a worker that died mid-push, with a job waiting for it.
    farm["start_worker"]("worker-deploy")
    long_ago = utcnow() - dt.timedelta(minutes=5)
    with farm["Session"]() as session, session.begin():
        deployment = store.create_deployment(session, farm["build_id"], farm["fresh_id"])
        assert store.start_deployment(session, deployment.id, 0) == 1
        session.execute(update(Deployment).where(Deployment.id == deployment.id).values(heartbeat_at=long_ago))
        job_id = store.create_job(session, "generate", QUICK_SPEC, farm["fresh_id"], farm["build_id"],
                                  deployment_id=deployment.id).id
        deployment_id = deployment.id
    assert _reconcile(farm)["deployments_resent"] == [deployment_id]
    job = _settled(farm, job_id)
    assert job.state == JobState.succeeded, f"{job.error}\n{logs(farm)}"
    with farm["Session"]() as session:
        deployment = session.get(Deployment, deployment_id)
        assert (deployment.status, deployment.attempts) == (DeploymentStatus.succeeded, 2)
        assert deployment.files_sent > 0


def test_a_wait_for_a_busy_device_ends_with_its_reason(farm):
    farm["start_worker"]("worker-expire")
    with farm["Session"]() as session, session.begin():
        assert store.acquire_device_lease(session, farm["device_id"], "operator", 600)
        job_id = store.create_job(session, "generate", QUICK_SPEC, farm["device_id"], farm["build_id"]).id
    try:
        send_jobs(farm["app"], [job_id])
        # The job waits in the store; beat's reconciler (run here by hand) ends it after
        # max_queue_wait_s (8 s in these settings).
        deadline = time.monotonic() + 60
        while job_id not in reconcile(farm["app"])["jobs_ended"]:
            assert time.monotonic() < deadline, f"the wait never ended\n{logs(farm)}"
            time.sleep(0.5)
        job = wait(farm, lambda s: (j := s.get(Job, job_id)).state != JobState.queued and j, "the wait to end", 5)
        assert job.state == JobState.infra_failed and job.attempts == 0
        assert "gave up after waiting" in job.error and "local-1" in job.error and "operator" in job.error
    finally:
        with farm["Session"]() as session, session.begin():
            store.release_device_lease(session, farm["device_id"], "operator")


# ---- the store and the configuration ------------------------------------------------------


def test_a_replaced_attempt_cannot_settle_the_job(Session):  # noqa: N803  (a session factory fixture)
    with Session() as s, s.begin():
        device = store.upsert_device(s, "p1", "local", "/tmp/p1")
        job_id = store.create_job(s, "generate", QUICK_SPEC, device.id).id
        store.transition_job(s, job_id, JobState.running, worker="a")
        # The reconciler decided worker a was dead: infra_failed, queued, started again by b.
        store.transition_job(s, job_id, JobState.infra_failed, attempt=1)
        store.transition_job(s, job_id, JobState.queued)
        store.transition_job(s, job_id, JobState.running, worker="b")
    with Session() as s, s.begin(), pytest.raises(store.InvalidTransition, match="attempt 2, not 1"):
        store.transition_job(s, job_id, JobState.succeeded, attempt=1)  # worker a comes back late
    with Session() as s, s.begin():
        assert store.transition_job(s, job_id, JobState.succeeded, attempt=2).state == JobState.succeeded
        assert s.get(Device, device.id) is not None


def test_redis_redelivers_after_the_longest_job_not_six_hours(tmp_path):
    settings = Settings(data_dir=tmp_path, config_dir=tmp_path, broker_url="redis://127.0.0.1:1/0",
                        max_job_time_s=1800.0)
    app = make_celery(settings)
    assert app.conf.broker_transport_options["visibility_timeout"] == visibility_timeout_s(settings) == 2700.0
    with pytest.raises(store.StoreError, match="max_job_time_s"):
        check_time_limit(settings, {"time_limit_s": 3600.0})
    check_time_limit(settings, {"time_limit_s": 1800.0})


# ---- what a job is charged for ------------------------------------------------------------


def test_a_lost_worker_has_its_own_budget_with_a_doubling_delay(tmp_path):
    """A worker that dies is the host's fault, seldom the job's: the fault suite's kills, once
    recovery took 8 s, hit the same jobs three times running and ended them as infra_failed
    after MAX_ATTEMPTS. Worker losses now have their own budget, each requeue waiting twice as
    long as the last; the device's own failures still end a job after MAX_ATTEMPTS."""
    from agent.protocol import Manifest, ManifestFile
    from orchestrator.jobs import dispatch, worker

    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name=HOST,
                        stale_after_s=3.0, message_grace_s=3.0)
    upgrade(settings.database_url)
    app, engine = make_celery(settings), make_engine(settings.database_url)
    Session = make_session_factory(engine)  # noqa: N806
    manifest = Manifest(build="b-budget", version="0.1.0", created=1_700_000_000.0, source_revision="abc",
                        files=[ManifestFile("engine/a.py", "a" * 64, 10)])
    with Session() as session, session.begin():
        build_id = store.create_build(session, manifest).id
        # No worker consumes this farm's queues, and nothing listens on port 9: every send
        # stays in the broker's folder, and a run in this process fails to reach the device.
        device_id = store.upsert_device(session, "budget-1", "adb", "127.0.0.1:9", host=HOST).id
        lost_id = store.create_job(session, "generate", QUICK_SPEC, device_id, build_id).id
        mixed_id = store.create_job(session, "generate", QUICK_SPEC, device_id, build_id).id

    def lose_worker(job_id: int, n: int) -> tuple[dict, Job]:
        with Session() as session, session.begin():
            store.transition_job(session, job_id, JobState.running, worker=f"w{n}@{HOST}")
            session.execute(update(Job).where(Job.id == job_id).values(
                heartbeat_at=utcnow() - dt.timedelta(minutes=5)))
        report = reconcile(app)
        with Session() as session:
            return report, session.get(Job, job_id)

    try:
        delays = []
        for n in range(1, dispatch.MAX_WORKER_LOSSES + 1):
            before = utcnow()
            report, job = lose_worker(lost_id, n)
            assert job.worker_losses == n and job.attempts == n
            if n < dispatch.MAX_WORKER_LOSSES:
                assert report["jobs_requeued"] == [lost_id] and job.state == JobState.queued, job.error
                delays.append(round((job.due_at - before).total_seconds() - settings.message_grace_s))
            else:
                assert report["jobs_ended"] == [lost_id] and job.state == JobState.infra_failed
                assert f"worker lost {n} of at most {n} times" in job.error
        assert delays == [2, 4, 8, 16, 32, 60, 60]
        assert dispatch.MAX_WORKER_LOSSES > dispatch.MAX_ATTEMPTS  # more than the device's own budget

        # One lost worker, then the device fails on every run: the device's failures end the job
        # after MAX_ATTEMPTS of them, the lost worker not counted among them.
        report, job = lose_worker(mixed_id, 1)
        assert report["jobs_requeued"] == [mixed_id]
        outcomes = [worker.run_attempt(app, mixed_id, worker="test") for _ in range(dispatch.MAX_ATTEMPTS)]
        with Session() as session:
            job = session.get(Job, mixed_id)
        assert outcomes == ["requeued"] * (dispatch.MAX_ATTEMPTS - 1) + ["infra_failed"], (outcomes, job.error)
        assert (job.state, job.attempts, job.worker_losses) == (JobState.infra_failed, dispatch.MAX_ATTEMPTS + 1, 1)
    finally:
        engine.dispose()


# ---- stopping a job on its device ----------------------------------------------------------------

LONG_SPEC = QUICK_SPEC | {"steps": 1000, "time_limit_s": 900.0}  # minutes of work: it must be stopped


def _start_long_job(farm, worker: str) -> tuple[int, Path]:
    """A long job running on local-1, its job process started; returns its id and the device root."""
    farm["start_worker"](worker)
    with farm["Session"]() as session, session.begin():
        job_id = store.create_job(session, "generate", LONG_SPEC, farm["device_id"], farm["build_id"]).id
    send_jobs(farm["app"], [job_id])
    root = farm["tmp"] / "phone"
    wait(farm, lambda s: s.get(Job, job_id).state == JobState.running
         and (read_lock(root) or {}).get("child_pid"), "the long job's process to start", timeout_s=300)
    return job_id, root


def _device_freed_within(farm, root: Path, seconds: float) -> float:
    started = time.monotonic()
    while read_lock(root) is not None:
        assert time.monotonic() - started < seconds, f"the job still runs on the device\n{logs(farm)}"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_cancelled_running_job_is_stopped_on_its_device(farm):
    job_id, root = _start_long_job(farm, "worker-cancel")
    with farm["Session"]() as session, session.begin():
        cancel_job(session, job_id)
    took = _device_freed_within(farm, root, 60)  # its time limit is 900 s: before, it ran on
    print(f"stopped {took:.1f} s after the cancel")
    agent_log = (root / "jobs" / f"job{job_id}-a1" / "job.log").read_text()
    assert "the job was stopped: the job is no longer this worker's (cancelled" in agent_log
    wait(farm, lambda s: s.scalar(select(Device.lease_holder).where(Device.id == farm["device_id"])) is None,
         "the worker to give the device back")
    with farm["Session"]() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.error) == (JobState.cancelled, "cancelled by operator")
    assert _runs(farm, job_id) == []


def test_a_worker_that_loses_its_device_lease_stops_its_job_before_another_run_starts(farm):
    # What a worker cut off from the store sees: its renewals stop landing, the lease runs out
    # and the reconciler may give the device to another run. Here another holder takes the lease.
    job_id, root = _start_long_job(farm, "worker-lease")
    with farm["Session"]() as session, session.begin():
        session.execute(update(Device).where(Device.id == farm["device_id"])
                        .values(lease_holder="another-run", lease_until=utcnow() + dt.timedelta(minutes=10)))
    took = _device_freed_within(farm, root, 60)
    print(f"stopped {took:.1f} s after the lease was lost")
    assert "the job was stopped: its worker lost the device's lease" in \
        (root / "jobs" / f"job{job_id}-a1" / "job.log").read_text()
    # Its outcome is a lost worker's: queued again, the attempt not charged, nothing recorded.
    job = wait(farm, lambda s: (j := s.get(Job, job_id)).state == JobState.queued and j, "the job to be requeued")
    assert "stopped on the device: its worker lost the device's lease" in job.error
    assert _runs(farm, job_id) == []
    with farm["Session"]() as session, session.begin():  # leave the device as the other tests expect it
        cancel_job(session, job_id)
        session.execute(update(Device).where(Device.id == farm["device_id"])
                        .values(lease_holder=None, lease_until=None))
