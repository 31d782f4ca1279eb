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
from orchestrator.analysis.regressions import CHANGE_POINT_WINDOW, HEADLINE_METRICS, min_effect
from orchestrator.analysis.series_state import catch_up
from orchestrator.analysis.stats.changepoint import MIN_SEGMENT
from orchestrator.store import Session
from orchestrator.store.models import ChangePoint, Device, utcnow


def scan_change_points(session: Session, device: Device | None = None, metric: str | None = None,
                       now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Change-point detection over the recent history of every latency series (of `device`, of
    `metric`, when given: find_change_points), on its own rather than inside an alert; each change point found is
    recorded (ChangePoint, one per series and build, updated when found again). A level move
    smaller than the series' minimum effect is not one: with ten samples a build, a 1% shift can
    be significant and still be nothing anyone would act on. Returns them, `new` marking those
    not recorded before. Flushes only."""
    catch_up(session)
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
    a read snapshot (orchestrator.store.session.read_snapshot), so that a scan never holds the
    store's write lock: the caller brings the series state up to date first (series_state.catch_up,
    in a transaction of its own). Each series is scanned over its tail, as per-build medians from the
    series state: its newest CHANGE_POINT_WINDOW builds, from the change point recorded before
    its newest one on (the stable segment before the newest change point, which that change
    point is confirmed or moved against, and all after it): the cost of a scan does not grow
    with the series' age."""
    found: list[FoundChangePoint] = []
    states = store.series_states(session, device.id if device is not None else None, metric,
                                 metrics=None if metric is not None else list(HEADLINE_METRICS))
    for state, _, _ in states:
        points = store.series_points(session, state.id, newest=CHANGE_POINT_WINDOW)
        # The tail since the last stable segment: from the change point before the newest on.
        recorded = {cp.build_id for cp in store.change_points_of(session, state.key, [p.build_id for p, _ in points])}
        at = [i for i, (p, _) in enumerate(points) if p.build_id in recorded]
        if len(at) >= 2:
            points = points[at[-2]:]
        if len(points) < 2 * MIN_SEGMENT:
            continue
        key = rg.SeriesKey.from_dict(state.series)
        history = [{"build": name, "build_id": p.build_id, "values": [p.median]} for p, name in points]
        floor = min_effect(session, key)
        for point in rg.detect_change_points([p.median for p, _ in points]):
            if point.ratio is None or abs(point.ratio - 1) < floor:
                continue
            found.append(FoundChangePoint(state.device_id, key, history, point))
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
