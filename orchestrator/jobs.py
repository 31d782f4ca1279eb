"""The job path, in one place: submitting jobs, launching suites (deploy, then jobs, then the
analysis), firing schedules, more-repetition rounds, running a job and deploying a build on a
device, and the reconciler. The CLI and the Celery tasks both call these functions; the tasks
(orchestrator/tasks.py) are thin wrappers that take ids.

The promise (docs/reliability.md): the store is the truth and the broker only carries hints.

- Every job or deployment that waits on a message has an owner and a deadline. A queued job
  is owned by the deployment it waits for, else by its message, which must start it by
  `due_at`. A job whose device is busy is owned by whoever holds the device: it waits in the
  store with no message (its deadline already past), and the holder, giving the device back,
  sends the job that was submitted first (_release); nothing polls a busy device. A running
  job or deployment is owned by its worker, which says it is alive every HEARTBEAT_S.
- Work is written first and sent after the commit. A send that never happened (a crash in
  between, a broker that was down) is no different from a lost message: the reconciler, which
  beat runs every `reconcile_every_s`, sends again whatever is past its deadline, with a new
  dispatch sequence number; a message carrying an older number is dropped when it arrives, so
  one job never has two live chains of retries.
- A job runs only after the one execution that wins queued -> running; its result is recorded
  in the same transaction as its final state, conditional on the attempt it ran as, so a job
  is recorded at most once whatever is redelivered or resent (delivery is at least once).
- Nothing waits for ever: a job that waited `max_queue_wait_s` for its device, whose device
  is quarantined, or whose deployment failed ends as infra_failed with the reason in `error`;
  infrastructure failures are retried up to MAX_ATTEMPTS, then end the same way. A job whose
  worker died is not charged for it: it is sent again, after a delay that doubles each time,
  up to MAX_WORKER_LOSSES times (a job that kills every worker it runs on still ends).

Transactions stay short and are never held across a device call (orchestrator/db/session.py
says why)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from agent.protocol import JobSpec, from_dict
from orchestrator import profiles
from orchestrator.celery_app import DEFAULT_QUEUE, host_queue
from orchestrator.db import make_engine, make_session_factory, store
from orchestrator.db.models import (
    Batch,
    Build,
    Deployment,
    DeploymentStatus,
    Device,
    DeviceState,
    Job,
    JobState,
    TransportKind,
    utcnow,
)
from orchestrator.settings import Settings
from orchestrator.transports import Transport, TransportError

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # executions of one job that its device failed (infrastructure failures included)
# Executions of one job (or deployment) lost because their worker died: that is the host's
# fault, seldom the job's, so it has a budget of its own, spent with a doubling delay
# (2, 4, 8, ... 60 s): a host killed every few seconds does not fail the jobs it was running.
MAX_WORKER_LOSSES = 8
WORKER_LOSS_DELAY_MAX_S = 60.0
HEARTBEAT_S = 5.0  # how often a running job or deployment says it is alive and renews its device lease
LEASE_S = 60.0  # a device lease outlives a dead worker by at most this
# A deployment's first and longest wait for a busy device (doubling in between). Short: with
# timed jobs on a shared GPU taking turns, a more-repetitions round's deployment (nothing to
# send, a second's work) otherwise idled up to a minute between jobs of 10-20 s.
LEASE_RETRY_S = (1.0, 8.0)
REQUEUE_DELAY_S = 2.0  # an infrastructure failure is tried again after this
PROGRESS_EVERY_S = 0.5  # how often a deploy records its bytes sent
ANALYSIS_GRACE_FACTOR = 5  # a finished batch's analysis is sent again after this many message graces

RUN_JOB = "orchestrator.tasks.run_job"
DEPLOY = "orchestrator.tasks.deploy"
ANALYZE_BATCH = "orchestrator.tasks.analyze_batch"


@dataclass(frozen=True)
class Wait:
    """The device is busy: the task is to be retried after `countdown` seconds (its deadline
    was already moved past that)."""

    countdown: float


# ---- plumbing -----------------------------------------------------------------------------


@cache
def _sessions(database_url: str) -> sessionmaker[Session]:
    # One engine per process (created lazily, so after the prefork fork).
    return make_session_factory(make_engine(database_url))


def settings_of(app: Celery) -> Settings:
    settings = getattr(app, "farm_settings", None)
    if settings is None:
        raise RuntimeError("this Celery app was not made by orchestrator.celery_app.make_celery")
    return settings


def session_for(app: Celery) -> Session:
    return _sessions(settings_of(app).database_url)()


def _grace(settings: Settings, extra_s: float = 0.0) -> dt.datetime:
    """The deadline of a message sent now that may start its work after `extra_s`."""
    return utcnow() + dt.timedelta(seconds=extra_s + settings.message_grace_s)


def make_transport(device: Device, settings: Settings) -> Transport:
    """The transport for a device row: `address` is the agent root (local; default
    <data_dir>/devices/<serial>), host:port or usb:SERIAL (adb), or the agent's URL (http, with
    its token in <config_dir>/tokens/<serial>); adb signs with <config_dir>/adbkey. A device of
    the browser runtime is reached over adb too, its engine run by its browser. ValueError
    (orchestrator.inputs.BadInput) names a stored address that cannot be used."""
    from orchestrator.inputs import (
        AdbTcpAddress,
        HttpAddress,
        LocalAddress,
        WebAddress,
        parse_device_address,
    )

    address = parse_device_address(TransportKind(device.transport).value, device.address or "")
    if isinstance(address, WebAddress):
        return browser_transport(device, None, settings)
    if isinstance(address, LocalAddress):
        from orchestrator.transports.local import LocalTransport

        return LocalTransport(address.root or settings.data_dir / "devices" / device.serial, name=device.serial)
    if isinstance(address, HttpAddress):
        from orchestrator.transports.http import HttpTransport

        return HttpTransport.from_token_file(address.url, settings.config_dir / "tokens" / device.serial,
                                             name=device.serial)
    from orchestrator.transports.adb import AdbTransport

    if isinstance(address, AdbTcpAddress):
        adb = AdbTransport(address.host, address.port, key_path=settings.adb_key, name=device.serial)
    else:
        adb = AdbTransport(usb_serial=address.serial, key_path=settings.adb_key, name=device.serial)
    if device.runtime == "browser":
        return browser_transport(device, adb, settings)
    return adb


def browser_transport(device: Device, adb, settings: Settings) -> Transport:
    """A device whose browser runs the engine: its host-side agent root
    <data_dir>/devices/<serial>, its page's token in <config_dir>/tokens/browser/<serial> (made
    on first use, 0600), the farm's public key the page is enrolled with. A phone over adb
    (`adb` given) goes through this host's `farm hub` when one runs, else a hub of the worker's
    own; a web device needs `farm hub`, whose HTTPS address it opens."""
    from orchestrator.browser_hub import read_or_make_token
    from orchestrator.cli.builds import PUBLIC_KEY, farm_key
    from orchestrator.transports.base import DeviceOffline
    from orchestrator.transports.browser import (
        AdbPageLink,
        BrowserTransport,
        WebPageLink,
        public_url,
        running_hub,
    )

    farm_key(settings.config_dir)
    token = read_or_make_token(settings.browser_tokens_dir / device.serial)
    hub = running_hub(settings)
    if adb is None and hub is None:
        raise DeviceOffline(device.serial, "no `farm hub` answers on this host: a web device reaches the farm "
                            "through it; start it (`farm up` and `farm demo` do)")
    link = AdbPageLink(adb) if adb is not None else WebPageLink(public_url(settings), device.serial)
    return BrowserTransport(settings.data_dir / "devices" / device.serial, link, token,
                            settings.config_dir / PUBLIC_KEY, name=device.serial, hub=hub)


def _queue_of(device: Device, settings: Settings) -> str:
    # A phone is driven by the worker of the host it is plugged into.
    return host_queue(device.host.name if device.host is not None else settings.host_name)


def _lease_holder(what: str) -> str:
    # Unique per execution: a redelivered copy of the same task must not share (or release)
    # the lease of the copy that is running.
    return f"{what}:{uuid.uuid4().hex}"


def _lease_countdown(retries: int) -> float:
    first, longest = LEASE_RETRY_S
    return min(longest, first * 2 ** min(retries, 16))


class _Heartbeat:
    """A thread that, while a job or deployment runs, stamps its heartbeat and renews the device
    lease, each time in its own short transaction."""

    def __init__(self, app: Celery, beat, device_id: int, holder: str, name: str, timed: bool = False):
        self.app, self.beat, self.device_id, self.holder, self.timed = app, beat, device_id, holder, timed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{name}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with session_for(self.app) as session, session.begin():
                    self.beat(session)
                    store.acquire_device_lease(session, self.device_id, self.holder, LEASE_S, timed=self.timed)
            except Exception:  # noqa: BLE001  (a missed beat is not fatal; the next one may land)
                log.exception("heartbeat %s failed", self._thread.name)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=HEARTBEAT_S + 5)


class _Throttle:
    """At most one write every PROGRESS_EVERY_S, unless forced: what progress listeners share."""

    _last = 0.0

    def _due(self, force: bool) -> bool:
        now = time.monotonic()
        if not force and now - self._last < PROGRESS_EVERY_S:
            return False
        self._last = now
        return True


class _JobProgress(_Throttle):
    """A transport progress listener that records where a running job is: the agent's last
    phase, and its last step's done/total within it (at most every PROGRESS_EVERY_S, each in
    its own short transaction; a phase change is written at once). What `farm jobs submit
    --wait` and `farm jobs show` display."""

    def __init__(self, app: Celery, job_id: int, attempt: int):
        self.app, self.job_id, self.attempt = app, job_id, attempt
        self.state: dict[str, Any] = {"attempt": attempt}

    def __call__(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "phase":
            self.state = {"attempt": self.attempt, "phase": str(event.get("phase", ""))}
            self._write(force=True)
        elif kind == "step":
            self.state |= {"phase": str(event.get("phase") or self.state.get("phase", "")),
                           "done": int(event.get("done") or 0), "total": int(event.get("total") or 0)}
            self._write(force=event.get("done") == event.get("total"))

    def _write(self, force: bool = False) -> None:
        if not self._due(force):
            return
        self.state["at"] = utcnow().isoformat()
        try:
            with session_for(self.app) as session, session.begin():
                store.record_job_progress(session, self.job_id, self.attempt, dict(self.state))
        except Exception:  # noqa: BLE001  (progress is a courtesy: the job goes on without it)
            log.warning("could not record the progress of job %s", self.job_id, exc_info=True)


class _DeployProgress(_Throttle):
    """A transport progress listener that records a deployment's bytes sent so far (at most
    every PROGRESS_EVERY_S, each in its own short transaction): what `farm deploy` follows."""

    def __init__(self, app: Celery, deployment_id: int):
        self.app, self.deployment_id = app, deployment_id
        self.total: int | None = None

    def __call__(self, event: dict) -> None:
        if event.get("event") == "bundle_plan":
            self.total = int(event.get("bytes") or 0)
            self._write(0, force=True)
        elif event.get("event") == "push":
            self.total = int(event.get("bytes_total") or self.total or 0) or None
            self._write(int(event.get("bytes_sent") or 0))

    def _write(self, sent: int, force: bool = False) -> None:
        if not self._due(force):
            return
        with session_for(self.app) as session, session.begin():
            store.record_deployment_progress(session, self.deployment_id, sent, self.total)


def _release(app: Celery, device_id: int, holder: str) -> None:
    """Give the device back and hand it to the first submitted job waiting for it (a job that
    found the device busy waits in the store with no message: this is its message), and, where
    the device shares its GPU, the first waiting job of each device of its adapter group that
    can start now. Were this lost, the reconciler sends the same jobs on its next pass."""
    settings, sends = settings_of(app), Sends()
    try:
        with session_for(app) as session, session.begin():
            _hand_over(session, settings, sends, device_id, holder)
    except Exception:  # noqa: BLE001  (the lease expires by itself; the reconciler hands the device on)
        log.exception("could not give device %s back", device_id)
        return
    sends.send(app)


def _hand_over(session: Session, settings: Settings, sends: Sends, device_id: int, holder: str) -> None:
    """_release's work inside the caller's transaction: the outcome it records and the device
    given back commit together, so whoever sees the outcome sees the device free. The work that
    waits for this device or its GPU is sent at once: the first due job of each device of the
    adapter group, and the group's pending deployments (a deployment that found the device busy
    otherwise sleeps out its retry back-off, up to LEASE_RETRY_S[1], while the GPU idles: in one
    demo run, a batch's more-repetitions rounds on three devices kept the GPU idle 22 s of 59)."""
    store.release_device_lease(session, device_id, holder)
    group = store.adapter_group_of(session, device_id)
    for deployment in store.pending_deployments(session, group):
        sends.deployment(session, settings, deployment.id,
                         store.redispatch_deployment(session, deployment.id, _grace(settings), new_message=True))
    for job in store.find_due_queued_jobs(session, utcnow(), device_id=group):
        sends.job(session, settings, job.id, store.redispatch_job(session, job.id, _grace(settings),
                                                                  new_message=True))


