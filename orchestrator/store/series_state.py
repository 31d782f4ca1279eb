"""The series state's rows (orchestrator/store/series_models.py): what the analysis keeps per
series as runs arrive (orchestrator/analysis/series_state.py decides what goes in), and the
bounded reads the analysis, the dashboard and the API make of it: a series by its id, every
series in one query, a series' points in build order (the newest few, or up to a build), the
newest runs before a build for the drift, the newest builds measured before a build.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, NamedTuple

from sqlalchemy import Row, and_, delete, func, select, tuple_
from sqlalchemy.orm import Session

from .models import (
    Build,
    Device,
    Job,
    JobKind,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    utcnow,
)
from .rows import in_series
from .series_models import SeriesPoint, SeriesProgress, SeriesRun, SeriesState

__all__ = [
    "Point", "delete_series_points", "lock_series_progress", "pending_series_runs", "point_values", "runs_in_series_state",
    "samples_of_runs", "save_series_points", "save_series_runs", "series_builds_before", "series_kernel_timings",
    "series_of_device", "series_points", "series_progress", "series_run_stats",
    "get_series_state", "newest_run_id", "series_points_at", "series_run_values", "series_states", "set_series_progress",
    "upsert_series_state", "newer_verdict", "verdict_of",
]

PROGRESS_ID = 1


# ---- keeping it -------------------------------------------------------------------------------


def series_progress(session: Session) -> int:
    """The newest run id the state has read (0: none)."""
    return session.scalar(select(SeriesProgress.last_run_id).where(SeriesProgress.id == PROGRESS_ID)) or 0


def newest_run_id(session: Session) -> int:
    """The newest run's id (0: none)."""
    return session.scalar(select(func.max(Run.id))) or 0


def lock_series_progress(session: Session) -> int:
    """Take the state's lock (the progress row, FOR UPDATE on PostgreSQL; SQLite's write
    transaction already holds its database's) and return the progress; made when missing."""
    row = session.scalar(select(SeriesProgress).where(SeriesProgress.id == PROGRESS_ID).with_for_update())
    if row is None:
        session.add(SeriesProgress(id=PROGRESS_ID, last_run_id=0))
        session.flush()
        row = session.scalar(select(SeriesProgress).where(SeriesProgress.id == PROGRESS_ID).with_for_update())
    return row.last_run_id


def set_series_progress(session: Session, last_run_id: int) -> None:
    row = session.get(SeriesProgress, PROGRESS_ID)
    row.last_run_id, row.updated_at = max(row.last_run_id, last_run_id), utcnow()
    session.flush()


def pending_series_runs(session: Session, after_id: int, limit: int) -> list[Row]:
    """Succeeded latency runs that are a series' measurement (no check's), with a build, of id
    above `after_id` and not yet in the state, oldest first, at most `limit`: (id, device_id,
    build_id, build created, env_key, environment, cooldown_timed_out, job spec)."""
    return list(session.execute(
        select(Run.id, Run.device_id, Run.build_id, Build.created, Run.env_key, Run.environment,
               Run.cooldown_timed_out, Job.spec)
        .join(Job, Job.id == Run.job_id).join(Build, Build.id == Run.build_id)
        .where(Run.id > after_id, Job.kind == JobKind.latency, Run.status == RunStatus.succeeded, in_series(),
               ~select(SeriesRun.id).where(SeriesRun.run_id == Run.id).exists())
        .order_by(Run.id).limit(limit)))


def runs_in_series_state(session: Session, run_ids: list[int]) -> set[int]:
    """Those of `run_ids` the state already holds."""
    return set(session.scalars(select(SeriesRun.run_id).where(SeriesRun.run_id.in_(run_ids)).distinct()))


def samples_of_runs(session: Session, run_ids: list[int], metrics: Iterable[str]) -> list[tuple[int, str, str, float]]:
    """(run id, metric, unit, value) of the runs' samples of `metrics`, in recording order."""
    return [tuple(r) for r in session.execute(
        select(Sample.run_id, Sample.metric, Sample.unit, Sample.value)
        .where(Sample.run_id.in_(run_ids), Sample.metric.in_(list(metrics))).order_by(Sample.id))]


def upsert_series_state(session: Session, ident: str, **values: Any) -> SeriesState:
    """The series `ident`, made with `values` when new (its key, device, metric, ...)."""
    row = session.get(SeriesState, ident)
    if row is None:
        row = SeriesState(id=ident, runs=0, builds=0, last_n=0, **values)
        session.add(row)
        session.flush()
    return row


