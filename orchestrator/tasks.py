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
import time
import uuid
from functools import cache
from pathlib import Path

from celery import Celery, group, shared_task
from celery.result import GroupResult
from sqlalchemy.orm import Session, sessionmaker

from agent.protocol import JobSpec, from_dict
from orchestrator.celery_app import DEFAULT_QUEUE, host_queue
from orchestrator.db import make_engine, make_session_factory, store
from orchestrator.db.models import (
    Build,
    DeploymentStatus,
    Device,
    JobState,
    TransportKind,
)
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
PROGRESS_EVERY_S = 0.5  # how often a deploy records its bytes sent


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


class _DeployProgress:
    """A transport progress listener that records a deployment's bytes sent so far (at most
    every PROGRESS_EVERY_S, each in its own short transaction): what `farm deploy` follows."""

    def __init__(self, app: Celery, deployment_id: int):
        self.app, self.deployment_id = app, deployment_id
        self.total: int | None = None
        self._last = 0.0

    def __call__(self, event: dict) -> None:
        if event.get("event") == "bundle_plan":
            self.total = int(event.get("bytes") or 0)
            self._write(0, force=True)
        elif event.get("event") == "push":
            self.total = int(event.get("bytes_total") or self.total or 0) or None
            self._write(int(event.get("bytes_sent") or 0))

    def _write(self, sent: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < PROGRESS_EVERY_S:
            return
        self._last = now
        with _session(self.app) as session, session.begin():
            store.record_deployment_progress(session, self.deployment_id, sent, self.total)


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


def settle_batch(app: Celery, batch_id: int | None) -> None:
    """When the job that just settled (ran, could not deploy, was given up or cancelled) was
    its batch's last open one, send the batch's analysis (exactly once: finish_batch_if_done is
    a conditional UPDATE)."""
    if batch_id is None:
        return
    with _session(app) as session, session.begin():
        done = store.finish_batch_if_done(session, batch_id)
    if done:
        app.signature("orchestrator.tasks.analyze_batch", args=(batch_id,)).apply_async(queue=DEFAULT_QUEUE)


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
                device_id, attempt, batch_id = device.id, job.attempts, job.batch_id
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
                store.record_result(session, job_id, result, attempt, artifacts_dir=out_dir)
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
    settle_batch(app, batch_id)
    return str(state)


@shared_task(bind=True, name="orchestrator.tasks.deploy", max_retries=LEASE_MAX_RETRIES)
def deploy(self, build_id: int, device_id: int, then_jobs: list[int] | None = None,
           batch_id: int | None = None) -> int | None:
    """Send build `build_id`'s bundle (<data_dir>/builds/<name>) to device `device_id` and
    record the deployment; the transport sends only missing files, so running it again is
    cheap. Then the jobs `then_jobs` (queued, for this device) are sent when it succeeded, or
    marked infra_failed with the deployment's error when it failed. Returns the deployment id."""
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
            deployment_id = store.record_deployment(session, build_id, device_id, DeploymentStatus.running,
                                                    batch_id=batch_id).id
    if busy:
        raise self.retry(countdown=_lease_countdown(self.request.retries))
    try:
        status, report, error = DeploymentStatus.failed, None, None
        try:
            with make_transport(device, settings) as transport:
                report = transport.send_bundle(settings.data_dir / "builds" / build.name,
                                               progress=_DeployProgress(app, deployment_id))
            status = DeploymentStatus.succeeded
        except TransportError as exc:
            error = str(exc)
            device_state = store.TRANSPORT_STATES.get(exc.state)
        except OSError as exc:
            error, device_state = f"{type(exc).__name__}: {exc}", None
        with _session(app) as session, session.begin():
            counts = ({"bytes_sent": report.bytes_sent, "files_sent": report.files_sent,
                       "files_skipped": report.files_skipped, "duration_s": report.seconds} if report else {})
            store.record_deployment(session, build_id, device_id, status, error=error,
                                    deployment_id=deployment_id, **counts)
            if status == DeploymentStatus.failed:
                if device_state is not None and device_state != "busy":
                    store.set_device_state(session, device_id, device_state, error or "")
                for job_id in then_jobs or ():
                    try:
                        store.transition_job(session, job_id, JobState.infra_failed,
                                             error=f"deployment of {build.name} to {device.serial} failed: {error}")
                    except store.InvalidTransition:
                        pass  # cancelled or taken meanwhile
    finally:
        _release(app, device_id, holder)
    if then_jobs:
        if status == DeploymentStatus.succeeded:
            dispatch_jobs(app, list(then_jobs))
        else:
            settle_batch(app, batch_id)
    return deployment_id


@shared_task(bind=True, name="orchestrator.tasks.requeue_stale_jobs")
def requeue_stale_jobs(self, older_than_s: float = STALE_AFTER_S) -> list[int]:
    """Jobs left running by a dead worker (no heartbeat for `older_than_s`) become infra
    failures, their device lease is freed, and those with attempts left are queued and sent
    again. Returns the ids sent again."""
    app = self.app
    requeued, given_up_batches = [], set()
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
            elif job.batch_id is not None:
                given_up_batches.add(job.batch_id)
    if requeued:
        dispatch_jobs(app, requeued)
    for batch_id in sorted(given_up_batches):
        settle_batch(app, batch_id)
    return requeued


@shared_task(name="orchestrator.tasks.ping")
def ping(payload: float | None = None) -> float | None:
    """Echo `payload`: a liveness probe of the broker and workers (and what the task throughput
    benchmark sends)."""
    return payload


# ---- suites: deploy, then jobs, then analysis ---------------------------------------------


def launch_suite(
    app: Celery,
    name: str,
    jobs: list[dict],
    *,
    build: int | str | None = None,
    devices: list[str] | str = "all",
    schedule_id: int | None = None,
    idempotency_key: str | None = None,
    max_extra_rounds: int | None = None,
) -> int:
    """Start a batch: for each device (serials, or "all" devices not quarantined), deploy the
    build (newest when None) and then run every job of `jobs` ({"kind": ..., "spec": {...}},
    the spec's model defaulting to the build's) on it; each device's chain runs on its host's
    queue, all devices in parallel; the last job to settle sends the batch's analysis. With an
    `idempotency_key` (a schedule's firing), launching again changes nothing and resends only
    what has not run. An inconclusive analysis may launch `max_extra_rounds` follow-up batches
    with more repetitions (default 3). A job entry may name its own "build" (id or name): the
    follow-up batches rerun the baseline build that way, next to the candidate. Returns the batch id."""
    settings = _settings(app)
    sends = []
    with _session(app) as session, session.begin():
        build_row = store.get_build(session, build)
        if devices == "all":
            targets = store.in_service_devices(session)
        else:
            targets = [store.get_device(session, serial) for serial in devices]
        if not targets:
            raise store.StoreError("no devices to run on; `farm devices add` registers one")
        if not jobs:
            raise store.StoreError("a suite needs at least one job")
        batch = store.create_batch(session, name, build_id=build_row.id, schedule_id=schedule_id,
                                   idempotency_key=idempotency_key,
                                   max_extra_rounds=3 if max_extra_rounds is None else max_extra_rounds)
        entry_builds = [build_row if entry.get("build") is None else store.get_build(session, entry["build"])
                        for entry in jobs]
        models: dict[int, str] = {}
        for device in targets:
            by_build: dict[int, list[int]] = {}
            for index, (entry, job_build) in enumerate(zip(jobs, entry_builds, strict=True)):
                spec = dict(entry.get("spec") or {})
                if not spec.get("model"):
                    if job_build.id not in models:
                        models[job_build.id] = store.default_model(job_build)
                    spec["model"] = models[job_build.id]
                key = f"{idempotency_key}:{device.serial}:{index}" if idempotency_key else None
                job = store.create_job(session, entry["kind"], spec, device.id, job_build.id, key,
                                       schedule_id=schedule_id, batch_id=batch.id)
                by_build.setdefault(job_build.id, []).append(job.id)
            host = device.host.name if device.host is not None else settings.host_name
            for job_build_id, job_ids in by_build.items():
                sends.append((job_build_id, device.id, job_ids, host_queue(host)))
        batch_id = batch.id
    signature = app.signature("orchestrator.tasks.deploy")
    group(signature.clone(args=(build_id, device_id), kwargs={"then_jobs": job_ids, "batch_id": batch_id})
          .set(queue=queue) for build_id, device_id, job_ids, queue in sends).apply_async()
    return batch_id


def fire_schedule(app: Celery, schedule_id: int, fired_at: dt.datetime) -> int:
    """Launch schedule `schedule_id`'s suite for its firing at `fired_at` (idempotent per firing)."""
    with _session(app) as session:
        schedule = store.get_schedule(session, schedule_id)
        name, suite = schedule.name, dict(schedule.suite)
    stamp = fired_at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return launch_suite(app, f"{name} {stamp}", suite.get("jobs") or [], build=suite.get("build"),
                        devices=suite.get("devices") or "all", schedule_id=schedule_id,
                        idempotency_key=f"schedule{schedule_id}:{stamp}")


@shared_task(bind=True, name="orchestrator.tasks.check_schedules")
def check_schedules(self) -> list[int]:
    """Beat's tick: fire every enabled schedule that is due (each firing claimed in the
    database first, so two beats or a beat restarted mid-tick fire it once). Returns the
    batches launched."""
    app, batches = self.app, []
    now = store.utcnow()
    with _session(app) as session, session.begin():
        due = [(s.id, s.last_run_at, fire) for s, fire in store.due_schedules(session, now)]
    for schedule_id, previous, fire in due:
        with _session(app) as session, session.begin():
            claimed = store.claim_schedule_firing(session, schedule_id, previous, fire)
        if not claimed:
            continue
        try:
            batches.append(fire_schedule(app, schedule_id, fire))
        except store.StoreError as exc:  # no build yet, no devices: the next firing may work
            log.error("schedule %s could not fire: %s", schedule_id, exc)
    return batches


@shared_task(bind=True, name="orchestrator.tasks.analyze_batch")
def analyze_batch(self, batch_id: int) -> dict:
    """A finished batch's analysis: its per-device summary and the regression analysis
    (orchestrator/analysis.py: comparisons against each series' baseline, alerts, fidelity,
    data stoppages), stored on the batch and written to <data_dir>/reports/batch-<id>.json for
    whatever sends notifications. Inconclusive comparisons launch a follow-up batch with more
    repetitions on those devices (at most the batch's max_extra_rounds rounds)."""
    import json

    from agent.bundle import atomic_write
    from orchestrator import analysis
    from orchestrator.summary import batch_summary

    app, settings = self.app, _settings(self.app)
    with _session(app) as session, session.begin():
        batch = store.get_batch(session, batch_id)
        report = analysis.analyze_batch(session, batch_id)
        summary = batch_summary(session, batch_id) | {"analysis": report}
        rounds = extra_round(batch.idempotency_key)
        follow_up = report["more_repetitions"] if rounds < batch.max_extra_rounds else []
        name, build_id, root, max_rounds = batch.name, batch.build_id, _root_batch(batch), batch.max_extra_rounds
        batch.summary = summary
    report_path = settings.data_dir / "reports" / f"batch-{batch_id}.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(report_path, json.dumps(summary, indent=2, default=str).encode())
    for device, jobs in more_repetitions_jobs(follow_up).items():
        launch_suite(app, f"{name} (more repetitions, round {rounds + 1})", jobs, build=build_id,
                     devices=[device], idempotency_key=f"more:{root}:{rounds + 1}:{device}",
                     max_extra_rounds=max_rounds)
    return summary


def more_repetitions_jobs(entries: list[dict]) -> dict[str, list[dict]]:
    """Device serial -> the jobs of its more-repetitions round, from the analysis'
    "more_repetitions" entries: a new latency run of the candidate (the batch's build) and one
    of its baseline (the entry's "baseline_build"), each with the repetitions asked for.
    Run-to-run drift averages only over runs, and the baseline's single earlier run would
    otherwise bound what any number of candidate runs can show."""
    jobs_by_device: dict[str, list[dict]] = {}
    for entry in entries:
        spec = dict(entry["spec"]) | {"repetitions": entry["repetitions"],
                                      "unet_repetitions": entry["repetitions"], "warmup": 1}
        spec.pop("job_id", None)
        jobs_by_device.setdefault(entry["device"], []).extend(
            [{"kind": "latency", "spec": spec}, {"kind": "latency", "spec": spec, "build": entry["baseline_build"]}])
    return jobs_by_device


def extra_round(idempotency_key: str | None) -> int:
    """Which more-repetitions round a batch is (0: the original batch)."""
    if idempotency_key and idempotency_key.startswith("more:"):
        return int(idempotency_key.split(":")[2])
    return 0


def _root_batch(batch) -> int:
    key = batch.idempotency_key
    return int(key.split(":")[1]) if key and key.startswith("more:") else batch.id