# ---- sending: always after the commit; the reconciler covers a send that never happens ------


@dataclass
class Sends:
    """Messages decided inside a transaction, sent once it has committed."""

    jobs: list[tuple[int, int | None, str, float | None]] = field(default_factory=list)  # id, seq, queue, countdown
    deployments: list[tuple[int, int | None, str]] = field(default_factory=list)  # id, seq, queue
    batches: set[int] = field(default_factory=set)  # batches that may have settled

    def job(self, session: Session, settings: Settings, job_id: int, seq: int | None,
            countdown: float | None = None) -> None:
        if seq is not None:
            self.jobs.append((job_id, seq, _queue_of(store.get_job(session, job_id).device, settings), countdown))

    def deployment(self, session: Session, settings: Settings, deployment_id: int, seq: int | None) -> None:
        if seq is not None:
            device = store.get_device(session, store.get_deployment(session, deployment_id).device_id)
            self.deployments.append((deployment_id, seq, _queue_of(device, settings)))

    def send(self, app: Celery, *, strict: bool = False) -> None:
        """Publish. A failure is logged, not raised (unless `strict`): the work is in the store
        and the reconciler sends it once its deadline passes."""
        for deployment_id, seq, queue in self.deployments:
            _publish(app, DEPLOY, (deployment_id, seq), queue, strict=strict)
        for job_id, seq, queue, countdown in self.jobs:
            _publish(app, RUN_JOB, (job_id, seq), queue, countdown, strict=strict)
        for batch_id in sorted(self.batches):
            settle_batch(app, batch_id)


