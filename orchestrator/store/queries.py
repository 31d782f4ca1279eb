"""Read queries behind `farm jobs` and `farm results`, and the ones dashboards and regression
analysis share: job and run listings with filters, one run's metrics and kernel times, the
samples of one metric on one device along builds, a device's health (runs by status, its newest
runs and state changes), and raw samples streamed in chunks for export. Reads only: cancelling a job is the job service's (orchestrator/jobs/jobservice.py).

Medians are computed in Python from the raw samples of the runs asked for: SQLite has no
median aggregate, and a listing is one page of runs, so the samples involved are few (counts,
minima and maxima stay in SQL). An export never holds one long transaction: on SQLite every
transaction takes the write lock (orchestrator/store/session.py), so a minute-long read would
stall the workers recording results; it reads a few hundred runs per short transaction."""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import Row, Select, exists, func, select
from sqlalchemy.orm import Session, selectinload

from .models import (
    Alert,
    AlertKind,
    AlertState,
    Build,
    Deployment,
    DeploymentStatus,
    Device,
    DeviceStateChange,
    Image,
    Job,
    JobKind,
    JobState,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    ThermalReading,
)
from .rows import StoreError, where_given

# The metrics a listing shows for every run, when the run has them: one timed UNet CFG step
# (latency jobs), one whole generation, the peak GPU memory, and a tuning's duration.
KEY_METRICS = ("unet_step_ms", "e2e_ms", "peak_gpu_bytes", "tune_ms")

EXPORT_COLUMNS = ("run_id", "job_id", "device", "build", "kind", "run_finished_at", "metric", "unit",
                  "value", "repetition")


# ---- lookups ------------------------------------------------------------------------------


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise StoreError(f"no run {run_id}; `farm results list` shows the known ones")
    return run


# ---- the fleet and its builds -----------------------------------------------------------


def list_devices(session: Session) -> list[Device]:
    """Every device by serial, with its host loaded."""
    return list(session.scalars(select(Device).options(selectinload(Device.host)).order_by(Device.serial)))


def list_builds(session: Session) -> list[Build]:
    """Every build, newest first, with its files loaded."""
    return list(session.scalars(select(Build).options(selectinload(Build.files))
                                .order_by(Build.created.desc(), Build.id.desc())))


def deployed_at(session: Session, device_id: int, build_ids: Sequence[int]) -> list[tuple[int, dt.datetime | None]]:
    """(build id, when its newest succeeded deployment to the device finished) for each of
    `build_ids` deployed there."""
    return [tuple(r) for r in session.execute(
        select(Deployment.build_id, func.max(Deployment.finished_at))
        .where(Deployment.device_id == device_id, Deployment.build_id.in_(list(build_ids)),
               Deployment.status == DeploymentStatus.succeeded).group_by(Deployment.build_id))]


# ---- a device's health --------------------------------------------------------------------


def run_counts(session: Session, device_id: int) -> dict[RunStatus, int]:
    """How many of the device's runs are in each status (those with any)."""
    return dict(session.execute(select(Run.status, func.count(Run.id)).where(Run.device_id == device_id)
                                .group_by(Run.status)).all())


def recent_runs(session: Session, device_id: int, limit: int) -> list[Row]:
    """The device's newest `limit` runs, newest first: (id, status, error, started_at,
    finished_at, kind: its job's, name: its build's, None without one)."""
    return list(session.execute(
        select(Run.id, Run.status, Run.error, Run.started_at, Run.finished_at, Job.kind, Build.name)
        .join(Job, Job.id == Run.job_id).outerjoin(Build, Build.id == Run.build_id)
        .where(Run.device_id == device_id).order_by(Run.id.desc()).limit(limit)))


def state_changes(session: Session, device_id: int, limit: int) -> list[DeviceStateChange]:
    """The device's newest `limit` state changes, newest first."""
    return list(session.scalars(select(DeviceStateChange).where(DeviceStateChange.device_id == device_id)
                                .order_by(DeviceStateChange.at.desc(), DeviceStateChange.id.desc()).limit(limit)))


# ---- alerts -------------------------------------------------------------------------------


def list_alerts(
    session: Session,
    *,
    states: Iterable[AlertState] = (AlertState.new, AlertState.acknowledged),
    kinds: Iterable[AlertKind] = tuple(AlertKind),
    device_id: int | None = None,
    build_id: int | None = None,
    metric: str | None = None,
    limit: int | None = None,
) -> list[Alert]:
    """Alerts newest first: by default the open ones (new and acknowledged) of every kind."""
    query = (select(Alert).options(selectinload(Alert.device), selectinload(Alert.build),
                                   selectinload(Alert.baseline_build))
             .where(Alert.state.in_(list(states)), Alert.kind.in_(list(kinds))))
    query = where_given(query, (Alert.device_id, device_id), (Alert.build_id, build_id), (Alert.metric, metric))
    query = query.order_by(Alert.created_at.desc(), Alert.id.desc())
    return list(session.scalars(query if limit is None else query.limit(limit)))


