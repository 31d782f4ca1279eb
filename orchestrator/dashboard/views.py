"""What the dashboard's pages read beyond the API's plain records, as JSON-ready dicts: the
overview (every series of a headline metric, keyed as the analysis keys it, with its latest
build's median and the verdict the analysis left on it), a series' events (its alerts, the
deploys of its builds, its change points, and where the environment changed between it and
the series it continues), a series' kernels (each kernel's time per timed repetition, build by
build), a build's gallery (the images its generate jobs made), an alert's context (the series it is about, the samples before and
after, the generated images of both builds) and a device's health (GPU, runs by outcome,
recent failures, quarantine). The farm API serves them under /v1 (orchestrator/api/routes/
dashboard.py); nothing here knows HTTP."""

from __future__ import annotations

import statistics
from dataclasses import fields
from pathlib import Path
from typing import Any

from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.analysis import series as farm_series
from orchestrator.analysis import stats as rg
from orchestrator.store import Session, queries
from orchestrator.store import environment as run_env
from orchestrator.store.models import (
    Alert,
    AlertKind,
    AlertState,
    Build,
    Device,
    Image,
    RunStatus,
)

SERIES_KINDS = (AlertKind.regression, AlertKind.improvement)  # the alerts that sit on a series
RECENT_RUNS = 20
STATE_HISTORY = 30


def unit_of(metric: str) -> str:
    """A metric's unit, from its name (metric names carry their unit: unet_step_ms)."""
    for suffix, unit in (("_ms", "ms"), ("_bytes", "bytes"), ("_db", "dB"), ("_s", "s")):
        if metric.endswith(suffix):
            return unit
    return ""


def alert_series_id(alert: Alert) -> str | None:
    """The id of the series an alert's `series` key names (None when it names none: a device's
    data stoppage, or a key written before series carried every field)."""
    names = {f.name for f in fields(rg.SeriesKey)}
    try:
        return farm_series.series_id(rg.SeriesKey(**{k: v for k, v in (alert.series or {}).items() if k in names}))
    except (TypeError, ValueError):
        return None


def _alert_ref(alert: Alert) -> dict[str, Any]:
    return {"id": alert.id, "kind": str(alert.kind), "state": str(alert.state),
            "build": alert.build.name if alert.build else None,
            "baseline_build": alert.baseline_build.name if alert.baseline_build else None,
            "ratio": alert.ratio, "ci_low": alert.ci_low, "ci_high": alert.ci_high, "summary": alert.summary}


def _series_alerts(session: Session) -> dict[str, list[Alert]]:
    """Every regression and improvement alert by the id of its series, newest first."""
    by_series: dict[str, list[Alert]] = {}
    for alert in queries.list_alerts(session, states=tuple(AlertState), kinds=SERIES_KINDS):
        ident = alert_series_id(alert)
        if ident is not None:
            by_series.setdefault(ident, []).append(alert)
    return by_series


def spec_label(spec: regressions.SpecKey) -> str:
    return f"{spec.model} {spec.resolution} {spec.steps} steps {spec.precision} {spec.profile}"


# ---- the overview ---------------------------------------------------------------------------


def overview(session: Session) -> dict[str, Any]:
    """Devices, headline metrics and one cell per series: its latest build's median, its newest
    verdict as the batch analysis stored it in the series row (inconclusive and no change too),
    and the alert on it (the alert on its latest build, else its newest open alert, else none)."""
    alerts = _series_alerts(session)
    cells = []
    every = farm_series.list_series(session)  # one query: each series carries its newest point
    shown = store.build_display_names(session, [s.latest["build"] for s in every if s.latest is not None])
    for series in every:
        latest = series.latest
        if latest is None:
            continue
        on_series = alerts.get(series.id, [])
        verdict = (next((a for a in on_series if a.build_id == latest["build_id"]), None)
                   or next((a for a in on_series if a.state in regressions.OPEN_STATES), None))
        cells.append({"series_id": series.id, "device": series.key.device, "metric": series.key.metric,
                      "unit": unit_of(series.key.metric), "spec": spec_label(series.spec),
                      "environment": series.key.os_driver, "builds": series.builds, "runs": series.runs,
                      "latest": {"build": latest["build"], "display": shown.get(latest["build"], latest["build"]),
                                 "median": latest["median"], "n": latest["n"]},
                      "latest_verdict": series.verdict,
                      "verdict": _alert_ref(verdict) if verdict is not None else None,
                      "verdict_on_latest": verdict is not None and verdict.build_id == latest["build_id"]})
    held = store.active_reservations(session)  # who holds which device (`farm devices reserve`)
    devices = [{"serial": d.serial, "model": d.model, "state": str(d.state), "state_reason": d.state_reason,
                "gpu": " ".join(p for p in (d.gpu_vendor, d.gpu_device or d.gpu_architecture) if p),
                "reserved_by": held[d.id].holder if d.id in held else None,
                "reserved_until": held[d.id].until if d.id in held else None,
                "reservation_note": held[d.id].note if d.id in held else None}
               for d in queries.list_devices(session)]
    metrics = [{"metric": m, "unit": unit_of(m)} for m in regressions.HEADLINE_METRICS]
    return {"devices": devices, "metrics": metrics, "cells": cells}


