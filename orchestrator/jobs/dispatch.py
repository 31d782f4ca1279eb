"""Dispatch: how work moves through the store and reaches the workers, what the farm promises
about delivery (docs/reliability.md), and the hand-offs every part of the job path shares:
sending after the commit, giving a device back, ending, retrying and following up jobs. The
submission service (orchestrator/jobs/jobservice.py), the worker (orchestrator/jobs/worker.py) and the
reconciler (orchestrator/jobs/reconciler.py) all move work through these functions.

The promise: the store is the truth and the broker only carries hints.

- Every job or deployment that waits on a message has an owner and a deadline. A queued job
  is owned by the deployment it waits for, else by its message, which must start it by
  `due_at`. A job whose device is busy is owned by whoever holds the device: it waits in the
  store with no message (its deadline already past), and the holder, giving the device back,
  sends the job that was submitted first (release); nothing polls a busy device. A running
  job or deployment is owned by its worker, which says it is alive every HEARTBEAT_S
  (orchestrator/jobs/worker.py).
- Work is written first and sent after the commit (Sends). A send that never happened (a
  crash in between, a broker that was down) is no different from a lost message: the
  reconciler, which beat runs every `reconcile_every_s`, sends again whatever is past its
  deadline, with a new dispatch sequence number; a message carrying an older number is
  dropped when it arrives, so one job never has two live chains of retries.
- A job runs only after the one execution that wins queued -> running; its result is recorded
  in the same transaction as its final state, conditional on the attempt it ran as, so a job
  is recorded at most once whatever is redelivered or resent (delivery is at least once).
- Nothing waits for ever: a job that waited `max_queue_wait_s` for its device, whose device
  is quarantined, or whose deployment failed ends as infra_failed with the reason in `error`;
  infrastructure failures are retried up to MAX_ATTEMPTS, then end the same way. A job whose
  worker died is not charged for it: it is sent again, after a delay that doubles each time,
  up to MAX_WORKER_LOSSES times (a job that kills every worker it runs on still ends).

The functions that take a session only flush; transactions stay short and are never held
across a device call (orchestrator/store/session.py says why)."""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import DEFAULT_QUEUE, host_queue, session_for, settings_of
from orchestrator.store import Session
from orchestrator.store.models import DeploymentStatus, Device, Job, JobState, utcnow

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3  # executions of one job that its device failed (infrastructure failures included)
# Executions of one job (or deployment) lost because their worker died: that is the host's
# fault, seldom the job's, so it has a budget of its own, spent with a doubling delay
# (2, 4, 8, ... 60 s): a host killed every few seconds does not fail the jobs it was running.
MAX_WORKER_LOSSES = 8
WORKER_LOSS_DELAY_MAX_S = 60.0
REQUEUE_DELAY_S = 2.0  # an infrastructure failure is tried again after this

RUN_JOB = "orchestrator.tasks.run_job"
DEPLOY = "orchestrator.tasks.deploy"
ANALYZE_BATCH = "orchestrator.tasks.analyze_batch"


def grace(settings: Settings, extra_s: float = 0.0) -> dt.datetime:
    """The deadline of a message sent now that may start its work after `extra_s`."""
    return utcnow() + dt.timedelta(seconds=extra_s + settings.message_grace_s)


def _queue_of(device: Device, settings: Settings) -> str:
    # A phone is driven by the worker of the host it is plugged into.
    return host_queue(device.host.name if device.host is not None else settings.host_name)


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
            publish(app, DEPLOY, (deployment_id, seq), queue, strict=strict)
        for job_id, seq, queue, countdown in self.jobs:
            publish(app, RUN_JOB, (job_id, seq), queue, countdown, strict=strict)
        for batch_id in sorted(self.batches):
            settle_batch(app, batch_id)