# ---- jobs ---------------------------------------------------------------------------------


def list_jobs(
    session: Session,
    *,
    state: JobState | str | None = None,
    device_id: int | None = None,
    build_id: int | None = None,
    batch_id: int | None = None,
    limit: int = 50,
) -> list[Job]:
    """The newest jobs first, with their device and build loaded."""
    query = select(Job).options(selectinload(Job.device), selectinload(Job.build))
    query = where_given(query, (Job.state, None if state is None else JobState(state)), (Job.device_id, device_id),
                        (Job.build_id, build_id), (Job.batch_id, batch_id))
    return list(session.scalars(query.order_by(Job.id.desc()).limit(limit)))


def job_states(session: Session, job_ids: Sequence[int]) -> list[tuple[int, str, JobState, int, str | None, dict | None]]:
    """(id, device serial, state, attempts, error, progress) of each job: what `jobs submit
    --wait` polls."""
    rows = session.execute(
        select(Job.id, Device.serial, Job.state, Job.attempts, Job.error, Job.progress)
        .join(Device, Device.id == Job.device_id)
        .where(Job.id.in_(job_ids))
        .order_by(Job.id)
    )
    return [tuple(r) for r in rows]


# ---- runs and their samples -----------------------------------------------------------------


@dataclass
class RunRow:
    """One run as a listing shows it; `medians` holds the key metrics it has."""

    id: int
    job_id: int
    attempt: int
    device: str
    build: str | None
    kind: str
    status: str
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    medians: dict[str, float]


def _runs_query(
    *, device_id: int | None, build_id: int | None, metric: str | None, kind: JobKind | str | None
) -> Select:
    query = (
        select(Run.id, Run.job_id, Run.attempt, Device.serial, Build.name, Job.kind, Run.status,
               Run.started_at, Run.finished_at)
        .join(Job, Job.id == Run.job_id)
        .join(Device, Device.id == Run.device_id)
        .outerjoin(Build, Build.id == Run.build_id)
    )
    if device_id is not None:
        query = query.where(Run.device_id == device_id)
    if build_id is not None:
        query = query.where(Run.build_id == build_id)
    if kind is not None:
        query = query.where(Job.kind == JobKind(kind))
    if metric is not None:
        query = query.where(exists().where(Sample.run_id == Run.id, Sample.metric == metric))
    return query


def list_runs(
    session: Session,
    *,
    device_id: int | None = None,
    build_id: int | None = None,
    metric: str | None = None,
    kind: JobKind | str | None = None,
    limit: int = 50,
) -> list[RunRow]:
    """The newest runs first; with `metric`, only runs that measured it (and its median is
    among the medians)."""
    query = _runs_query(device_id=device_id, build_id=build_id, metric=metric, kind=kind)
    rows = session.execute(query.order_by(Run.id.desc()).limit(limit)).all()
    wanted = KEY_METRICS + ((metric,) if metric and metric not in KEY_METRICS else ())
    meds = medians(session, [r[0] for r in rows], wanted)
    return [RunRow(id=r[0], job_id=r[1], attempt=r[2], device=r[3], build=r[4], kind=str(r[5]),
                   status=str(r[6]), started_at=r[7], finished_at=r[8], medians=meds.get(r[0], {}))
            for r in rows]


def medians(session: Session, run_ids: Sequence[int], metrics: Iterable[str]) -> dict[int, dict[str, float]]:
    """{run id: {metric: median of its samples}} for the given runs and metrics."""
    if not run_ids:
        return {}
    values: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = session.execute(
        select(Sample.run_id, Sample.metric, Sample.value)
        .where(Sample.run_id.in_(list(run_ids)), Sample.metric.in_(list(metrics)))
    )
    for run_id, metric, value in rows:
        values[run_id][metric].append(value)
    return {run_id: {m: statistics.median(v) for m, v in sorted(per.items())} for run_id, per in values.items()}


def metric_stats(session: Session, run_id: int) -> list[dict]:
    """Every metric of one run: unit, n, median, min, max, in metric order."""
    per: dict[tuple[str, str], list[float]] = defaultdict(list)
    for metric, unit, value in session.execute(
        select(Sample.metric, Sample.unit, Sample.value).where(Sample.run_id == run_id)
    ):
        per[(metric, unit)].append(value)
    return [{"metric": metric, "unit": unit, "n": len(v), "median": statistics.median(v), "min": min(v),
             "max": max(v)} for (metric, unit), v in sorted(per.items())]