def _publish(app: Celery, task: str, args: tuple, queue: str, countdown: float | None = None, *,
             strict: bool = False) -> None:
    # Outcomes live in the store and nothing waits on these tasks' results. With Redis as the
    # result backend, a send that keeps one subscribes to its channel first, and with Redis down
    # that subscription is retried for 19 s before the send fails (0.6 s without).
    options: dict[str, Any] = {"queue": queue, "ignore_result": True}
    if countdown:
        options["countdown"] = countdown
    try:
        app.signature(task, args=args).apply_async(**options)
    except Exception as exc:  # noqa: BLE001  (the broker is down: the reconciler resends)
        if strict:
            raise
        log.warning("could not send %s%s to %s (%s); the reconciler sends it again", task, args, queue, exc)


def send_jobs(app: Celery, job_ids: list[int], *, strict: bool = False) -> list[int]:
    """Send run_job for each queued job (to its device's host queue) with a fresh deadline;
    what the CLI and tests use to start jobs that wait on no deployment. With `strict`, a broker
    that cannot be reached raises (the CLI says so) instead of leaving it to the reconciler.
    Returns the ids sent."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        for job_id in job_ids:
            sends.job(session, settings, job_id, store.redispatch_job(session, job_id, _grace(settings),
                                                                      new_message=True))
    sends.send(app, strict=strict)
    return [job_id for job_id, *_ in sends.jobs]


def settle_batch(app: Celery, batch_id: int | None) -> None:
    """When the job that just settled (ran, could not deploy, was given up or cancelled) was
    its batch's last open one, send the batch's analysis (once: finish_batch_if_done is a
    conditional UPDATE; the reconciler resends it if that message is lost)."""
    if batch_id is None:
        return
    with session_for(app) as session, session.begin():
        done = store.finish_batch_if_done(session, batch_id)
    if done:
        _publish(app, ANALYZE_BATCH, (batch_id,), DEFAULT_QUEUE)


def _end_job(session: Session, sends: Sends, job: Job, error: str, attempt: int | None = None, *,
             settle: bool = True, worker_lost: bool = False) -> bool:
    """A job that cannot run ends as infra_failed with `error` (flushes only); with `settle`,
    its batch may have ended with it."""
    try:
        store.transition_job(session, job.id, JobState.infra_failed, error=error, attempt=attempt,
                             worker_lost=worker_lost)
    except store.InvalidTransition:
        return False
    if settle and job.batch_id is not None:
        sends.batches.add(job.batch_id)
    return True


def _retry_or_end(session: Session, settings: Settings, sends: Sends, job_id: int, *,
                  worker_lost: bool = False) -> bool:
    """An infra-failed job goes back to queued and is sent again after REQUEUE_DELAY_S (after a
    lost worker, a delay doubling with each loss) unless it has used its attempts of that kind,
    in which case it stays infra_failed and its batch may settle."""
    job = store.get_job(session, job_id)
    session.refresh(job)
    device_failures = job.attempts - job.worker_losses
    if job.worker_losses >= MAX_WORKER_LOSSES or device_failures >= MAX_ATTEMPTS:
        if job.batch_id is not None:
            sends.batches.add(job.batch_id)
        return False
    delay = REQUEUE_DELAY_S
    if worker_lost:
        delay = min(WORKER_LOSS_DELAY_MAX_S, REQUEUE_DELAY_S * 2 ** (job.worker_losses - 1))
    store.transition_job(session, job_id, JobState.queued)
    seq = store.redispatch_job(session, job_id, _grace(settings, delay), new_message=True)
    sends.job(session, settings, job_id, seq, delay)
    return True


# ---- submitting ---------------------------------------------------------------------------


def check_time_limit(settings: Settings, spec: dict[str, Any]) -> None:
    """Refuse a job longer than the farm's longest job time: Redis would deliver its message
    again while it still runs (celery_app.visibility_timeout_s)."""
    limit = float(spec.get("time_limit_s") or JobSpec.time_limit_s)
    if limit > settings.max_job_time_s:
        raise store.StoreError(f"a time limit of {limit:g} s is over the farm's max_job_time_s "
                               f"({settings.max_job_time_s:g} s); ask for less or raise FARM_MAX_JOB_TIME_S")


def queue_jobs(session: Session, settings: Settings, name: str, build_id: int, kind: str, spec: dict[str, Any],
               device_ids: list[int]) -> tuple[Batch, list[int]]:
    """One job per device as one batch (the build already deployed), for `farm jobs submit`;
    flushes only. The caller commits, then sends them with send_jobs (or the reconciler does
    once they are due). StoreError for a time limit the farm does not accept."""
    check_time_limit(settings, spec)
    batch = store.create_batch(session, name, build_id=build_id)
    job_ids = [store.create_job(session, kind, spec, device_id, build_id, batch_id=batch.id,
                                due_at=_grace(settings)).id for device_id in device_ids]
    return batch, job_ids


def deploy_build(app: Celery, build_id: int, device_ids: list[int], batch_id: int) -> list[int]:
    """Deployments of a build to devices, recorded pending and sent; returns their ids."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        ids = []
        for device_id in device_ids:
            deployment = store.create_deployment(session, build_id, device_id, batch_id=batch_id,
                                                 due_at=_grace(settings))
            ids.append(deployment.id)
            sends.deployment(session, settings, deployment.id, deployment.dispatch_seq)
    sends.send(app)
    return ids


