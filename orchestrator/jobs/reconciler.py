"""The reconciler: beat's sweep, every `reconcile_every_s`, of whatever lost its owner (a dead
worker, a lost or never-sent message, a deployment that failed under its jobs, a job that
waited too long, a finished batch whose analysis never came). What it finds is sent again or
ended in one transaction and sent after it: the other half of the promise that
orchestrator/jobs/dispatch.py keeps (delivery at least once, recording exactly once)."""

from __future__ import annotations

import datetime as dt
import logging

from celery import Celery

from orchestrator import store
from orchestrator.jobs.celery_app import DEFAULT_QUEUE, session_for, settings_of
from orchestrator.jobs.dispatch import (
    ANALYZE_BATCH,
    MAX_WORKER_LOSSES,
    Sends,
    after_deployment,
    end_job,
    grace,
    publish,
    retry_or_end,
)
from orchestrator.store.models import DeploymentStatus, utcnow

log = logging.getLogger(__name__)

ANALYSIS_GRACE_FACTOR = 5  # a finished batch's analysis is sent again after this many message graces


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
            # Not settled here: retry_or_end queues it again, or settles its batch when it gives up.
            losses = job.worker_losses + 1
            if not end_job(session, sends, job, f"worker {job.worker or '?'} lost: no heartbeat for "
                                                f"{settings.stale_after_s:g} s (worker lost {losses} of at most "
                                                f"{MAX_WORKER_LOSSES} times while running this job)",
                           attempt=job.attempts, settle=False, worker_lost=True):
                continue
            device = store.get_device(session, job.device_id)
            if device.lease_holder and device.lease_holder.startswith(f"job{job.id}:"):
                store.release_device_lease(session, device.id, device.lease_holder)
            if retry_or_end(session, settings, sends, job.id, worker_lost=True):
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
                    if not store.requeue_deployment(session, deployment.id, deployment.attempts, grace(settings), error):
                        continue
                else:
                    if store.finish_deployment(session, deployment.id, deployment.attempts, DeploymentStatus.failed,
                                               error=f"{error}, {deployment.attempts} attempts"):
                        after_deployment(session, settings, sends, deployment.id, DeploymentStatus.failed, error)
                        report["deployments_failed"].append(deployment.id)
                    continue
            seq = store.redispatch_deployment(session, deployment.id, grace(settings), new_message=True)
            if seq is not None:
                sends.deployment(session, settings, deployment.id, seq)
                report["deployments_resent"].append(deployment.id)

        for job in store.find_jobs_after_failed_jobs(session):
            if end_job(session, sends, job, f"job {job.after_job_id}, which it runs after, did not succeed; "
                                            "it did not run"):
                report["jobs_ended"].append(job.id)
        for job in store.find_jobs_of_failed_deployments(session):
            if end_job(session, sends, job, f"deployment {job.deployment_id} to {job.device.serial} failed: "
                                            f"{job.deployment.error}"):
                report["jobs_ended"].append(job.id)
        too_long = now - dt.timedelta(seconds=settings.max_queue_wait_s)
        for job in store.find_jobs_waiting_too_long(session, too_long):
            device = job.device
            waited = (now - (job.queued_at or job.created_at)).total_seconds()
            if end_job(session, sends, job, f"gave up after waiting {waited / 3600:.1f} h to start on {device.serial}"
                                            f" (held by: {device.lease_holder or 'no one'}); max_queue_wait_s "
                                            "bounds the wait"):
                report["jobs_ended"].append(job.id)
        for job in store.find_due_queued_jobs(session, now):
            seq = store.redispatch_job(session, job.id, grace(settings), new_message=True)
            sends.job(session, settings, job.id, seq)
            if seq is not None:
                report["jobs_resent"].append(job.id)

        analysis_due = now - dt.timedelta(seconds=ANALYSIS_GRACE_FACTOR * settings.message_grace_s)
        report["batches_analysed"] = store.batches_awaiting_analysis(session, analysis_due, limit=100)
    sends.send(app)
    for batch_id in report["batches_analysed"]:
        publish(app, ANALYZE_BATCH, (batch_id,), DEFAULT_QUEUE)
    if any(report.values()):
        log.warning("reconciled: %s", {k: v for k, v in report.items() if v})
    return report