def kernel_totals(session: Session, run_id: int) -> list[dict]:
    """One run's kernel timings summed per kernel over its repetitions, slowest first;
    `ms_per_repetition` is what one UNet step spends in that kernel."""
    reps = func.count(func.distinct(KernelTiming.repetition))
    total = func.sum(KernelTiming.total_ms)
    rows = session.execute(
        select(KernelTiming.kernel, func.sum(KernelTiming.calls), total, reps)
        .where(KernelTiming.run_id == run_id)
        .group_by(KernelTiming.kernel)
        .order_by(total.desc(), KernelTiming.kernel)
    )
    return [{"kernel": k, "calls": int(calls), "total_ms": float(ms), "repetitions": int(n),
             "ms_per_repetition": float(ms) / n if n else None} for k, calls, ms, n in rows]


def newest_run(session: Session, job_id: int, *, succeeded: bool = False) -> Run | None:
    """The job's newest attempt (the one that counts), with `succeeded` its newest succeeded
    one; None when it has none."""
    query = select(Run).where(Run.job_id == job_id)
    if succeeded:
        query = query.where(Run.status == RunStatus.succeeded)
    return session.scalar(query.order_by(Run.attempt.desc()).limit(1))


def run_samples(session: Session, run_id: int, metrics: Iterable[str]) -> list[tuple[str, float]]:
    """(metric, value) of each sample of `metrics` one run recorded."""
    return [tuple(r) for r in session.execute(
        select(Sample.metric, Sample.value).where(Sample.run_id == run_id, Sample.metric.in_(list(metrics))))]


def thermal_readings(session: Session, run_id: int) -> list[ThermalReading]:
    return list(session.scalars(select(ThermalReading).where(ThermalReading.run_id == run_id)
                                .order_by(ThermalReading.phase.desc(), ThermalReading.zone)))


def images(session: Session, run_id: int) -> list[Image]:
    return list(session.scalars(select(Image).where(Image.run_id == run_id).order_by(Image.id)))


def metric_series(session: Session, device_id: int, metric: str, limit_builds: int | None = None) -> list[tuple]:
    """The samples of `metric` on one device along builds, oldest build first:
    (build name, build created, run id, repetition, value). What regression analysis reads;
    `limit_builds` keeps only the newest that many builds."""
    query = (
        select(Build.name, Build.created, Run.id, Sample.repetition, Sample.value)
        .join(Run, Run.id == Sample.run_id)
        .join(Build, Build.id == Run.build_id)
        .where(Run.device_id == device_id, Sample.metric == metric)
    )
    if limit_builds is not None:
        newest = (select(Run.build_id).where(Run.device_id == device_id, Run.build_id.is_not(None))
                  .join(Build, Build.id == Run.build_id).group_by(Run.build_id)
                  .order_by(func.max(Build.created).desc()).limit(limit_builds))
        query = query.where(Run.build_id.in_(newest.scalar_subquery()))
    return [tuple(r) for r in session.execute(query.order_by(Build.created, Build.id, Run.id, Sample.repetition))]


def iter_samples(
    sessions: Callable[[], Session],
    *,
    device_id: int | None = None,
    build_id: int | None = None,
    metric: str | None = None,
    kind: JobKind | str | None = None,
    runs_per_chunk: int = 200,
) -> Iterator[tuple]:
    """Every raw sample of the runs matching the filters, one tuple per sample in
    EXPORT_COLUMNS order, run by run. Memory holds the matching run ids and one chunk of
    samples; each chunk is read in its own short transaction."""
    with sessions() as session:
        runs_query = _runs_query(device_id=device_id, build_id=build_id, metric=metric, kind=kind)
        run_ids = list(session.scalars(runs_query.with_only_columns(Run.id).order_by(Run.id)))
    for start in range(0, len(run_ids), runs_per_chunk):
        chunk = run_ids[start:start + runs_per_chunk]
        query = (
            select(Run.id, Run.job_id, Device.serial, Build.name, Job.kind, Run.finished_at, Sample.metric,
                   Sample.unit, Sample.value, Sample.repetition)
            .join(Run, Run.id == Sample.run_id)
            .join(Job, Job.id == Run.job_id)
            .join(Device, Device.id == Run.device_id)
            .outerjoin(Build, Build.id == Run.build_id)
            .where(Sample.run_id.in_(chunk))
            .order_by(Sample.run_id, Sample.id)
        )
        if metric is not None:
            query = query.where(Sample.metric == metric)
        with sessions() as session:
            rows = session.execute(query).all()
        for r in rows:
            yield (r[0], r[1], r[2], r[3], str(r[4]), r[5].isoformat() if r[5] else "", *r[6:])