# ---- a series' events -----------------------------------------------------------------------


def _environment(session: Session, series: farm_series.Series) -> dict[str, Any]:
    """What the series' newest run recorded (as the series listing labels it)."""
    device = store.get_device(session, series.device_id)
    run = store.newest_run_in(session, device.id, series.key.environment)
    return regressions.run_environment(run, device) if run is not None else store.result_environment(device)


def _same_but_environment(a: rg.SeriesKey, b: rg.SeriesKey) -> bool:
    return (a.environment != b.environment and
            (a.device, a.model, a.resolution, a.steps, a.precision, a.profile, a.metric)
            == (b.device, b.model, b.resolution, b.steps, b.precision, b.profile, b.metric))


def series_events(session: Session, series: farm_series.Series) -> dict[str, Any]:
    """The alerts on a series (every state, oldest build first) and its annotations: each
    build's deploy to the device, the change points found in it, and the environment change
    where it continues an earlier series (the same workload on the same device, measured in
    another environment before)."""
    points = farm_series.points(session, series)
    build_ids = [p["build_id"] for p in points]
    order = {b: i for i, b in enumerate(build_ids)}
    alerts = sorted((a for a in _series_alerts(session).get(series.id, []) if a.build_id in order),
                    key=lambda a: (order[a.build_id], a.id))
    names = {p["build_id"]: p["build"] for p in points}
    annotations: list[dict[str, Any]] = []
    if build_ids:
        for build_id, finished in queries.deployed_at(session, series.device_id, build_ids):
            when = f" {finished:%Y-%m-%d %H:%M} UTC" if finished is not None else ""
            annotations.append({"build": names[build_id], "kind": "deploy", "text": f"deployed{when}"})
        for cp in store.change_points_of(session, series.key.canonical(), build_ids):
            annotations.append({"build": names[cp.build_id], "kind": "change_point",
                                "text": f"change point: median {cp.median_before:.6g} -> {cp.median_after:.6g} "
                                        f"(p={cp.p_value:.2g})"})
        first = store.get_build(session, build_ids[0])
        for other in farm_series.list_series(session, store.get_device(session, series.device_id), series.key.metric):
            if not _same_but_environment(other.key, series.key):
                continue
            # Its newest two points up to this series' first build: one that is not that build is earlier.
            upto = store.series_points(session, other.id, until=(first.created, first.id), newest=2)
            if any(point.build_id != first.id for point, _ in upto):
                changes = run_env.changes(_environment(session, other), _environment(session, series))
                annotations.append({"build": names[first.id], "kind": "environment", "series_id": other.id,
                                    "text": "environment changed: " + ("; ".join(changes) or "(same fields)")})
    position = {p["build"]: i for i, p in enumerate(points)}
    annotations.sort(key=lambda a: (position[a["build"]], a["kind"]))
    return {"alerts": [_alert_ref(a) for a in alerts], "annotations": annotations}


KERNELS_SHOWN = 8  # the slowest kernels a series' kernel trend names; the rest are summed as "other"


def _compared(series: farm_series.Series, builds: list[str]) -> tuple[str, str] | None:
    """(baseline, build) whose kernels a series page compares: those of the series' newest
    verdict when both timed kernels, else its two newest builds that did; None with fewer."""
    verdict = series.verdict or {}
    if verdict.get("build") in builds and verdict.get("baseline_build") in builds:
        return verdict["baseline_build"], verdict["build"]
    return (builds[-2], builds[-1]) if len(builds) >= 2 else None


