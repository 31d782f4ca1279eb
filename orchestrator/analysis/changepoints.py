"""Change points in each series' history (E-Divisive over the per-build medians,
orchestrator/analysis/stats/changepoint.py): found for a device or the whole farm, and recorded
as change-point alerts once each, the nightly analysis after a batch and `farm regressions scan`
asking for them."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from orchestrator import store
from orchestrator.analysis import stats as rg
from orchestrator.analysis.regressions import (
    HEADLINE_METRICS,
    SpecKey,
    min_effect,
    series_history,
    series_key,
)
from orchestrator.analysis.stats.changepoint import MIN_SEGMENT
from orchestrator.store import Session
from orchestrator.store import environment as run_env
from orchestrator.store.models import ChangePoint, Device, utcnow


def scan_change_points(session: Session, device: Device | None = None, metric: str | None = None,
                       now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Change-point detection over the whole history of every latency series (of `device`, of
    `metric`, when given), on its own rather than inside an alert; each change point found is
    recorded (ChangePoint, one per series and build, updated when found again). A level move
    smaller than the series' minimum effect is not one: with ten samples a build, a 1% shift can
    be significant and still be nothing anyone would act on. Returns them, `new` marking those
    not recorded before. Flushes only."""
    found = record_change_points(session, find_change_points(session, device, metric), now)
    session.flush()
    return found


@dataclass
class FoundChangePoint:
    """A change point find_change_points saw, with what record_change_points needs to record it."""

    device_id: int
    key: rg.SeriesKey
    history: list[dict[str, Any]]
    point: Any  # rg.ChangePoint


def find_change_points(session: Session, device: Device | None = None,
                       metric: str | None = None) -> list[FoundChangePoint]:
    """scan_change_points' reading and computing, which writes nothing: what an analysis runs in
    a read snapshot (orchestrator.store.session.read_snapshot), so that a whole history's scan
    never holds the store's write lock."""
    devices = [device] if device is not None else store.all_devices(session)
    metrics = [metric] if metric is not None else list(HEADLINE_METRICS)
    found: list[FoundChangePoint] = []
    for dev in devices:
        legacy = store.result_environment(dev)  # runs stored before runs carried an environment
        series: dict[tuple[SpecKey, str], dict[str, Any]] = {}
        for run in store.series_runs(session, dev.id, environment=True):
            env = run.environment if run.env_key else legacy
            series[(SpecKey.of(run.spec or {}), run.env_key or run_env.environment_key(legacy))] = env
        for (spec, env_key), env in sorted(series.items(), key=lambda kv: (repr(kv[0][0]), kv[0][1])):
            for name in metrics:
                history = series_history(session, dev, spec, name, environment=env_key)
                if len(history) < 2 * MIN_SEGMENT:
                    continue
                key = series_key(dev, spec, name, env)
                floor = min_effect(session, key)
                for point in rg.detect_change_points([h["values"] for h in history]):
                    if point.ratio is None or abs(point.ratio - 1) < floor:
                        continue
                    found.append(FoundChangePoint(dev.id, key, history, point))
    return found


def record_change_points(session: Session, found: list[FoundChangePoint],
                         now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Record what find_change_points found (ChangePoint, one per series and build, updated
    when found again); flushes only. Returns them as scan_change_points does."""
    now = now or utcnow()
    out = []
    for f in found:
        out.append(_record_change_point(session, store.get_device(session, f.device_id), f.key, f.history, f.point,
                                        now))
    return out


def _record_change_point(session: Session, device: Device, key: rg.SeriesKey, history: list[dict[str, Any]],
                         point, now: dt.datetime) -> dict[str, Any]:
    build = history[point.index]
    row = store.find_change_point(session, key.canonical(), build["build_id"])
    new = row is None
    if new:
        row = ChangePoint(series_key=key.canonical(), series=key.as_dict(), device_id=device.id,
                          build_id=build["build_id"], metric=key.metric, detected_at=now)
    row.median_before, row.median_after, row.ratio = point.median_before, point.median_after, point.ratio
    row.p_value, row.builds_in_history, row.updated_at = point.p_value, len(history), now
    if new:
        store.add_change_point(session, row)
    return {"device": device.serial, "metric": key.metric, "series": key.as_dict(), "build": build["build"],
            "ratio": point.ratio, "median_before": point.median_before, "median_after": point.median_after,
            "p_value": point.p_value, "builds_in_history": len(history), "new": new}