def publish(app: Celery, task: str, args: tuple, queue: str, countdown: float | None = None, *,
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


def settle_batch(app: Celery, batch_id: int | None) -> None:
    """When the job that just settled (ran, could not deploy, was given up or cancelled) was
    its batch's last open one, send the batch's analysis (once: finish_batch_if_done is a
    conditional UPDATE; the reconciler resends it if that message is lost)."""
    if batch_id is None:
        return
    with session_for(app) as session, session.begin():
        done = store.finish_batch_if_done(session, batch_id)
    if done:
        publish(app, ANALYZE_BATCH, (batch_id,), DEFAULT_QUEUE)


def end_job(session: Session, sends: Sends, job: Job, error: str, attempt: int | None = None, *,
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


def retry_or_end(session: Session, settings: Settings, sends: Sends, job_id: int, *,
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
    seq = store.redispatch_job(session, job_id, grace(settings, delay), new_message=True)
    sends.job(session, settings, job_id, seq, delay)
    return True


# ---- handing on: a device given back, jobs that waited for a deployment or a prior job ------


def release(app: Celery, device_id: int, holder: str) -> None:
    """Give the device back and hand it to the first submitted job waiting for it (a job that
    found the device busy waits in the store with no message: this is its message), and, where
    the device shares its GPU, the first waiting job of each device of its adapter group that
    can start now. Were this lost, the reconciler sends the same jobs on its next pass."""
    settings, sends = settings_of(app), Sends()
    try:
        with session_for(app) as session, session.begin():
            hand_over(session, settings, sends, device_id, holder)
    except Exception:  # noqa: BLE001  (the lease expires by itself; the reconciler hands the device on)
        log.exception("could not give device %s back", device_id)
        return
    sends.send(app)


def hand_over(session: Session, settings: Settings, sends: Sends, device_id: int, holder: str) -> None:
    """release's work inside the caller's transaction: the outcome it records and the device
    given back commit together, so whoever sees the outcome sees the device free. The work that
    waits for this device or its GPU is sent at once: the first due job of each device of the
    adapter group, and the group's pending deployments (a deployment that found the device busy
    otherwise sleeps out its retry back-off, up to LEASE_RETRY_S[1], while the GPU idles: in one
    demo run, a batch's more-repetitions rounds on three devices kept the GPU idle 22 s of 59)."""
    store.release_device_lease(session, device_id, holder)
    group = store.adapter_group_of(session, device_id)
    for deployment in store.pending_deployments(session, group):
        sends.deployment(session, settings, deployment.id,
                         store.redispatch_deployment(session, deployment.id, grace(settings), new_message=True))
    for job in store.find_due_queued_jobs(session, utcnow(), device_id=group):
        sends.job(session, settings, job.id, store.redispatch_job(session, job.id, grace(settings),
                                                                  new_message=True))


def after_deployment(session: Session, settings: Settings, sends: Sends, deployment_id: int,
                     status: DeploymentStatus, error: str | None) -> None:
    """The jobs that waited for a deployment: sent when it succeeded, ended when it failed."""
    build = store.get_build(session, store.get_deployment(session, deployment_id).build_id)
    for job in store.jobs_of_deployment(session, deployment_id):
        if status == DeploymentStatus.succeeded and prior_pending(session, job):
            continue  # its prior job sends it when it succeeds (after_job)
        if status == DeploymentStatus.succeeded:
            sends.job(session, settings, job.id, store.redispatch_job(session, job.id, grace(settings),
                                                                      new_message=True))
        else:
            end_job(session, sends, job, f"deployment of {build.name} to {job.device.serial} "
                                         f"failed: {error}")


def prior_pending(session: Session, job: Job) -> bool:
    """`job` runs after another job that has not ended yet."""
    if job.after_job_id is None:
        return False
    prior = store.find_job(session, job.after_job_id)
    return prior is not None and prior.state in (JobState.queued, JobState.running)


def after_job(session: Session, sends: Sends, job_id: int, state: JobState | str) -> None:
    """A job that ended without succeeding ends the jobs that were to run after it (a job that
    succeeded hands its device, and so them, on in hand_over)."""
    if state not in (JobState.failed, JobState.infra_failed, JobState.cancelled):
        return
    for job in store.jobs_after_job(session, job_id):
        end_job(session, sends, job, f"job {job_id}, which it runs after, ended {state}; it did not run")