def series_kernels(session: Session, series: farm_series.Series) -> dict[str, Any]:
    """Where a series' time goes, build by build: for each of its builds (oldest first) and each
    kernel, the kernel's total time in one timed repetition (its calls summed), averaged over the
    repetitions of the series' runs of that build (the runs its points are made of: this
    device, workload and environment, no check's). The KERNELS_SHOWN kernels slowest in the
    newest build are named, and so is every kernel that moved between the two builds compared
    (_compared: its newest verdict's), which `moves` lists, biggest change first, as an alert's
    attribution does (regressions.moves_of); the rest are summed as "other"; a kernel a build
    did not run is None."""
    timings: dict[int, list[tuple[int, int, str, float]]] = {}
    for build_id, run_id, repetition, kernel, ms in store.series_kernel_timings(session, series.id):  # one query
        timings.setdefault(build_id, []).append((run_id, repetition, kernel, ms))
    builds: list[str] = []
    per_build: list[dict[str, float]] = []
    repetition_totals: dict[str, dict[str, list[float]]] = {}  # build -> kernel -> its total in each repetition
    for point, name in store.series_points(session, series.id):
        totals: dict[tuple[int, int, str], float] = {}
        for run_id, repetition, kernel, ms in timings.get(point.build_id, []):
            totals[(run_id, repetition, kernel)] = totals.get((run_id, repetition, kernel), 0.0) + ms
        repetitions = {(run_id, rep) for run_id, rep, _ in totals}
        if not repetitions:
            continue
        means: dict[str, float] = {}
        by_kernel: dict[str, list[float]] = {}
        for (_, _, kernel), ms in totals.items():
            means[kernel] = means.get(kernel, 0.0) + ms / len(repetitions)
            by_kernel.setdefault(kernel, []).append(ms)
        builds.append(name)
        per_build.append(means)
        repetition_totals[name] = by_kernel
    if not per_build:
        return {"unit": "ms", "builds": [], "kernels": [], "compared": None, "moves": []}
    compared = _compared(series, builds)
    moves = regressions.moves_of(*(repetition_totals[b] for b in compared)) if compared else []
    moved = {m["kernel"] for m in moves}
    newest = per_build[-1]
    every = {k for means in per_build for k in means}
    ranked = sorted(every, key=lambda k: (-newest.get(k, 0.0), k))
    shown = [k for i, k in enumerate(ranked) if i < KERNELS_SHOWN or k in moved]  # a kernel that moved is named
    rest = [k for k in ranked if k not in set(shown)]
    kernels = [{"kernel": k, "ms": [means.get(k) for means in per_build]} for k in shown]
    if rest:
        kernels.append({"kernel": f"other ({len(rest)} kernels)",
                        "ms": [sum(means.get(k, 0.0) for k in rest) for means in per_build]})
    return {"unit": "ms", "builds": builds, "kernels": kernels, "moves": moves,
            "compared": {"baseline_build": compared[0], "build": compared[1]} if compared else None}


# ---- an alert's context ---------------------------------------------------------------------


def _image_ref(image: Image, build: str | None) -> dict[str, Any]:
    suffix = Path(image.path).suffix.lower() or ".png"
    return {"id": image.id, "url": f"/v1/images/{image.id}", "file": f"{image.id}{suffix}", "build": build,
            "prompt": image.prompt, "seed": image.seed, "sha256": image.sha256}


def _generated_image(session: Session, device_id: int, build: Build, spec: regressions.SpecKey) -> Image | None:
    """The newest image a generate job of `spec` made with `build` on the device."""
    return next((image for image, job_spec in store.generated_images(session, device_id, build.id) if regressions.SpecKey.of(job_spec or {}) == spec), None)


