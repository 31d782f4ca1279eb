"""The worker side of the job path: what a Celery worker does with a job or deployment message
once it arrives. It builds the transport for a device row (transports/factory.py), takes the device's
lease, runs one attempt of a job (run_attempt) or sends a build (deploy) with no transaction
open, keeps the work and the lease alive with a heartbeat thread that stops the work on the
device as soon as it is no longer this worker's, records progress as the agent reports it, and
records the outcome, conditional on the attempt, as orchestrator/jobs/dispatch.py promises. The
Celery tasks (orchestrator/jobs/tasks.py) are thin wrappers that take ids and call these."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from celery import Celery

from agent.protocol import JobSpec, ProtocolError
from orchestrator import store
from orchestrator.analysis import profiles
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import session_for, settings_of
from orchestrator.jobs.dispatch import (
    Sends,
    after_deployment,
    after_job,
    end_job,
    grace,
    hand_over,
    prior_pending,
    release,
    retry_or_end,
)
from orchestrator.store.models import (
    Build,
    DeploymentStatus,
    DeviceState,
    JobState,
    utcnow,
)
from orchestrator.store.retention import run_folder
from orchestrator.transports import DeviceBusy, TransportError
from orchestrator.transports.factory import make_transport

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # how often a running job or deployment says it is alive and renews its device lease
LEASE_S = 60.0  # a device lease outlives a dead worker by at most this
# A deployment's first and longest wait for a busy device (doubling in between). Short: with
# timed jobs on a shared GPU taking turns, a more-repetitions round's deployment (nothing to
# send, a second's work) otherwise idled up to a minute between jobs of 10-20 s.
LEASE_RETRY_S = (1.0, 8.0)
PROGRESS_EVERY_S = 0.5  # how often a deploy records its bytes sent


@dataclass(frozen=True)
class Wait:
    """The device is busy: the task is to be retried after `countdown` seconds (its deadline
    was already moved past that)."""

    countdown: float


# ---- leases, heartbeat and progress ----------------------------------------------------------


def _lease_holder(what: str) -> str:
    # Unique per execution: a redelivered copy of the same task must not share (or release)
    # the lease of the copy that is running.
    return f"{what}:{uuid.uuid4().hex}"


def _lease_countdown(retries: int) -> float:
    first, longest = LEASE_RETRY_S
    return min(longest, first * 2 ** min(retries, 16))


class _Heartbeat:
    """A thread that, while a job or deployment runs, stamps its heartbeat and renews the device
    lease, each time in its own short transaction.

    With `on_lost`, the work is stopped (on_lost(reason), once, from its own thread) as soon as
    it is no longer this worker's: the beat says it is not (a job cancelled, or given to another
    worker), the lease went to another holder, or no renewal has landed for long enough that
    the lease could run out before the next try (the store is unreachable). Then the reconciler
    may hand the device to someone else, and two runs must never overlap on it."""

    def __init__(self, app: Celery, beat, device_id: int, holder: str, name: str, timed: bool = False,
                 on_lost=None):
        self.app, self.beat, self.device_id, self.holder, self.timed = app, beat, device_id, holder, timed
        self.on_lost = on_lost
        self.lost: str | None = None
        self._renewed = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{name}", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with session_for(self.app) as session, session.begin():
                    ours = self.beat(session)
                    held = store.acquire_device_lease(session, self.device_id, self.holder, LEASE_S,
                                                      timed=self.timed)
            except Exception:  # noqa: BLE001  (a missed beat is not fatal; the next one may land)
                log.exception("heartbeat %s failed", self._thread.name)
                silent = time.monotonic() - self._renewed
                if silent > LEASE_S - 3 * HEARTBEAT_S:
                    self._lose(f"its worker could not renew the device's lease for {silent:.0f} s (the store "
                               f"is unreachable); the lease runs out after {LEASE_S:g} s")
                continue
            if ours is False:
                self._lose("the job is no longer this worker's (cancelled, or given to another worker)")
            elif not held:
                self._lose("its worker lost the device's lease (taken by another holder, or the device quarantined)")
            else:
                self._renewed = time.monotonic()

    def _lose(self, reason: str) -> None:
        if self.lost is not None or self.on_lost is None:
            return
        self.lost = reason
        log.warning("%s: stopping the work on the device: %s", self._thread.name, reason)
        threading.Thread(target=self._call_on_lost, args=(reason,), name=f"{self._thread.name}-stop",
                         daemon=True).start()

    def _call_on_lost(self, reason: str) -> None:
        try:
            self.on_lost(reason)
        except Exception:  # noqa: BLE001  (the device may be unreachable too; the job's time limit still ends it)
            log.exception("%s: could not stop the work on the device", self._thread.name)

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


# ---- running a job ------------------------------------------------------------------------


def _stale(waiting: bool, dispatch_seq: int | None, seq: int | None) -> str | None:
    """Why a message for a job or deployment is not this execution's to run: "skipped" (it no
    longer waits: another execution has it, or it is finished), "superseded" (a newer message
    owns it, `seq` being this message's); None when it is."""
    if not waiting:
        return "skipped"
    if seq is not None and dispatch_seq != seq:
        return "superseded"
    return None


def run_attempt(app: Celery, job_id: int, seq: int | None = None, *, worker: str | None = None) -> str:
    """Run job `job_id` on its device once, for the message carrying dispatch sequence `seq`
    (None: any). Returns the job's state as this execution left it, "skipped" (another
    execution has it, or it is finished), "superseded" (a newer message owns it), or "waiting":
    its device is busy, and the job waits in the store, with no message, until whoever holds
    the device hands it over (release), or the reconciler sees the device free; the
    reconciler also ends a job that waited `max_queue_wait_s`."""
    settings, sends = settings_of(app), Sends()
    holder = _lease_holder(f"job{job_id}")

    # 1. Take the device and the job in one short transaction: both or neither.
    try:
        with session_for(app) as session, session.begin():
            job = store.get_job(session, job_id)
            if stale := _stale(job.state == JobState.queued, job.dispatch_seq, seq):
                return stale
            device = job.device
            if prior_pending(session, job):
                return "waiting"  # its prior job sends it again when it succeeds
            if device.state == DeviceState.quarantined:
                end_job(session, sends, job, f"device {device.serial} is quarantined "
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
                if problem is None:
                    try:
                        spec = store.job_spec(job, attempt)  # as submitted, named for this attempt
                    except ProtocolError as exc:  # a row stored before specs were checked at submission
                        problem = f"the job's stored spec cannot be run: {exc}"
                if problem is not None:  # a tuned profile that does not exist, a bad spec: its own fault
                    store.transition_job(session, job_id, JobState.failed, error=problem, attempt=attempt)
                    hand_over(session, settings, sends, device_id, holder)
                    after_job(session, sends, job_id, JobState.failed)
                    if batch_id is not None:
                        sends.batches.add(batch_id)
                    outcome = str(JobState.failed)
                else:
                    outcome = None
    except store.InvalidTransition:
        return "skipped"
    if outcome is not None:
        sends.send(app)
        return outcome

    # 2. Talk to the device with no transaction open; heartbeats keep job and lease alive.
    state, error, result, device_state, own_earlier = None, None, None, None, False
    beat = None
    try:
        transport = make_transport(device, settings)
        out_dir = run_folder(settings.data_dir, job_id, attempt)  # where retention finds its logs
        beat = _Heartbeat(app, lambda s: store.heartbeat_job(s, job_id, attempt), device_id, holder,
                          f"job{job_id}", timed, on_lost=lambda reason: _stop_on_device(device, settings, spec, reason))
        with beat, transport:
            result = transport.run(spec, out_dir, progress=_JobProgress(app, job_id, attempt))
    except TransportError as exc:
        state, error = JobState.infra_failed, str(exc)
        device_state = store.TRANSPORT_STATES.get(exc.state)
        # The device still runs an earlier attempt of this very job (its worker was cut off from
        # the store and the reconciler sent the job again): wait for it, as for a lost worker,
        # rather than spend this job's attempts on finding its own work in the way.
        own_earlier = isinstance(exc, DeviceBusy) and f"job{job_id}-a" in str(exc)
    except Exception as exc:  # a bad spec, a bad stored address or a bug here: recorded, not retried
        state, error = JobState.failed, f"{type(exc).__name__}: {exc}"
        log.exception("job %s failed in the worker", job_id)
    if beat is not None and beat.lost is not None:
        # Stopped on its device because it stopped being this worker's: whatever the run ended
        # with is not the job's outcome. Recorded only if the attempt is still ours (the store
        # was out of reach), as a lost worker's: the job runs again, its attempts not charged.
        state, error, result, own_earlier = JobState.infra_failed, f"stopped on the device: {beat.lost}", None, True

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
                store.transition_job(session, job_id, state, error=error, attempt=attempt, worker_lost=own_earlier)
                if device_state is not None and device_state != "busy":
                    store.set_device_state(session, device_id, device_state, error or "")
                if state == JobState.infra_failed:
                    if retry_or_end(session, settings, sends, job_id, worker_lost=own_earlier):
                        state = "requeued"
                    else:  # it ended so: the third in a row quarantines the device (docs/devices.md)
                        store.count_job_outcome(session, device_id, state, error)
                elif batch_id is not None:
                    sends.batches.add(batch_id)
            after_job(session, sends, job_id, state)
            hand_over(session, settings, sends, device_id, holder)
        released = True
    except store.InvalidTransition:
        # The reconciler took the job from us (no heartbeat landed): its next run counts.
        log.warning("job %s was taken away while running; attempt %s is not recorded", job_id, attempt)
        return "dropped"
    except Exception as exc:  # noqa: BLE001  (the store could not save the result: NaN, NUL, a database error)
        # Left running, the job would be "worker lost" to the reconciler and run again, up to
        # MAX_WORKER_LOSSES times, recording nothing each time: it ends here, once, failed.
        log.exception("job %s: the store could not record attempt %s", job_id, attempt)
        sends = Sends()
        state, released = _end_unrecorded(sends, app, job_id, attempt, device_id, holder, batch_id, exc), True
    finally:
        if not released:
            release(app, device_id, holder)
    sends.send(app)
    return str(state)


def _stop_on_device(device, settings: Settings, spec: JobSpec, reason: str) -> None:
    """Stop a job on its device, over a transport of its own (the job's is busy running it)."""
    with make_transport(device, settings) as transport:
        stopped = transport.stop_job(spec.job_id, reason)
    log.warning("job %s on %s: %s", spec.job_id, getattr(device, "serial", device),
                "stopped" if stopped else "was no longer running")


def _end_unrecorded(sends: Sends, app: Celery, job_id: int, attempt: int, device_id: int, holder: str,
                    batch_id: int | None, exc: Exception) -> JobState:
    """End an attempt whose outcome the store refused as failed, with why, and give the device
    back, in one transaction (when even that fails, the caller's finally gives the device back
    and the reconciler settles the job)."""
    error = str(exc) if isinstance(exc, store.StoreError) else \
        f"the store could not record the result ({type(exc).__name__}: {str(exc).splitlines()[0][:500]})"
    settings = settings_of(app)
    with session_for(app) as session, session.begin():
        store.transition_job(session, job_id, JobState.failed, error=error, attempt=attempt)
        store.count_job_outcome(session, device_id, JobState.failed)
        if batch_id is not None:
            sends.batches.add(batch_id)
        after_job(session, sends, job_id, JobState.failed)
        hand_over(session, settings, sends, device_id, holder)
    return JobState.failed


# ---- deploying ----------------------------------------------------------------------------


def deploy(app: Celery, deployment_id: int, seq: int | None = None, *, retries: int = 0) -> int | str | Wait:
    """Send a pending deployment's bundle (<data_dir>/builds/<name>) to its device; the
    transport sends only missing files, so running it again is cheap. Then the jobs waiting for
    it are sent when it succeeded, or end as infra_failed with its error when it failed.
    Returns the deployment id, "skipped"/"superseded" like run_attempt, or Wait."""
    settings, sends = settings_of(app), Sends()
    holder = _lease_holder(f"deploy{deployment_id}")
    with session_for(app) as session, session.begin():
        deployment = store.get_deployment(session, deployment_id)
        if stale := _stale(deployment.status == DeploymentStatus.pending, deployment.dispatch_seq, seq):
            return stale
        device = store.get_device(session, deployment.device_id)
        build = session.get(Build, deployment.build_id)
        if build is None:
            raise store.StoreError(f"no build {deployment.build_id}")
        if not store.acquire_device_lease(session, device.id, holder, LEASE_S):
            countdown = _lease_countdown(retries)
            store.redispatch_deployment(session, deployment_id, grace(settings, countdown), new_message=False)
            return Wait(countdown)
        attempt = store.start_deployment(session, deployment_id, seq)
        if attempt is None:
            store.release_device_lease(session, device.id, holder)
            return "skipped"
        device_id, build_name, allow_downgrade = device.id, build.name, deployment.allow_downgrade
    released = False
    try:
        status, report, error, device_state = DeploymentStatus.failed, None, None, None
        try:
            beat = _Heartbeat(app, lambda s: store.heartbeat_deployment(s, deployment_id), device_id, holder,
                              f"deploy{deployment_id}")
            with beat, make_transport(device, settings) as transport:
                report = transport.send_bundle(settings.data_dir / "builds" / build_name,
                                               progress=_DeployProgress(app, deployment_id),
                                               allow_downgrade=allow_downgrade)
            status = DeploymentStatus.succeeded
        except TransportError as exc:
            error = str(exc)
            device_state = store.TRANSPORT_STATES.get(exc.state)
        except (OSError, ValueError) as exc:  # ValueError: a stored address that cannot be used
            error = f"{type(exc).__name__}: {exc}"
        with session_for(app) as session, session.begin():
            counts = ({"bytes_sent": report.bytes_sent, "files_sent": report.files_sent,
                       "files_skipped": report.files_skipped, "duration_s": report.seconds,
                       "note": (f"installed beside the device's current build {report.kept_current}, which is "
                                "newer and stays current (farm deploy --allow-downgrade makes this one current)"
                                if report.kept_current else None)} if report else {})
            if not store.finish_deployment(session, deployment_id, attempt, status, error=error, **counts):
                log.warning("deployment %s was taken away while running; attempt %s is not recorded",
                            deployment_id, attempt)
                return "dropped"
            if status == DeploymentStatus.failed and device_state is not None and device_state != "busy":
                store.set_device_state(session, device_id, device_state, error or "")
            after_deployment(session, settings, sends, deployment_id, status, error)
            hand_over(session, settings, sends, device_id, holder)
        released = True
    finally:
        if not released:
            release(app, device_id, holder)
    sends.send(app)
    return deployment_id
