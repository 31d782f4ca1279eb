"""What the HTML dashboard shows, read from the store into plain dataclasses: every device with
its state, temperatures and cool-down record; per device, the trend of each key metric over
builds (ordered by build creation, as regression analysis orders them) as per-build summaries
of the raw samples; and every alert with what its `detail` carries (compared metrics, kernel
attribution, images before and after). Rendering never touches the database.

Notation for one build's samples x of one metric on one device: n = len(x), median, q1 and q3
the quartiles (the interquartile band), lo and hi the extremes (the full band)."""

from __future__ import annotations

import datetime as dt
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload

from orchestrator.db import queries
from orchestrator.db.models import Alert, Device, Run, Sample, ThermalReading


@dataclass
class BuildPoint:
    build: str
    created: dt.datetime
    n: int
    median: float
    q1: float
    q3: float
    lo: float
    hi: float


@dataclass
class AlertMarker:
    alert_id: int
    build: str
    kind: str
    state: str
    summary: str


@dataclass
class Trend:
    metric: str
    unit: str
    points: list[BuildPoint]
    alerts: list[AlertMarker]


@dataclass
class DeviceView:
    id: int
    serial: str
    model: str
    state: str
    state_reason: str
    last_seen: dt.datetime | None
    runs: int
    cooldown_timed_out: int
    last_cooldown_wait_s: float | None
    temperatures: list[tuple[str, str, float]]  # (phase, zone, celsius) of the newest run that has them
    trends: list[Trend] = field(default_factory=list)

    def hottest(self, phase: str) -> float | None:
        values = [c for p, _, c in self.temperatures if p == phase]
        return max(values) if values else None


@dataclass
class CompareRow:
    metric: str
    baseline: float | None
    new: float | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None


@dataclass
class AttributionRow:
    kernel: str
    baseline_ms: float | None
    candidate_ms: float | None
    delta_ms: float | None
    share: float | None


@dataclass
class AlertView:
    id: int
    kind: str
    state: str
    device: str | None
    build: str | None
    baseline: str | None
    metric: str
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    summary: str
    note: str
    created_at: dt.datetime
    compare: list[CompareRow]
    attribution: list[AttributionRow]
    images: dict[str, str]  # before / after -> path as stored
    detail: dict[str, Any]


@dataclass
class SiteData:
    devices: list[DeviceView]
    alerts: list[AlertView]
    generated_at: dt.datetime


# ---- reading --------------------------------------------------------------------------------


def _points(rows: list[tuple]) -> list[BuildPoint]:
    """metric_series rows (build, created, run id, repetition, value) -> one point per build."""
    per_build: dict[str, list[float]] = defaultdict(list)
    created: dict[str, dt.datetime] = {}
    for build, build_created, _run, _rep, value in rows:
        per_build[build].append(value)
        created[build] = build_created
    points = []
    for build, x in per_build.items():  # rows come oldest build first, and dicts keep that order
        q1, _, q3 = statistics.quantiles(x, n=4, method="inclusive") if len(x) > 1 else (x[0], x[0], x[0])
        points.append(BuildPoint(build=build, created=created[build], n=len(x), median=statistics.median(x),
                                 q1=q1, q3=q3, lo=min(x), hi=max(x)))
    return points


def _device_metrics(session: Session, device_id: int) -> list[tuple[str, str]]:
    """(metric, unit) of the key metrics this device has samples of, in KEY_METRICS order."""
    rows = session.execute(
        select(Sample.metric, func.min(Sample.unit))
        .join(Run, Run.id == Sample.run_id)
        .where(Run.device_id == device_id, Sample.metric.in_(queries.KEY_METRICS), Run.build_id.is_not(None))
        .group_by(Sample.metric)
    ).all()
    units = dict(rows)
    return [(m, units[m]) for m in queries.KEY_METRICS if m in units]


