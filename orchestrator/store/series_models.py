"""The analysis' series state, kept as runs arrive so that nothing the nightly analysis, the
dashboard or the API reads grows with a series' age (orchestrator/analysis/series_state.py keeps
it; orchestrator/store/series_state.py reads and writes it):

- `series`: one row per series (a device, workload, environment and metric: the analysis' key),
  with its run and build counts and its newest point, so that listing every series or drawing
  the overview is one query, and a series is found by its id (a hash of its key);
- `series_points`: one row per series and build: the count, median, minimum and maximum of the
  build's samples in the series, which change-point detection and the charts read instead of
  raw samples;
- `series_runs`: one row per series and run: its sample count and median, and what the
  run-to-run drift estimate needs of it (the log median and the within-run variance of that
  median), with whether the run is thermally flagged, so the drift needs no raw samples either;
- `series_progress`: how far the state has read the runs table.

Raw samples stay the truth: the state is derived from them, and can be rebuilt from them."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import ForeignKey, Index, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from .models import Base, utcnow


class SeriesState(Base):
    __tablename__ = "series"
    __table_args__ = (Index("ix_series_device_workload", "device_id", "workload", "env_key"),
                      Index("ix_series_metric", "metric"))

    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # analysis.series.series_id(key)
    key: Mapped[str] = mapped_column(Text)  # SeriesKey.canonical()
    series: Mapped[dict[str, Any]]  # SeriesKey.as_dict()
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    metric: Mapped[str] = mapped_column(String(128))
    workload: Mapped[str] = mapped_column(String(512))  # the job-spec part of the key, canonical JSON
    env_key: Mapped[str] = mapped_column(String(32))
    runs: Mapped[int] = mapped_column(default=0)
    builds: Mapped[int] = mapped_column(default=0)
    last_build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="SET NULL"))
    last_build_created: Mapped[dt.datetime | None]
    last_median: Mapped[float | None]
    last_n: Mapped[int] = mapped_column(default=0)
    # The newest comparison of the series' build against its baseline, as the batch analysis
    # made it (analysis/series_state.py record_verdict): verdict, ratio, interval, builds, reason.
    verdict: Mapped[dict[str, Any] | None]
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class SeriesPoint(Base):
    __tablename__ = "series_points"
    __table_args__ = (UniqueConstraint("series_id", "build_id"),
                      Index("ix_series_points_order", "series_id", "build_created", "build_id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    series_id: Mapped[str] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    build_created: Mapped[dt.datetime]
    n: Mapped[int]
    median: Mapped[float]
    minimum: Mapped[float]
    maximum: Mapped[float]


class SeriesRun(Base):
    __tablename__ = "series_runs"
    __table_args__ = (UniqueConstraint("series_id", "run_id"),
                      Index("ix_series_runs_order", "series_id", "build_created", "build_id", "run_id"),
                      Index("ix_series_runs_run", "run_id"))

    id: Mapped[int] = mapped_column(primary_key=True)
    series_id: Mapped[str] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    build_created: Mapped[dt.datetime]
    n: Mapped[int]
    median: Mapped[float]
    log_median: Mapped[float | None]  # None: not usable for the drift (fewer than 3 samples, or not positive)
    within: Mapped[float | None]
    flagged: Mapped[bool] = mapped_column(default=False)


class SeriesProgress(Base):
    __tablename__ = "series_progress"

    id: Mapped[int] = mapped_column(primary_key=True)  # one row, id 1
    last_run_id: Mapped[int] = mapped_column(default=0)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
