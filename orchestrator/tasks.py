"""The farm's Celery tasks: running a job on a device, deploying a build to a device, and
requeueing jobs whose worker died. Every task takes ids, re-reads the database, and is safe to
run twice (delivery is at-least-once): a job is started only by the one execution whose
queued -> running transition wins, a device does one thing at a time through its lease in
the database, and a result is recorded once per attempt. Transactions stay short and are
never held across a device call (orchestrator/db/session.py says why). Only infrastructure
failures (TransportError, a dead worker) are retried, up to MAX_ATTEMPTS; a failed JobResult
is a result. No task waits on another task's result: follow-up work is sent, not awaited."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid
from functools import cache
from pathlib import Path

from celery import Celery, group, shared_task
from celery.result import GroupResult
from sqlalchemy.orm import Session, sessionmaker

from agent.protocol import JobSpec, from_dict
from orchestrator.celery_app import host_queue
from orchestrator.db import make_engine, make_session_factory, store
from orchestrator.db.models import Build, DeploymentStatus, Device, JobState, TransportKind
from orchestrator.settings import Settings
from orchestrator.transports import Transport, TransportError

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # runs of one job, infrastructure failures included
HEARTBEAT_S = 5.0  # how often a running job says it is alive and renews its device lease
LEASE_S = 60.0  # a device lease outlives a dead worker by at most this
STALE_AFTER_S = 120.0  # a running job silent this long has lost its worker
LEASE_RETRY_S = (2.0, 60.0)  # first and longest wait for a busy device (doubling in between)
LEASE_MAX_RETRIES = 500
REQUEUE_DELAY_S = 2.0


# ---- plumbing -----------------------------------------------------------------------------


@cache
def _sessions(database_url: str) -> sessionmaker[Session]:
    # One engine per worker process (created lazily, so after the prefork fork).
    return make_session_factory(make_engine(database_url))


def _settings(app: Celery) -> Settings:
    settings = getattr(app, "farm_settings", None)
    if settings is None:
        raise RuntimeError("this Celery app was not made by orchestrator.celery_app.make_celery")
    return settings


def _session(app: Celery) -> Session:
    return _sessions(_settings(app).database_url)()


def make_transport(device: Device, settings: Settings) -> Transport:
    """The transport for a device row: `address` is the agent root (local; default
    <data_dir>/devices/<serial>), host:port or usb:SERIAL (adb), or the agent's URL (http, with
    its token in <config_dir>/tokens/<serial>)."""
    kind = TransportKind(device.transport)
    if kind == TransportKind.local:
        from orchestrator.transports.local import LocalTransport

        root = Path(device.address) if device.address else settings.data_dir / "devices" / device.serial
        return LocalTransport(root, name=device.serial)
    if kind == TransportKind.adb:
        from orchestrator.transports.adb import AdbTransport

        if device.address.startswith("usb:") or not device.address:
            return AdbTransport(usb_serial=device.address.removeprefix("usb:") or None, name=device.serial)
        host, _, port = device.address.rpartition(":")
        return AdbTransport(host or device.address, int(port) if host else 5555, name=device.serial)
    from orchestrator.transports.http import HttpTransport

    return HttpTransport.from_token_file(device.address, settings.config_dir / "tokens" / device.serial,
                                         name=device.serial)


def _lease_holder(job_id: int | None = None, deploy_id: str | None = None) -> str:
    # Unique per execution: a redelivered copy of the same task must not share (or release)
    # the lease of the copy that is running.
    return f"job{job_id}:{uuid.uuid4().hex}" if job_id is not None else f"deploy{deploy_id}:{uuid.uuid4().hex}"


def _lease_countdown(retries: int) -> float:
    first, longest = LEASE_RETRY_S
    return min(longest, first * 2 ** retries)


class _Heartbeat:
    """A thread that, while a job runs, stamps the job's heartbeat and renews the device lease,
    each time in its own short transaction."""

    def __init__(self, app: Celery, job_id: int, device_id: int, holder: str):
        self.app, self.job_id, self.device_id, self.holder = app, job_id, device_id, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-job{job_id}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with _session(self.app) as session, session.begin():
                    store.heartbeat_job(session, self.job_id)
                    store.acquire_device_lease(session, self.device_id, self.holder, LEASE_S)
            except Exception:  # noqa: BLE001  (a missed beat is not fatal; the next one may land)
                log.exception("heartbeat for job %s failed", self.job_id)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 5)


def _release(app: Celery, device_id: int, holder: str) -> None:
    with _session(app) as session, session.begin():
        store.release_device_lease(session, device_id, holder)


def _requeue_or_give_up(session: Session, job_id: int) -> bool:
    """An infra-failed job goes back to queued unless it has used its attempts (flushes only)."""
    job = store.get_job(session, job_id)
    if job.attempts >= MAX_ATTEMPTS:
        return False
    store.transition_job(session, job_id, JobState.queued)
    return True


# ---- dispatch -----------------------------------------------------------------------------


def dispatch_jobs(app: Celery, job_ids: list[int], countdown: float | None = None) -> GroupResult:
    """Send run_job for each job to the queue of the host its device is plugged into (a device
    with no host goes to this host's queue), as one group. Callers never wait on it inside a
    task; the CLI may."""
    settings = _settings(app)
    with _session(app) as session, session.begin():
        queues = {}
        for job_id in job_ids:
            job = store.get_job(session, job_id)
            host = job.device.host.name if job.device.host is not None else settings.host_name
            queues[job_id] = host_queue(host)
    run = app.signature("orchestrator.tasks.run_job")
    options = {} if countdown is None else {"countdown": countdown}
    return group(run.clone(args=(job_id,)).set(queue=queues[job_id], **options) for job_id in job_ids).apply_async()


# ---- tasks --------------------------------------------------------------------------------


@shared_task(bind=True, name="orchestrator.tasks.run_job", max_retries=LEASE_MAX_RETRIES)
def run_job(self, job_id: int) -> str:
    """Run job `job_id` on its device once; returns the job's state as this execution left it
    (or "skipped" when another execution has it or it is finished)."""
    app, settings = self.app, _settings(self.app)
    holder = _lease_holder(job_id)

    # 1. Take the device and the job in one short transaction: both or neither.
    try:
        with _session(app) as session, session.begin():
            job = store.get_job(session, job_id)
            if job.state != JobState.queued:
                return "skipped"
            busy = not store.acquire_device_lease(session, job.device_id, holder, LEASE_S)
            if not busy:
                # Raises InvalidTransition when another execution won; the rollback then
                # gives the lease back too.
                job = store.transition_job(session, job_id, JobState.running, worker=self.request.hostname)
                device = job.device
                device_id, attempt = device.id, job.attempts
                fields = dict(job.spec or {}) | {"job_id": f"job{job_id}-a{attempt}", "kind": str(job.kind)}
                if job.build is not None and not fields.get("build"):
                    fields["build"] = job.build.name
    except store.InvalidTransition:
        return "skipped"
    if busy:
        raise self.retry(countdown=_lease_countdown(self.request.retries))

    # 2. Talk to the device with no transaction open; heartbeats keep job and lease alive.
    state, error, result = None, None, None
    try:
        spec = from_dict(JobSpec, fields)
        transport = make_transport(device, settings)
        out_dir = settings.data_dir / "results" / f"job{job_id}" / f"attempt{attempt}"
        with _Heartbeat(app, job_id, device_id, holder), transport:
            result = transport.run(spec, out_dir)
    except TransportError as exc:
        state, error = JobState.infra_failed, str(exc)
        device_state = store.TRANSPORT_STATES.get(exc.state)
    except Exception as exc:  # a bad spec or a bug here: recorded, not retried
        state, error, device_state = JobState.failed, f"{type(exc).__name__}: {exc}", None
        log.exception("job %s failed in the worker", job_id)

    # 3. Record the outcome in one short transaction; then give the device back.
    requeued = False
    try:
        with _session(app) as session, session.begin():
            if result is not None:
                store.record_result(session, job_id, result, attempt)
                state = JobState.succeeded if result.status == "succeeded" else JobState.failed
                store.transition_job(session, job_id, state, error=result.error, log_tail=result.log_tail)
            else:
                store.transition_job(session, job_id, state, error=error)
                if device_state is not None and device_state != "busy":
                    store.set_device_state(session, device_id, device_state, error or "")
                if state == JobState.infra_failed:
                    requeued = _requeue_or_give_up(session, job_id)
    except store.InvalidTransition:
        # requeue_stale_jobs took the job from us (no heartbeat landed): its next run counts.
        log.warning("job %s was taken away while running; this attempt's outcome is dropped", job_id)
        return "dropped"
    finally:
        _release(app, device_id, holder)
    if requeued:
        dispatch_jobs(app, [job_id], countdown=REQUEUE_DELAY_S)
        return "requeued"
    return str(state)


@shared_task(bind=True, name="orchestrator.tasks.deploy", max_retries=LEASE_MAX_RETRIES)
def deploy(self, build_id: int, device_id: int) -> int | None:
    """Send build `build_id`'s bundle (<data_dir>/builds/<name>) to device `device_id` and
    record the deployment; the transport sends only missing files, so running it again is
    cheap. Returns the deployment id."""
    app, settings = self.app, _settings(self.app)
    holder = _lease_holder(deploy_id=f"{build_id}-{device_id}")
    with _session(app) as session, session.begin():
        build = session.get(Build, build_id)
        device = store.get_device(session, device_id)
        if build is None:
            raise store.StoreError(f"no build {build_id}")
        if not store.acquire_device_lease(session, device_id, holder, LEASE_S):
            busy = True
        else:
            busy = False
            deployment_id = store.record_deployment(session, build_id, device_id, DeploymentStatus.running).id
    if busy:
        raise self.retry(countdown=_lease_countdown(self.request.retries))
    try:
        status, report, error = DeploymentStatus.failed, None, None
        try:
            with make_transport(device, settings) as transport:
                report = transport.send_bundle(settings.data_dir / "builds" / build.name)
            status = DeploymentStatus.succeeded
        except (TransportError, OSError) as exc:
            error = str(exc)
        with _session(app) as session, session.begin():
            counts = ({"bytes_sent": report.bytes_sent, "files_sent": report.files_sent,
                       "files_skipped": report.files_skipped, "duration_s": report.seconds} if report else {})
            store.record_deployment(session, build_id, device_id, status, error=error,
                                    deployment_id=deployment_id, **counts)
    finally:
        _release(app, device_id, holder)
    return deployment_id


@shared_task(bind=True, name="orchestrator.tasks.requeue_stale_jobs")
def requeue_stale_jobs(self, older_than_s: float = STALE_AFTER_S) -> list[int]:
    """Jobs left running by a dead worker (no heartbeat for `older_than_s`) become infra
    failures, their device lease is freed, and those with attempts left are queued and sent
    again. Returns the ids sent again."""
    app = self.app
    requeued = []
    with _session(app) as session, session.begin():
        for job in store.find_stale_running_jobs(session, dt.timedelta(seconds=older_than_s)):
            try:
                store.transition_job(session, job.id, JobState.infra_failed,
                                     error=f"worker {job.worker or '?'} lost: no heartbeat for {older_than_s:g} s")
            except store.InvalidTransition:
                continue  # it finished or moved meanwhile
            device = store.get_device(session, job.device_id)
            if device.lease_holder and device.lease_holder.startswith(f"job{job.id}:"):
                store.release_device_lease(session, device.id, device.lease_holder)
            if _requeue_or_give_up(session, job.id):
                requeued.append(job.id)
    if requeued:
        dispatch_jobs(app, requeued)
    return requeued