def save_series_runs(session: Session, rows: list[dict[str, Any]]) -> None:
    """Add series_runs rows (dicts of SeriesRun's columns)."""
    if rows:
        session.execute(SeriesRun.__table__.insert(), rows)
    session.flush()


def delete_series_points(session: Session, pairs: list[tuple[str, int]]) -> None:
    """Remove the points of (series id, build id) pairs (they are saved again, recomputed)."""
    for start in range(0, len(pairs), 500):
        chunk = pairs[start:start + 500]
        session.execute(delete(SeriesPoint).where(tuple_(SeriesPoint.series_id, SeriesPoint.build_id).in_(chunk)))
    session.flush()


def save_series_points(session: Session, rows: list[dict[str, Any]]) -> None:
    if rows:
        session.execute(SeriesPoint.__table__.insert(), rows)
    session.flush()


def point_values(session: Session, pairs: list[tuple[str, int]], metric_of: dict[str, str]) -> dict[tuple[str, int], list[float]]:
    """(series id, build id) -> the values of the series' metric in every run the state holds of
    that build, in recording order."""
    out: dict[tuple[str, int], list[float]] = {}
    for start in range(0, len(pairs), 500):
        chunk = pairs[start:start + 500]
        rows = session.execute(
            select(SeriesRun.series_id, SeriesRun.build_id, Sample.metric, Sample.value)
            .join(Sample, Sample.run_id == SeriesRun.run_id)
            .where(tuple_(SeriesRun.series_id, SeriesRun.build_id).in_(chunk)).order_by(Sample.id))
        for series_id, build_id, metric, value in rows:
            if metric_of[series_id] == metric:
                out.setdefault((series_id, build_id), []).append(value)
    return out


def verdict_of(result: dict[str, Any], candidate: tuple[int, str, dt.datetime],
               baseline: tuple[int, str]) -> dict[str, Any]:
    """What a series' row keeps as its verdict (series.verdict) of a comparison (the dict
    analysis.regressions.compare_builds makes) of `candidate` (id, name, created) against
    `baseline` (id, name); `order` ranks it among the series' verdicts."""
    return {"verdict": result["verdict"], "cause": result.get("cause"), "reason": result["reason"],
            "build_id": candidate[0], "build": candidate[1], "baseline_build_id": baseline[0],
            "baseline_build": baseline[1], "ratio": result["ratio"], "ci_low": result["ci_low"],
            "ci_high": result["ci_high"], "confidence": result.get("confidence"), "p_value": result["p_value"],
            "environment_change": bool(result.get("environment_change")),
            "order": [candidate[2].isoformat(), candidate[0]]}


def newer_verdict(stored: dict[str, Any] | None, verdict: dict[str, Any]) -> bool:
    """Whether `verdict` is about a build at least as new as the `stored` one's."""
    return stored is None or stored.get("order", verdict["order"]) <= verdict["order"]


# ---- reading it -------------------------------------------------------------------------------


def get_series_state(session: Session, ident: str) -> SeriesState | None:
    return session.get(SeriesState, ident)


def series_states(session: Session, device_id: int | None = None, metric: str | None = None,
                  metrics: Iterable[str] | None = None) -> list[tuple[SeriesState, str, str | None]]:
    """Every series (of a device, of a metric or metrics, when given) with its device's serial
    and its newest build's name, by serial and key."""
    query = (select(SeriesState, Device.serial, Build.name).join(Device, Device.id == SeriesState.device_id)
             .outerjoin(Build, Build.id == SeriesState.last_build_id))
    if device_id is not None:
        query = query.where(SeriesState.device_id == device_id)
    if metric is not None:
        query = query.where(SeriesState.metric == metric)
    if metrics is not None:
        query = query.where(SeriesState.metric.in_(list(metrics)))
    return [tuple(r) for r in session.execute(query.order_by(Device.serial, SeriesState.key))]


def series_of_device(session: Session, device_id: int, workload: str, env_key: str | None = None) -> list[SeriesState]:
    """The series of a device's workload (in one environment, when given)."""
    query = select(SeriesState).where(SeriesState.device_id == device_id, SeriesState.workload == workload)
    return list(session.scalars(query if env_key is None else query.where(SeriesState.env_key == env_key)))


def _before(created: dt.datetime, build_id: int, column_created, column_build):
    return (column_created < created) | ((column_created == created) & (column_build < build_id))


class Point(NamedTuple):
    """A series' point as series_points reads it (plain values, no ORM object)."""

    build_id: int
    build_created: dt.datetime
    n: int
    median: float
    minimum: float
    maximum: float


