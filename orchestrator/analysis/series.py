"""The analysis' series as a listing: every series a succeeded latency run has contributed to,
keyed exactly as orchestrator/regressions.py keys it when it compares builds (device, OS and
driver, model, resolution, steps, precision, requested profile, metric and the environment the
runs recorded), and its points, one per build in build order (regressions.series_history: the
same samples the analysis reads). What the farm API's /v1/series serves; a series' `id` is a
short hash of its canonical key, stable for as long as the key is."""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from typing import Any

from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.analysis import stats as rg
from orchestrator.store import Session, queries
from orchestrator.store import environment as run_env
from orchestrator.store.models import Device

SERIES_ID_CHARS = 16


@dataclass(frozen=True)
class Series:
    id: str
    key: rg.SeriesKey
    device_id: int
    spec: regressions.SpecKey
    runs: int  # succeeded latency runs in it


def series_id(key: rg.SeriesKey) -> str:
    return hashlib.sha256(key.canonical().encode()).hexdigest()[:SERIES_ID_CHARS]


def list_series(session: Session, device: Device | None = None, metric: str | None = None) -> list[Series]:
    """Every headline-metric series with at least one sample (of `device`, of `metric` when
    given), by device serial and then key."""
    device_id = device.id if device is not None else None
    metrics = [metric] if metric is not None else list(regressions.HEADLINE_METRICS)
    measured: dict[int, set[str]] = {}
    for run_id, name in store.metrics_measured(session, metrics, device_id):
        measured.setdefault(run_id, set()).add(name)
    devices: dict[int, Device] = {}
    legacy: dict[int, str] = {}  # runs stored before runs carried an environment: the device's record
    groups: dict[tuple[int, regressions.SpecKey, str, str], list[int]] = {}
    for run in store.series_runs(session, device_id):
        if run.device_id not in devices:
            devices[run.device_id] = store.get_device(session, run.device_id)
            legacy[run.device_id] = run_env.environment_key(store.result_environment(devices[run.device_id]))
        for name in measured.get(run.id, ()):
            groups.setdefault((run.device_id, regressions.SpecKey.of(run.spec or {}),
                               run.env_key or legacy[run.device_id], name), []).append(run.id)
    found = []
    for (device_id, spec, _, name), run_ids in groups.items():
        dev = devices[device_id]
        environment = regressions.run_environment(queries.get_run(session, run_ids[-1]), dev)
        key = regressions.series_key(dev, spec, name, environment)
        found.append(Series(series_id(key), key, device_id, spec, len(run_ids)))
    return sorted(found, key=lambda s: (s.key.device, s.key.canonical()))


def get_series(session: Session, ident: str) -> Series:
    """The series whose id is `ident`; StoreError when none is."""
    for series in list_series(session):
        if series.id == ident:
            return series
    raise store.StoreError(f"no series {ident!r}; GET /v1/series lists them")


def points(session: Session, series: Series) -> list[dict[str, Any]]:
    """One point per build, oldest first: its samples, their count, median, minimum, maximum."""
    history = regressions.series_history(session, store.get_device(session, series.device_id), series.spec,
                                      series.key.metric, environment=series.key.environment)
    return [{"build": h["build"], "build_id": h["build_id"], "n": len(h["values"]),
             "median": statistics.median(h["values"]), "min": min(h["values"]), "max": max(h["values"]),
             "values": h["values"]} for h in history if h["values"]]