def _create_suite(session: Session, settings: Settings, sends: Sends, name: str, jobs: list[dict], *,
                  build: int | str | None, devices: list[str] | str, schedule_id: int | None,
                  idempotency_key: str | None, max_extra_rounds: int | None,
                  round_metrics: list[str] | None = None) -> int:
    build_row = store.get_build(session, build)
    if devices == "all":
        targets = store.in_service_devices(session)
    else:
        targets = [store.get_device(session, serial) for serial in devices]
    if not targets:
        raise store.StoreError("no devices to run on; `farm devices add` registers one")
    if not jobs:
        raise store.StoreError("a suite needs at least one job")
    for entry in jobs:
        check_time_limit(settings, entry.get("spec") or {})
        if entry.get("runtime") not in (None, "python", "browser"):
            raise store.StoreError(f"a job entry's runtime is python or browser, not {entry['runtime']!r}")
    batch = store.create_batch(session, name, build_id=build_row.id, schedule_id=schedule_id,
                               idempotency_key=idempotency_key,
                               max_extra_rounds=3 if max_extra_rounds is None else max_extra_rounds,
                               round_metrics=round_metrics)
    if idempotency_key is not None and batch.jobs:
        return batch.id  # launched before: the reconciler sends whatever of it has not run
    entry_builds = [build_row if entry.get("build") is None else store.get_build(session, entry["build"])
                    for entry in jobs]
    models: dict[int, str] = {}
    for device in targets:
        deployments: dict[int, Deployment] = {}
        tune_job: int | None = None  # a "tuned" latency job runs after the device's tune job
        for index, (entry, job_build) in enumerate(zip(jobs, entry_builds, strict=True)):
            if entry.get("runtime") not in (None, device.runtime):
                continue  # an entry for the devices of another runtime
            spec = dict(entry.get("spec") or {})
            if not spec.get("model"):
                if job_build.id not in models:
                    models[job_build.id] = store.default_model(job_build)
                spec["model"] = models[job_build.id]
            if job_build.id not in deployments:
                deployments[job_build.id] = store.create_deployment(session, job_build.id, device.id,
                                                                    batch_id=batch.id, due_at=_grace(settings))
            key = f"{idempotency_key}:{device.serial}:{index}" if idempotency_key else None
            after = tune_job if spec.get("profile") == profiles.TUNED else None
            job = store.create_job(session, entry["kind"], spec, device.id, job_build.id, key,
                                   schedule_id=schedule_id, batch_id=batch.id,
                                   deployment_id=deployments[job_build.id].id, after_job_id=after)
            if entry["kind"] == "tune":
                tune_job = job.id
        for deployment in deployments.values():
            sends.deployment(session, settings, deployment.id, deployment.dispatch_seq)
    return batch.id


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
    round_metrics: list[str] | None = None,
) -> int:
    """Start a batch: for each device (serials, or "all" devices not quarantined), deploy the
    build (newest when None) and then run every job of `jobs` ({"kind": ..., "spec": {...}},
    the spec's model defaulting to the build's) on it; each device's chain runs on its host's
    queue, all devices in parallel; the last job to settle sends the batch's analysis. With an
    `idempotency_key` (a schedule's firing), launching again changes nothing. An inconclusive
    analysis may launch `max_extra_rounds` follow-up batches with more repetitions (default 3),
    for the `round_metrics` only when given.
    A job entry may name its own "build" (id or name): the follow-up batches rerun the baseline
    build that way, next to the candidate. An entry with a "runtime" (python, browser) runs on
    the devices of that runtime only. Everything is written in one transaction and sent
    after it. Returns the batch id."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        batch_id = _create_suite(session, settings, sends, name, jobs, build=build, devices=devices,
                                 schedule_id=schedule_id, idempotency_key=idempotency_key,
                                 max_extra_rounds=max_extra_rounds, round_metrics=round_metrics)
    sends.send(app)
    return batch_id


def _schedule_suite(session: Session, settings: Settings, sends: Sends, schedule_id: int,
                    fired_at: dt.datetime) -> int:
    schedule = store.get_schedule(session, schedule_id)
    suite = dict(schedule.suite)
    stamp = fired_at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return _create_suite(session, settings, sends, f"{schedule.name} {stamp}", suite.get("jobs") or [],
                         build=suite.get("build"), devices=suite.get("devices") or "all", schedule_id=schedule_id,
                         idempotency_key=f"schedule{schedule_id}:{stamp}", max_extra_rounds=None)


def fire_schedule(app: Celery, schedule_id: int, fired_at: dt.datetime) -> int:
    """Launch schedule `schedule_id`'s suite for its firing at `fired_at` (idempotent per firing)."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        batch_id = _schedule_suite(session, settings, sends, schedule_id, fired_at)
    sends.send(app)
    return batch_id