def _device_view(session: Session, device: Device, alerts: list[Alert]) -> DeviceView:
    runs = session.execute(
        select(func.count(Run.id), func.count(Run.id).filter(Run.cooldown_timed_out))
        .where(Run.device_id == device.id)
    ).one()
    last_wait = session.scalar(select(Run.cooldown_wait_s).where(Run.device_id == device.id,
                                                                 Run.cooldown_wait_s.is_not(None))
                               .order_by(Run.id.desc()).limit(1))
    newest_hot_run = session.scalar(select(ThermalReading.run_id).join(Run, Run.id == ThermalReading.run_id)
                                    .where(Run.device_id == device.id).order_by(Run.id.desc()).limit(1))
    temperatures = ([(t.phase, t.zone, t.celsius) for t in queries.thermal_readings(session, newest_hot_run)]
                    if newest_hot_run is not None else [])
    view = DeviceView(id=device.id, serial=device.serial, model=device.model, state=str(device.state),
                      state_reason=device.state_reason, last_seen=device.last_seen, runs=runs[0],
                      cooldown_timed_out=runs[1], last_cooldown_wait_s=last_wait, temperatures=temperatures)
    for metric, unit in _device_metrics(session, device.id):
        points = _points(queries.metric_series(session, device.id, metric))
        builds = {p.build for p in points}
        markers = [AlertMarker(alert_id=a.id, build=a.build.name, kind=str(a.kind), state=str(a.state),
                               summary=a.summary)
                   for a in alerts if a.device_id == device.id and a.metric == metric and a.build is not None
                   and a.build.name in builds]
        view.trends.append(Trend(metric=metric, unit=unit, points=points, alerts=markers))
    return view


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _first(item: dict[str, Any], *keys: str) -> float | None:
    """The first of `keys` that holds a number: the analysis calls the new side `candidate`."""
    return next((_number(item[k]) for k in keys if _number(item.get(k)) is not None), None)


def _compare_rows(alert: Alert) -> list[CompareRow]:
    """The alert's own metric first (its columns), then any further metrics its detail compared
    (detail["metrics"]: a list of {metric, baseline, new or candidate, ratio, ci_low, ci_high,
    p_value}; medians may also be named baseline_median / candidate_median / new_median)."""
    detail = alert.detail or {}
    rows = [CompareRow(metric=alert.metric or "(none)", baseline=_first(detail, "baseline_median"),
                       new=_first(detail, "candidate_median", "new_median"), ratio=alert.ratio, ci_low=alert.ci_low,
                       ci_high=alert.ci_high, p_value=alert.p_value)]
    for item in detail.get("metrics") or []:
        if not isinstance(item, dict) or item.get("metric") == alert.metric:
            continue
        rows.append(CompareRow(metric=str(item.get("metric", "?")),
                               baseline=_first(item, "baseline", "baseline_median"),
                               new=_first(item, "candidate", "new", "candidate_median", "new_median"),
                               ratio=_number(item.get("ratio")), ci_low=_number(item.get("ci_low")),
                               ci_high=_number(item.get("ci_high")), p_value=_number(item.get("p_value"))))
    return rows


def _attribution(detail: dict[str, Any]) -> list[AttributionRow]:
    """detail["attribution"] in the order the analysis wrote it (largest move first)."""
    return [AttributionRow(kernel=str(item.get("kernel", "?")), baseline_ms=_number(item.get("baseline_ms")),
                           candidate_ms=_number(item.get("candidate_ms")), delta_ms=_number(item.get("delta_ms")),
                           share=_number(item.get("share")))
            for item in detail.get("attribution") or [] if isinstance(item, dict)]


def _alert_view(alert: Alert) -> AlertView:
    detail = alert.detail or {}
    images = detail.get("images") if isinstance(detail.get("images"), dict) else {}
    return AlertView(
        id=alert.id, kind=str(alert.kind), state=str(alert.state),
        device=alert.device.serial if alert.device else None, build=alert.build.name if alert.build else None,
        baseline=alert.baseline_build.name if alert.baseline_build else None, metric=alert.metric,
        ratio=alert.ratio, ci_low=alert.ci_low, ci_high=alert.ci_high, p_value=alert.p_value,
        summary=alert.summary, note=alert.note, created_at=alert.created_at, compare=_compare_rows(alert),
        attribution=_attribution(detail),
        images={k: str(images[k]) for k in ("before", "after") if isinstance(images.get(k), str)},
        detail=detail)


def read_site_data(session: Session) -> SiteData:
    alerts = list(session.scalars(
        select(Alert).options(selectinload(Alert.device), selectinload(Alert.build),
                              selectinload(Alert.baseline_build))
        .order_by(Alert.created_at.desc(), Alert.id.desc())))
    devices = list(session.scalars(select(Device).order_by(Device.serial)))
    return SiteData(devices=[_device_view(session, d, alerts) for d in devices],
                    alerts=[_alert_view(a) for a in alerts], generated_at=dt.datetime.now(dt.UTC))


__all__ = ["AlertView", "DeviceView", "SiteData", "Trend", "read_site_data"]