def _images(session: Session, alert: Alert) -> dict[str, dict[str, Any] | None]:
    """A fidelity alert's two images as it names them; for a latency alert, the images its build
    and its baseline generated for the same workload on the device, where they did."""
    sides = {"before": alert.baseline_build, "after": alert.build}
    named = (alert.detail or {}).get("images")
    found: dict[str, Image | None] = {}
    if isinstance(named, dict):
        for side in sides:
            path = named.get(side)
            found[side] = store.image_at(session, path) if isinstance(path, str) else None
    elif alert.device_id is not None:
        series = alert.series or {}
        spec = regressions.SpecKey.of({"model": series.get("model", ""), "steps": series.get("steps", 20),
                                    "precision": series.get("precision", "fp16"),
                                    "profile": series.get("profile", "auto")})
        spec = regressions.SpecKey(spec.model, str(series.get("resolution", "native")), spec.steps, spec.precision,
                                spec.profile)
        for side, build in sides.items():
            found[side] = _generated_image(session, alert.device_id, build, spec) if build is not None else None
    return {side: (_image_ref(image, sides[side].name if sides[side] else None) if image is not None else None)
            for side, image in found.items()} or {"before": None, "after": None}


def build_gallery(session: Session, build: Build) -> dict[str, Any]:
    """Every image a generate job made with `build` (a check's included), newest first, each
    with the device, workload and job it came from."""
    rows = store.images_of_build(session, build.id)
    return {"build": build.name, "created": build.created,
            "images": [_image_ref(image, build.name) | {"device": serial, "job": job_id,
                                                          "workload": spec_label(regressions.SpecKey.of(job_spec or {}))}
                       for image, job_spec, job_id, serial in rows]}


def _side(points: list[dict[str, Any]], build_id: int | None) -> dict[str, Any] | None:
    point = next((p for p in points if p["build_id"] == build_id), None)
    if point is None:
        return None
    return {"build": point["build"], "n": point["n"], "median": statistics.median(point["values"]),
            "values": point["values"]}


def alert_context(session: Session, alert: Alert) -> dict[str, Any]:
    """The series an alert is about (its id, when the series still has points), the samples of
    its baseline and its build in that series, and the images before and after."""
    ident = alert_series_id(alert)
    try:
        series = farm_series.get_series(session, ident) if ident else None
    except store.StoreError:  # its series has no points any more
        series = None
    sides = [b for b in (alert.baseline_build_id, alert.build_id) if b is not None]
    points = farm_series.points(session, series, builds=sides) if series is not None else []
    return {"series_id": series.id if series is not None else None, "unit": unit_of(alert.metric or ""),
            "before": _side(points, alert.baseline_build_id), "after": _side(points, alert.build_id),
            "images": _images(session, alert)}


def image_file(session: Session, image_id: int, data_dir: Path) -> Path:
    """Where a stored image's file is (a relative path is under the farm's data directory);
    StoreError when the image or its file is gone."""
    image = store.get_image(session, image_id)
    path = Path(image.path)
    path = path if path.is_absolute() else data_dir / path
    if not path.is_file():
        raise store.StoreError(f"image {image_id}'s file is gone: {image.path}")
    return path


# ---- a device's health ----------------------------------------------------------------------


def device_health(session: Session, device: Device) -> dict[str, Any]:
    """Runs by outcome and the failure rate, the newest runs, the device's quarantine (its state
    and reason now, and the alerts raised about it that were not about a build) and its newest
    STATE_HISTORY state changes."""
    counts = queries.run_counts(session, device.id)
    total = sum(counts.values())
    recent = queries.recent_runs(session, device.id, RECENT_RUNS)
    stoppages = queries.list_alerts(session, states=tuple(AlertState), kinds=(AlertKind.data_stoppage,),
                                    device_id=device.id)
    history = queries.state_changes(session, device.id, STATE_HISTORY)
    return {"serial": device.serial,
            "runs": {str(s): counts.get(s, 0) for s in RunStatus}, "total_runs": total,
            "failure_rate": counts.get(RunStatus.failed, 0) / total if total else None,
            "state": str(device.state), "state_reason": device.state_reason,
            "infra_failures_in_row": device.infra_failures_in_row, "probe_failures": device.probe_failures,
            "last_run_finished": max((r.finished_at for r in recent if r.finished_at), default=None),
            "recent": [{"run_id": r.id, "status": str(r.status), "error": r.error, "kind": str(r.kind),
                        "build": r.name, "started_at": r.started_at.isoformat() if r.started_at else None,
                        "finished_at": r.finished_at.isoformat() if r.finished_at else None} for r in recent],
            "stoppages": [_alert_ref(a) for a in stoppages],
            "history": [{"at": c.at.isoformat(), "from_state": c.from_state, "to_state": c.to_state, "event": c.event,
                         "reason": c.reason} for c in history]}
