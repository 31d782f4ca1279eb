"""Results: a job's JobResult recorded once per attempt (runs, raw samples, kernel timings,
thermal readings, images) with the environment it ran in.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from agent.protocol import BadValue, JobResult, check_plain, to_dict

from . import environment as run_env
from .jobs import get_job
from .models import (
    Device,
    Image,
    Job,
    JobKind,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    ThermalReading,
    utcnow,
)
from .rows import StoreError, bulk_insert, insert_or_get

__all__ = ["images_of_batches", "record_result", "result_environment", "runs_of_batches"]


def record_result(session: Session, job_id: int, result: JobResult, attempt: int | None = None,
                  artifacts_dir: Path | None = None) -> Run:
    """Store what one attempt of a job brought back: a Run with its raw samples, kernel
    timings, thermal readings and images (an image's path is where the transport fetched it:
    `artifacts_dir` / its path in the result). Idempotent per (job, attempt): recording the same
    attempt again (a redelivered task) returns the stored run and writes nothing. The job's
    state is left to transition_job, in the same transaction. The run keeps the environment
    the agent read (result.environment), or, from an agent that sent none, what the device's
    record says now, marked source "device-record". The device's last_seen is stamped: it
    answered."""
    try:  # what no backend keeps the same way (SQLite stores NaN as NULL, PostgreSQL refuses NUL)
        check_plain(to_dict(result), "result")
    except BadValue as exc:
        raise StoreError(f"the device's result cannot be stored: {exc}") from None
    job = get_job(session, job_id)
    attempt = job.attempts if attempt is None else attempt
    query = select(Run).where(Run.job_id == job_id, Run.attempt == attempt)
    existing = session.scalar(query)
    if existing is not None:
        return existing
    spec = job.spec or {}
    environment = result_environment(job.device, result)
    run = Run(
        job_id=job_id,
        attempt=attempt,
        device_id=job.device_id,
        build_id=job.build_id,
        status=RunStatus(result.status),
        error=result.error,
        started_at=_from_unix(result.started_at),
        finished_at=_from_unix(result.finished_at),
        adapter=result.device,
        engine=result.engine,
        cooldown_wait_s=result.cooldown_wait_s,
        cooldown_timed_out=result.cooldown_timed_out,
        artifacts=[to_dict(a) for a in result.artifacts],
        log_tail=result.log_tail,
        environment=environment,
        env_key=run_env.environment_key(environment),
    )
    stored = insert_or_get(session, run, query)
    if stored is not run:  # another process stored this attempt first
        return stored
    bulk_insert(session, Sample, ({"run_id": run.id, "metric": s.metric, "unit": s.unit, "value": s.value,
                            "repetition": s.repetition} for s in result.samples))
    bulk_insert(session, KernelTiming, ({"run_id": run.id, "kernel": k.kernel, "calls": k.calls,
                                  "total_ms": k.total_ms, "repetition": k.repetition}
                                 for k in result.kernel_timings))
    bulk_insert(session, ThermalReading, ({"run_id": run.id, "phase": t.phase, "zone": t.zone,
                                    "celsius": t.celsius} for t in result.thermal))
    bulk_insert(session, Image, ({"run_id": run.id, "path": str(artifacts_dir / a.path) if artifacts_dir else a.path, "sha256": a.sha256, "size": a.size,
                           "prompt": spec.get("prompt", ""), "seed": spec.get("seed")}
                          for a in result.artifacts if a.kind == "image"))
    if result.log_tail:
        job.log_tail = result.log_tail
    # The device answered with this result: it was seen now, at the end of its run (the health
    # check's probes stamp it too, but a device busy with jobs is not probed).
    job.device.last_seen = utcnow()
    session.flush()
    session.expire(run, ["samples", "kernel_timings", "thermal", "images"])
    return run


def runs_of_batches(session: Session, batch_ids: list[int], kind: JobKind, serial: str) -> list[tuple[Run, Job]]:
    """The succeeded runs of the `kind` jobs of the batches `batch_ids` on the device `serial`,
    each with its job, in the order they were recorded."""
    return [(run, job) for run, job in session.execute(
        select(Run, Job).join(Job, Job.id == Run.job_id).join(Device, Device.id == Job.device_id)
        .where(Job.batch_id.in_(batch_ids), Device.serial == serial, Job.kind == kind,
               Run.status == RunStatus.succeeded).order_by(Run.id))]


def images_of_batches(session: Session, batch_ids: list[int], kind: JobKind) -> list[tuple[str, Job, str]]:
    """The images of the succeeded runs of the `kind` jobs of the batches `batch_ids`: each
    image's path, its job and its device's serial."""
    return [(path, job, serial) for path, job, serial in session.execute(
        select(Image.path, Job, Device.serial).join(Run, Run.id == Image.run_id)
        .join(Job, Job.id == Run.job_id).join(Device, Device.id == Job.device_id)
        .where(Job.batch_id.in_(batch_ids), Job.kind == kind, Run.status == RunStatus.succeeded))]


def result_environment(device: Device, result: JobResult | None = None) -> dict[str, Any]:
    """The environment of a run on `device`: the one `result` carries, else the device's record
    (marked source "device-record"), with the profile name the result's engine reports."""
    if result is not None and result.environment is not None:
        return to_dict(result.environment)
    profile = str((result.engine or {}).get("profile") or "") if result is not None else ""
    return run_env.from_device_record(os=device.os, os_version=device.os_version, driver=device.gpu_driver,
                                      info=device.info, profile=profile)


def _from_unix(seconds: float) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(seconds, dt.UTC) if seconds else None
