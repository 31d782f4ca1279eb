"""What a batch of jobs measured, per device and job: the medians a person reads first (UNet
step, end to end, peak GPU memory), cool-down waits, and the image. Pure reads of the store;
`batch_summary` is what the batch's analysis stores and what `farm demo` prints."""

from __future__ import annotations

import statistics
from typing import Any

from orchestrator import store
from orchestrator.store import Session, queries
from orchestrator.store.models import Job

HEADLINE_METRICS = ("unet_step_ms", "e2e_ms", "peak_gpu_bytes")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def job_row(session: Session, job: Job) -> dict[str, Any]:
    """One job's headline numbers, from its last run (the attempt that counts)."""
    device = store.get_device(session, job.device_id)
    build = store.get_build(session, job.build_id) if job.build_id is not None else None
    run = queries.newest_run(session, job.id)
    row: dict[str, Any] = {
        "job": job.id, "kind": str(job.kind), "state": str(job.state), "attempts": job.attempts,
        "device": device.serial, "gpu": device.gpu_device or device.gpu_driver,
        "build": build.name if build is not None else None, "error": job.error,
        "run": None, "cooldown_wait_s": None, "cooldown_timed_out": None, "image": None,
    } | {metric: None for metric in HEADLINE_METRICS}
    if run is None:
        return row
    row.update(run=run.id, cooldown_wait_s=run.cooldown_wait_s, cooldown_timed_out=run.cooldown_timed_out)
    values: dict[str, list[float]] = {}
    for metric, value in queries.run_samples(session, run.id, HEADLINE_METRICS):
        values.setdefault(metric, []).append(value)
    for metric in HEADLINE_METRICS:
        if metric == "peak_gpu_bytes":
            row[metric] = max(values[metric]) if metric in values else None
        else:
            row[metric] = _median(values.get(metric, []))
    images = queries.images(session, run.id)
    if images:
        row["image"] = images[0].path
    return row


def batch_summary(session: Session, batch_id: int) -> dict[str, Any]:
    batch = store.get_batch(session, batch_id)
    jobs = store.jobs_of_batches(session, [batch_id])
    rows = [job_row(session, job) for job in jobs]
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    return {
        "batch": batch.id, "name": batch.name,
        "build": batch.build.name if batch.build is not None else None,
        "created_at": batch.created_at.isoformat(),
        "finished_at": batch.finished_at.isoformat() if batch.finished_at else None,
        "jobs": rows, "states": states,
    }