def fire_due_schedules(app: Celery) -> list[int]:
    """Beat's tick: fire every enabled schedule that is due. A firing is claimed and its suite
    written in one transaction, so two beats, or a beat killed mid-tick, fire it exactly once.
    Returns the batches launched."""
    settings, batches = settings_of(app), []
    now = store.utcnow()
    with session_for(app) as session, session.begin():
        due = [(s.id, s.last_run_at, fire) for s, fire in store.due_schedules(session, now)]
    for schedule_id, previous, fire in due:
        sends = Sends()
        try:
            with session_for(app) as session, session.begin():
                if not store.claim_schedule_firing(session, schedule_id, previous, fire):
                    continue
                batches.append(_schedule_suite(session, settings, sends, schedule_id, fire))
        except store.StoreError as exc:  # no build yet, no devices: the firing is skipped, the next may work
            log.error("schedule %s could not fire: %s", schedule_id, exc)
            with session_for(app) as session, session.begin():
                store.claim_schedule_firing(session, schedule_id, previous, fire)
            continue
        sends.send(app)
    return batches


# ---- running a job ------------------------------------------------------------------------


def run_job(app: Celery, job_id: int, seq: int | None = None, *, worker: str | None = None) -> str:
    """Run job `job_id` on its device once, for the message carrying dispatch sequence `seq`
    (None: any). Returns the job's state as this execution left it, "skipped" (another
    execution has it, or it is finished), "superseded" (a newer message owns it), or "waiting":
    its device is busy, and the job waits in the store, with no message, until whoever holds
    the device hands it over (_release), or the reconciler sees the device free; the
    reconciler also ends a job that waited `max_queue_wait_s`."""
    settings, sends = settings_of(app), Sends()
    holder = _lease_holder(f"job{job_id}")

    # 1. Take the device and the job in one short transaction: both or neither.
    try:
        with session_for(app) as session, session.begin():
            job = store.get_job(session, job_id)
            if job.state != JobState.queued:
                return "skipped"
            if seq is not None and job.dispatch_seq != seq:
                return "superseded"
            device = job.device
            if _prior_pending(session, job):
                return "waiting"  # its prior job sends it again when it succeeds
            if device.state == DeviceState.quarantined:
                _end_job(session, sends, job, f"device {device.serial} is quarantined "
                                              f"({device.state_reason or 'no reason given'}); the job did not run")
                outcome: str | None = "infra_failed"
            elif not store.acquire_device_lease(session, job.device_id, holder, LEASE_S,
                                                timed=job.kind in store.TIMED_KINDS):
                # Its deadline is now: from here on the job needs a message as soon as the device
                # is free, and no message of its own is on its way.
                store.redispatch_job(session, job_id, utcnow(), new_message=False)
                outcome = "waiting"
            else:
                # Raises InvalidTransition when another execution won; the rollback then
                # gives the lease back too.
                job = store.transition_job(session, job_id, JobState.running, worker=worker)
                device_id, attempt, batch_id = device.id, job.attempts, job.batch_id
                timed = job.kind in store.TIMED_KINDS
                problem = profiles.resolve_tuned(session, job)
                if problem is not None:  # asked for a tuned profile that does not exist: its own fault
                    store.transition_job(session, job_id, JobState.failed, error=problem, attempt=attempt)
                    _hand_over(session, settings, sends, device_id, holder)
                    _after_job(session, sends, job_id, JobState.failed)
                    if batch_id is not None:
                        sends.batches.add(batch_id)
                    outcome = str(JobState.failed)
                else:
                    fields = dict(job.spec or {}) | {"job_id": f"job{job_id}-a{attempt}", "kind": str(job.kind)}
                    if job.build is not None and not fields.get("build"):
                        fields["build"] = job.build.name
                    outcome = None
    except store.InvalidTransition:
        return "skipped"
    if outcome is not None:
        sends.send(app)
        return outcome

    # 2. Talk to the device with no transaction open; heartbeats keep job and lease alive.
    state, error, result, device_state = None, None, None, None
    try:
        spec = from_dict(JobSpec, fields)
        transport = make_transport(device, settings)
        out_dir = settings.data_dir / "results" / f"job{job_id}" / f"attempt{attempt}"
        with _Heartbeat(app, lambda s: store.heartbeat_job(s, job_id), device_id, holder, f"job{job_id}",
                        timed), transport:
            result = transport.run(spec, out_dir, progress=_JobProgress(app, job_id, attempt))
    except TransportError as exc:
        state, error = JobState.infra_failed, str(exc)
        device_state = store.TRANSPORT_STATES.get(exc.state)
    except Exception as exc:  # a bad spec, a bad stored address or a bug here: recorded, not retried
        state, error = JobState.failed, f"{type(exc).__name__}: {exc}"
        log.exception("job %s failed in the worker", job_id)

    # 3. Record the outcome and give the device back in one short transaction, conditional on
    # this attempt (when that fails, the device is given back on its own).
    released = False
    try:
        with session_for(app) as session, session.begin():
            if result is not None:
                state = JobState.succeeded if result.status == "succeeded" else JobState.failed
                store.transition_job(session, job_id, state, error=result.error, log_tail=result.log_tail,
                                     attempt=attempt)
                run = store.record_result(session, job_id, result, attempt, artifacts_dir=out_dir)
                store.count_job_outcome(session, device_id, state)  # it ran: the device's failures in a row end
                profiles.register(session, store.get_job(session, job_id), run, result, out_dir)  # tune jobs
                if batch_id is not None:
                    sends.batches.add(batch_id)
            else:
                store.transition_job(session, job_id, state, error=error, attempt=attempt)
                if device_state is not None and device_state != "busy":
                    store.set_device_state(session, device_id, device_state, error or "")
                if state == JobState.infra_failed:
                    if _retry_or_end(session, settings, sends, job_id):
                        state = "requeued"
                    else:  # it ended so: the third in a row quarantines the device (docs/devices.md)
                        store.count_job_outcome(session, device_id, state, error)
                elif batch_id is not None:
                    sends.batches.add(batch_id)
            _after_job(session, sends, job_id, state)
            _hand_over(session, settings, sends, device_id, holder)
        released = True
    except store.InvalidTransition:
        # The reconciler took the job from us (no heartbeat landed): its next run counts.
        log.warning("job %s was taken away while running; attempt %s is not recorded", job_id, attempt)
        return "dropped"
    finally:
        if not released:
            _release(app, device_id, holder)
    sends.send(app)
    return str(state)


