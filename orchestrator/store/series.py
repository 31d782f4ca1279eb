"""A series' rows: the runs that are a series' measurements (succeeded runs of a device and
workload, no `farm check`'s), their samples, kernel timings and thermal readings, each build's
samples in build order, and the settings kept per series (its minimum effect, its drift). The
analysis keys series and judges them (orchestrator/analysis/regressions.py, series.py,
changepoints.py); these functions only read and write its rows, in the order they name.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .models import (
    Build,
    Job,
    JobKind,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    SeriesSetting,
    ThermalReading,
)
from .rows import in_series

__all__ = [
    "kernel_timings_of", "newest_run_in", "runs_with_specs", "samples_of", "series_history_rows", "series_setting",
    "series_settings_naming", "set_series_setting", "thermal_readings_of",
]


def runs_with_specs(session: Session, device_id: int, build_id: int, kind: JobKind, *,
                    checks: bool = False) -> list[tuple[Run, dict[str, Any] | None]]:
    """Succeeded runs of `kind` jobs of a build on a device, by id, each with its job's spec: the
    series' runs, and with `checks` also those of `farm check`s."""
    query = (select(Run, Job.spec).join(Job, Job.id == Run.job_id)
             .where(Run.device_id == device_id, Run.build_id == build_id, Run.status == RunStatus.succeeded,
                    Job.kind == kind).order_by(Run.id))
    return [tuple(r) for r in session.execute(query if checks else query.where(in_series()))]


def newest_run_in(session: Session, device_id: int, env_key: str) -> Run | None:
    """The device's newest run in one environment (an env_key), or None."""
    return session.scalar(select(Run).where(Run.device_id == device_id, Run.env_key == env_key)
                          .order_by(Run.id.desc()).limit(1))


def samples_of(session: Session, run_ids: list[int], metric: str) -> list[tuple[int, str, float]]:
    """(run id, unit, value) of every sample of `metric` the runs recorded, in recording order."""
    return [tuple(r) for r in session.execute(select(Sample.run_id, Sample.unit, Sample.value).where(
        Sample.run_id.in_(run_ids), Sample.metric == metric).order_by(Sample.id))]


def kernel_timings_of(session: Session, run_ids: list[int]) -> list[tuple[int, int, str, float]]:
    """(run id, repetition, kernel, total ms) of every kernel timing of the runs, by run and
    repetition."""
    return [tuple(r) for r in session.execute(
        select(KernelTiming.run_id, KernelTiming.repetition, KernelTiming.kernel, KernelTiming.total_ms)
        .where(KernelTiming.run_id.in_(run_ids)).order_by(KernelTiming.run_id, KernelTiming.repetition))]


def thermal_readings_of(session: Session, run_ids: list[int]) -> list[ThermalReading]:
    """The thermal readings of the runs."""
    return list(session.scalars(select(ThermalReading).where(ThermalReading.run_id.in_(run_ids))))


def series_history_rows(session: Session, device_id: int, metric: str) -> list[tuple]:
    """Every sample of `metric` in the device's succeeded latency runs that are a series'
    measurement, in build order (creation, id), then recording order: (build name, build
    created, build id, value, job spec, run env_key)."""
    return [tuple(r) for r in session.execute(
        select(Build.name, Build.created, Build.id, Sample.value, Job.spec, Run.env_key)
        .join(Run, Run.build_id == Build.id).join(Job, Job.id == Run.job_id).join(Sample, Sample.run_id == Run.id)
        .where(Run.device_id == device_id, Run.status == RunStatus.succeeded, Job.kind == JobKind.latency,
               Sample.metric == metric, in_series())
        .order_by(Build.created, Build.id, Sample.id))]


# ---- settings -----------------------------------------------------------------------------


def series_setting(session: Session, series_key: str) -> SeriesSetting | None:
    """The settings of the series whose canonical key is `series_key`, or None."""
    return session.scalar(select(SeriesSetting).where(SeriesSetting.series_key == series_key))


def series_settings_naming(session: Session, text: str) -> list[SeriesSetting]:
    """The series settings whose key contains `text` (as it is, no wildcards), oldest first."""
    return list(session.scalars(select(SeriesSetting).where(
        SeriesSetting.series_key.contains(text, autoescape=True)).order_by(SeriesSetting.id)))


def set_series_setting(session: Session, series_key: str, **values: float) -> SeriesSetting:
    """Set fields (min_effect, drift) of the settings of the series `series_key`, made when it
    has none."""
    setting = series_setting(session, series_key)
    if setting is None:
        setting = SeriesSetting(series_key=series_key, **values)
        session.add(setting)
    else:
        for field, value in values.items():
            setattr(setting, field, value)
    session.flush()
    return setting
