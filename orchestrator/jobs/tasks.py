"""The farm's Celery tasks: thin wrappers that take ids and call the job path (the worker,
orchestrator/jobs/worker.py; the reconciler; the schedules of the job service; a batch's analysis),
whose promise about delivery orchestrator/jobs/dispatch.py states, or the device health check
(orchestrator/jobs/health.py). Every task is safe to run twice (delivery is at least once):
run_job and deploy carry the dispatch sequence number of the message that sent them; a job
whose device is busy waits in the store (no message) until the device is handed to it, and a
deployment's wait is a Celery retry with the countdown the job path chose; a probe re-reads
whether its device still needs one. No task waits on another task's result."""

from __future__ import annotations

import logging

from celery import shared_task

from orchestrator.jobs import (
    batch_analysis,
    health,
    jobservice,
    notify,
    reconciler,
    retention,
    worker,
)

log = logging.getLogger(__name__)


@shared_task(bind=True, name="orchestrator.tasks.run_job")
def run_job(self, job_id: int, seq: int | None = None) -> str:
    """Run job `job_id` once (orchestrator.jobs.worker.run_attempt). A busy device is not polled: the
    job waits in the store and whoever frees the device sends it again."""
    outcome = worker.run_attempt(self.app, job_id, seq, worker=self.request.hostname)
    log.info("job %s, message %s: %s", job_id, seq, outcome)  # which job a message was for, in the worker log
    return outcome


@shared_task(bind=True, name="orchestrator.tasks.deploy", max_retries=None)
def deploy(self, deployment_id: int, seq: int | None = None) -> int | str:
    """Send a pending deployment's build to its device, then its jobs (orchestrator.jobs.worker.deploy)."""
    outcome = worker.deploy(self.app, deployment_id, seq, retries=self.request.retries)
    if isinstance(outcome, worker.Wait):
        raise self.retry(countdown=outcome.countdown)
    return outcome


@shared_task(bind=True, name="orchestrator.tasks.reconcile")
def reconcile(self) -> dict[str, list[int]]:
    """Beat's sweep: whatever lost its owner is sent again or ended (orchestrator.jobs.reconciler.reconcile)."""
    return reconciler.reconcile(self.app)


@shared_task(bind=True, name="orchestrator.tasks.check_schedules")
def check_schedules(self) -> list[int]:
    """Beat's tick: fire the database's due schedules, each firing once."""
    return jobservice.fire_due_schedules(self.app)


@shared_task(bind=True, name="orchestrator.tasks.health_check")
def health_check(self) -> dict[str, list[int]]:
    """Beat's health check: free busy devices nothing holds, and send a probe of each offline or
    unauthorized device that is due to its host's queue (orchestrator.jobs.health.check)."""
    return health.check(self.app)


@shared_task(bind=True, name="orchestrator.tasks.probe_device")
def probe_device(self, device_id: int) -> str:
    """Probe one device for the health check and record the answer (orchestrator.jobs.health.probe_device)."""
    return health.probe_device(self.app, device_id)


@shared_task(bind=True, name="orchestrator.tasks.analyze_batch")
def analyze_batch(self, batch_id: int) -> dict:
    """A finished batch's analysis, and its more-repetition rounds (orchestrator.jobs.batch_analysis.analyze)."""
    return batch_analysis.analyze(self.app, batch_id)


@shared_task(bind=True, name="orchestrator.tasks.send_notification", max_retries=None)
def send_notification(self, delivery_id: int) -> str:
    """One attempt at a notification delivery (orchestrator.jobs.notify.deliver); a refused one is
    retried with the back-off it chose, a settled or held one is left alone."""
    outcome, countdown = notify.deliver(self.app, delivery_id)
    if outcome == "retry":
        raise self.retry(countdown=countdown)
    return outcome


@shared_task(bind=True, name="orchestrator.tasks.send_due_notifications")
def send_due_notifications(self) -> list[int]:
    """Beat's resend of due notification deliveries whose message was lost (orchestrator.jobs.notify.sweep)."""
    return notify.sweep(self.app)


@shared_task(bind=True, name="orchestrator.tasks.apply_retention")
def apply_retention(self) -> dict:
    """Beat's daily retention pass: old runs downsampled, old images and logs deleted
    (orchestrator.jobs.retention.apply)."""
    return retention.apply(self.app)


@shared_task(name="orchestrator.tasks.ping")
def ping(payload: float | None = None) -> float | None:
    """Echo `payload`: a liveness probe of the broker and workers (and what the task throughput
    benchmark sends)."""
    return payload