# ---- deploying ----------------------------------------------------------------------------


def deploy(app: Celery, deployment_id: int, seq: int | None = None, *, retries: int = 0) -> int | str | Wait:
    """Send a pending deployment's bundle (<data_dir>/builds/<name>) to its device; the
    transport sends only missing files, so running it again is cheap. Then the jobs waiting for
    it are sent when it succeeded, or end as infra_failed with its error when it failed.
    Returns the deployment id, "skipped"/"superseded" like run_job, or Wait."""
    settings, sends = settings_of(app), Sends()
    holder = _lease_holder(f"deploy{deployment_id}")
    with session_for(app) as session, session.begin():
        deployment = store.get_deployment(session, deployment_id)
        if deployment.status != DeploymentStatus.pending:
            return "skipped"
        if seq is not None and deployment.dispatch_seq != seq:
            return "superseded"
        device = store.get_device(session, deployment.device_id)
        build = session.get(Build, deployment.build_id)
        if build is None:
            raise store.StoreError(f"no build {deployment.build_id}")
        if not store.acquire_device_lease(session, device.id, holder, LEASE_S):
            countdown = _lease_countdown(retries)
            store.redispatch_deployment(session, deployment_id, _grace(settings, countdown), new_message=False)
            return Wait(countdown)
        attempt = store.start_deployment(session, deployment_id, seq)
        if attempt is None:
            store.release_device_lease(session, device.id, holder)
            return "skipped"
        device_id, build_name = device.id, build.name
    released = False
    try:
        status, report, error, device_state = DeploymentStatus.failed, None, None, None
        try:
            beat = _Heartbeat(app, lambda s: store.heartbeat_deployment(s, deployment_id), device_id, holder,
                              f"deploy{deployment_id}")
            with beat, make_transport(device, settings) as transport:
                report = transport.send_bundle(settings.data_dir / "builds" / build_name,
                                               progress=_DeployProgress(app, deployment_id))
            status = DeploymentStatus.succeeded
        except TransportError as exc:
            error = str(exc)
            device_state = store.TRANSPORT_STATES.get(exc.state)
        except (OSError, ValueError) as exc:  # ValueError: a stored address that cannot be used
            error = f"{type(exc).__name__}: {exc}"
        with session_for(app) as session, session.begin():
            counts = ({"bytes_sent": report.bytes_sent, "files_sent": report.files_sent,
                       "files_skipped": report.files_skipped, "duration_s": report.seconds} if report else {})
            if not store.finish_deployment(session, deployment_id, attempt, status, error=error, **counts):
                log.warning("deployment %s was taken away while running; attempt %s is not recorded",
                            deployment_id, attempt)
                return "dropped"
            if status == DeploymentStatus.failed and device_state is not None and device_state != "busy":
                store.set_device_state(session, device_id, device_state, error or "")
            _after_deployment(session, settings, sends, deployment_id, status, error)
            _hand_over(session, settings, sends, device_id, holder)
        released = True
    finally:
        if not released:
            _release(app, device_id, holder)
    sends.send(app)
    return deployment_id