def series_points(session: Session, series_id: str, *, until: tuple[dt.datetime, int] | None = None,
                  newest: int | None = None, builds: Iterable[int] | None = None) -> list[tuple[Point, str]]:
    """A series' points in build order, each with its build's name: all, or those up to the
    build (created, id) `until`, or of `builds`; with `newest`, only the newest so many."""
    query = (select(SeriesPoint.build_id, SeriesPoint.build_created, SeriesPoint.n, SeriesPoint.median,
                    SeriesPoint.minimum, SeriesPoint.maximum, Build.name)
             .join(Build, Build.id == SeriesPoint.build_id).where(SeriesPoint.series_id == series_id))
    if until is not None:
        query = query.where(_before(*until, SeriesPoint.build_created, SeriesPoint.build_id) |
                            and_(SeriesPoint.build_created == until[0], SeriesPoint.build_id == until[1]))
    if builds is not None:
        query = query.where(SeriesPoint.build_id.in_(list(builds)))
    if newest is None:
        rows = list(session.execute(query.order_by(SeriesPoint.build_created, SeriesPoint.build_id)))
    else:
        rows = list(session.execute(query.order_by(SeriesPoint.build_created.desc(), SeriesPoint.build_id.desc())
                                    .limit(newest)))[::-1]
    return [(Point(*row[:6]), row[6]) for row in rows]


def series_run_values(session: Session, series_id: str, metric: str,
                      builds: Iterable[int] | None = None) -> list[tuple[int, float]]:
    """(build id, value) of every sample of the series' runs (of `builds`), in recording order:
    the runs from the state first, then their samples through (metric, run_id)."""
    query = select(SeriesRun.run_id, SeriesRun.build_id).where(SeriesRun.series_id == series_id)
    if builds is not None:
        query = query.where(SeriesRun.build_id.in_(list(builds)))
    build_of = dict(session.execute(query).all())
    out: list[tuple[int, int, float]] = []
    run_ids = sorted(build_of)
    for start in range(0, len(run_ids), 500):
        out += session.execute(select(Sample.id, Sample.run_id, Sample.value).where(
            Sample.metric == metric, Sample.run_id.in_(run_ids[start:start + 500]))).all()
    return [(build_of[run_id], value) for _, run_id, value in sorted(out)]


def series_run_stats(session: Session, series_ids: list[str], before: tuple[dt.datetime, int], skip_builds: set[int],
                     limit: int) -> list[SeriesRun]:
    """The newest `limit` runs of the series of builds made before the build (created, id)
    `before`, builds in `skip_builds` left out, newest run first."""
    if not series_ids:
        return []
    query = select(SeriesRun).where(SeriesRun.series_id.in_(series_ids),
                                    _before(*before, SeriesRun.build_created, SeriesRun.build_id))
    if skip_builds:
        query = query.where(SeriesRun.build_id.not_in(list(skip_builds)))
    return list(session.scalars(query.order_by(SeriesRun.run_id.desc()).limit(limit)))


def series_builds_before(session: Session, series_ids: list[str], before: tuple[dt.datetime, int],
                         limit: int) -> list[int]:
    """The newest `limit` builds made before the build (created, id) `before` with points in any
    of the series, newest first."""
    if not series_ids:
        return []
    rows = session.execute(
        select(SeriesPoint.build_id, SeriesPoint.build_created)
        .where(SeriesPoint.series_id.in_(series_ids), _before(*before, SeriesPoint.build_created, SeriesPoint.build_id))
        .group_by(SeriesPoint.build_id, SeriesPoint.build_created)
        .order_by(SeriesPoint.build_created.desc(), SeriesPoint.build_id.desc()).limit(limit))
    return [build_id for build_id, _ in rows]


def series_kernel_timings(session: Session, series_id: str) -> list[tuple[int, int, int, str, float]]:
    """(build id, run id, repetition, kernel, total ms) of every kernel timing of the series'
    runs, by run and repetition."""
    return [tuple(r) for r in session.execute(
        select(SeriesRun.build_id, KernelTiming.run_id, KernelTiming.repetition, KernelTiming.kernel,
               KernelTiming.total_ms)
        .join(KernelTiming, KernelTiming.run_id == SeriesRun.run_id).where(SeriesRun.series_id == series_id)
        .order_by(KernelTiming.run_id, KernelTiming.repetition))]


def series_points_at(session: Session, pairs: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Those (series id, build id) pairs that have a point."""
    found = []
    for start in range(0, len(pairs), 500):
        chunk = pairs[start:start + 500]
        found += [tuple(r) for r in session.execute(select(SeriesPoint.series_id, SeriesPoint.build_id).where(
            tuple_(SeriesPoint.series_id, SeriesPoint.build_id).in_(chunk)))]
    return found