def _after_deployment(session: Session, settings: Settings, sends: Sends, deployment_id: int,
                      status: DeploymentStatus, error: str | None) -> None:
    """The jobs that waited for a deployment: sent when it succeeded, ended when it failed."""
    waiting = session.scalars(select(Job).where(Job.deployment_id == deployment_id,
                                                Job.state == JobState.queued).order_by(Job.id)).all()
    build = session.get(Build, store.get_deployment(session, deployment_id).build_id)
    for job in waiting:
        if status == DeploymentStatus.succeeded and _prior_pending(session, job):
            continue  # its prior job sends it when it succeeds (_after_job)
        if status == DeploymentStatus.succeeded:
            sends.job(session, settings, job.id, store.redispatch_job(session, job.id, _grace(settings),
                                                                      new_message=True))
        else:
            _end_job(session, sends, job, f"deployment of {build.name if build else '?'} to {job.device.serial} "
                                          f"failed: {error}")


def _prior_pending(session: Session, job: Job) -> bool:
    """`job` runs after another job that has not ended yet."""
    if job.after_job_id is None:
        return False
    prior = session.get(Job, job.after_job_id)
    return prior is not None and prior.state in (JobState.queued, JobState.running)


def _after_job(session: Session, sends: Sends, job_id: int, state: JobState | str) -> None:
    """A job that ended without succeeding ends the jobs that were to run after it (a job that
    succeeded hands its device, and so them, on in _hand_over)."""
    if state not in (JobState.failed, JobState.infra_failed, JobState.cancelled):
        return
    waiting = session.scalars(select(Job).where(Job.after_job_id == job_id, Job.state == JobState.queued)
                              .order_by(Job.id)).all()
    for job in waiting:
        _end_job(session, sends, job, f"job {job_id}, which it runs after, ended {state}; it did not run")


# ---- the reconciler -----------------------------------------------------------------------


def reconcile(app: Celery) -> dict[str, list[int]]:
    """Find what lost its owner and act, in one transaction, then send (beat runs this every
    `reconcile_every_s`):

    1. running jobs whose worker went silent for `stale_after_s`: infra_failed, then queued and
       sent again (after a delay doubling with each loss) until MAX_WORKER_LOSSES;
    2. running deployments whose worker went silent: pending again and resent until
       MAX_WORKER_LOSSES, then failed with their jobs; pending ones past their deadline: resent;
    3. queued jobs whose deployment failed, or that waited `max_queue_wait_s`: ended; queued
       jobs past their deadline (never sent, their message lost with a dead worker, their
       deployment ended without sending them, or waiting for a device that is now free and
       that no other message is heading for): resent, the first submitted one per device;
    4. finished batches whose analysis did not come: analysed.

    Returns the ids it acted on, by what it did."""
    settings, sends = settings_of(app), Sends()
    now = utcnow()
    stale = dt.timedelta(seconds=settings.stale_after_s)
    report: dict[str, list[int]] = {key: [] for key in (
        "jobs_requeued", "jobs_resent", "jobs_ended", "deployments_resent", "deployments_failed", "batches_analysed")}
    with session_for(app) as session, session.begin():
        for job in store.find_stale_running_jobs(session, stale):
            # Not settled here: _retry_or_end queues it again, or settles its batch when it gives up.
            losses = job.worker_losses + 1
            if not _end_job(session, sends, job, f"worker {job.worker or '?'} lost: no heartbeat for "
                                                 f"{settings.stale_after_s:g} s (worker lost {losses} of at most "
                                                 f"{MAX_WORKER_LOSSES} times while running this job)",
                            attempt=job.attempts, settle=False, worker_lost=True):
                continue
            device = store.get_device(session, job.device_id)
            if device.lease_holder and device.lease_holder.startswith(f"job{job.id}:"):
                store.release_device_lease(session, device.id, device.lease_holder)
            if _retry_or_end(session, settings, sends, job.id, worker_lost=True):
                report["jobs_requeued"].append(job.id)
            else:
                report["jobs_ended"].append(job.id)

        for deployment in store.find_due_deployments(session, now, now - stale):
            if deployment.status == DeploymentStatus.running:
                device = store.get_device(session, deployment.device_id)
                if device.lease_holder and device.lease_holder.startswith(f"deploy{deployment.id}:"):
                    store.release_device_lease(session, device.id, device.lease_holder)
                error = f"worker lost: no heartbeat for {settings.stale_after_s:g} s"
                if deployment.attempts < MAX_WORKER_LOSSES:  # its only retried failure is a lost worker
                    if not store.requeue_deployment(session, deployment.id, deployment.attempts, _grace(settings), error):
                        continue
                else:
                    if store.finish_deployment(session, deployment.id, deployment.attempts, DeploymentStatus.failed,
                                               error=f"{error}, {deployment.attempts} attempts"):
                        _after_deployment(session, settings, sends, deployment.id, DeploymentStatus.failed, error)
                        report["deployments_failed"].append(deployment.id)
                    continue
            seq = store.redispatch_deployment(session, deployment.id, _grace(settings), new_message=True)
            if seq is not None:
                sends.deployment(session, settings, deployment.id, seq)
                report["deployments_resent"].append(deployment.id)

        for job in store.find_jobs_after_failed_jobs(session):
            if _end_job(session, sends, job, f"job {job.after_job_id}, which it runs after, did not succeed; "
                                             "it did not run"):
                report["jobs_ended"].append(job.id)
        for job in store.find_jobs_of_failed_deployments(session):
            if _end_job(session, sends, job, f"deployment {job.deployment_id} to {job.device.serial} failed: "
                                             f"{job.deployment.error}"):
                report["jobs_ended"].append(job.id)
        too_long = now - dt.timedelta(seconds=settings.max_queue_wait_s)
        for job in store.find_jobs_waiting_too_long(session, too_long):
            device = job.device
            waited = (now - (job.queued_at or job.created_at)).total_seconds()
            if _end_job(session, sends, job, f"gave up after waiting {waited / 3600:.1f} h to start on {device.serial}"
                                             f" (held by: {device.lease_holder or 'no one'}); max_queue_wait_s "
                                             "bounds the wait"):
                report["jobs_ended"].append(job.id)
        for job in store.find_due_queued_jobs(session, now):
            seq = store.redispatch_job(session, job.id, _grace(settings), new_message=True)
            sends.job(session, settings, job.id, seq)
            if seq is not None:
                report["jobs_resent"].append(job.id)

        analysis_due = now - dt.timedelta(seconds=ANALYSIS_GRACE_FACTOR * settings.message_grace_s)
        report["batches_analysed"] = list(session.scalars(
            select(Batch.id).where(Batch.finished_at.is_not(None), Batch.finished_at < analysis_due,
                                   Batch.summary.is_(None)).order_by(Batch.id).limit(100)))
    sends.send(app)
    for batch_id in report["batches_analysed"]:
        _publish(app, ANALYZE_BATCH, (batch_id,), DEFAULT_QUEUE)
    if any(report.values()):
        log.warning("reconciled: %s", {k: v for k, v in report.items() if v})
    return report


# ---- analysis and more-repetition rounds --------------------------------------------------


def analyze(app: Celery, batch_id: int) -> dict:
    """A finished batch's analysis: its per-device summary and the regression analysis
    (orchestrator/analysis.py: comparisons against each series' baseline, alerts, fidelity,
    data stoppages), stored on the batch and written to <data_dir>/reports/batch-<id>.json for
    whatever sends notifications. Inconclusive comparisons launch a follow-up batch with more
    repetitions on those devices (at most the batch's max_extra_rounds rounds; idempotent)."""
    from agent.bundle import atomic_write
    from orchestrator import analysis
    from orchestrator.summary import batch_summary

    settings = settings_of(app)
    with session_for(app) as session, session.begin():
        batch = store.get_batch(session, batch_id)
        report = analysis.analyze_batch(session, batch_id)
        report["profile_gains"] = profiles.measure_gains(session, batch_id)
        # Each series the batch fed, scanned over its whole history (not only inside an alert).
        devices = {job.device for job in batch.jobs}
        report["change_points"] = [point for device in sorted(devices, key=lambda d: d.serial)
                                   for point in analysis.scan_change_points(session, device)]
        summary = batch_summary(session, batch_id) | {"analysis": report}
        rounds = extra_round(batch.idempotency_key)
        follow_up = report["more_repetitions"] if rounds < batch.max_extra_rounds else []
        name, build_id, root, max_rounds = batch.name, batch.build_id, _root_batch(batch), batch.max_extra_rounds
        round_metrics = batch.round_metrics
        batch.summary = summary
    report_path = settings.data_dir / "reports" / f"batch-{batch_id}.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(report_path, json.dumps(summary, indent=2, default=str).encode())
    for device, jobs in more_repetitions_jobs(follow_up).items():
        launch_suite(app, f"{name} (more repetitions, round {rounds + 1})", jobs, build=build_id,
                     devices=[device], idempotency_key=f"more:{root}:{rounds + 1}:{device}",
                     max_extra_rounds=max_rounds, round_metrics=round_metrics)
    return summary


def more_repetitions_jobs(entries: list[dict]) -> dict[str, list[dict]]:
    """Device serial -> the jobs of its more-repetitions round, from the analysis'
    "more_repetitions" entries: a new latency run of the candidate (the batch's build) and one
    of its baseline (the entry's "baseline_build"), each with the repetitions asked for.
    Run-to-run drift averages only over runs, and the baseline's single earlier run would
    otherwise bound what any number of candidate runs can show. Only the samples of the
    undecided metrics ("metrics": UNet steps for unet_step_ms, end-to-end generations for the
    others) are asked for; kernel timings, which the first runs already gave, are not taken
    again."""
    jobs_by_device: dict[str, list[dict]] = {}
    for entry in entries:
        metrics = entry.get("metrics") or ["unet_step_ms", "e2e_ms"]
        spec = dict(entry["spec"]) | {"unet_repetitions": entry["repetitions"], "warmup": 1, "kernel_timings": False}
        # End-to-end generations: as many as asked when an end-to-end metric is undecided, else
        # one (a UNet-step round's generations would only add time).
        spec["repetitions"] = entry["repetitions"] if set(metrics) - {"unet_step_ms"} else 1
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
