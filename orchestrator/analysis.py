"""The regression analysis of a finished batch, on the store: for every latency run of the
batch's build, each headline metric's samples against its series' baseline (the newest earlier
build on the same series that has no open regression alert there), with thermally flagged runs
left out; regressions and improvements become alerts, with the kernels that moved most
attributed for latency; an inconclusive comparison asks for more repetitions (bounded);
generated images are checked against the series' previous image (fidelity); devices that stop
reporting raise a data-stoppage alert. The statistics are orchestrator/regression's pure
functions; this module only fetches and records. Every function takes a session and flushes;
the caller commits."""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from orchestrator import regression as rg
from orchestrator.db import store
from orchestrator.db.models import (
    Alert,
    AlertKind,
    AlertState,
    Batch,
    Build,
    Device,
    Image,
    Job,
    JobKind,
    JobState,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    SeriesSetting,
    ThermalReading,
    utcnow,
)

# metric -> higher is worse. The analysis compares these; the rest are stored and charted.
HEADLINE_METRICS = {"unet_step_ms": True, "e2e_ms": True, "peak_gpu_bytes": True}
LATENCY_METRICS = ("unet_step_ms", "e2e_ms")
DEFAULT_MIN_EFFECT = 0.03
OPEN_STATES = (AlertState.new, AlertState.acknowledged)
STOPPAGE_AFTER = dt.timedelta(hours=48)  # a device silent this long after reporting raises an alert


@dataclass(frozen=True)
class SpecKey:
    """The job-spec part of a series key (everything but device and metric)."""

    model: str
    resolution: str
    steps: int
    precision: str
    profile: str  # as the job asked for it ("auto" follows the build's default)

    @classmethod
    def of(cls, spec: dict[str, Any]) -> SpecKey:
        height, width = spec.get("height"), spec.get("width")
        resolution = f"{width}x{height}" if height and width else "native"
        return cls(str(spec.get("model", "")), resolution, int(spec.get("steps", 20)),
                   str(spec.get("precision", "fp16")), str(spec.get("profile", "auto")))


def series_key(device: Device, spec: SpecKey, metric: str) -> rg.SeriesKey:
    os_driver = " / ".join(p for p in (f"{device.os} {device.os_version}".strip(), device.gpu_driver) if p)
    return rg.SeriesKey(device=device.serial, os_driver=os_driver, model=spec.model, resolution=spec.resolution,
                        steps=spec.steps, precision=spec.precision, profile=spec.profile, metric=metric)


def min_effect(session: Session, key: rg.SeriesKey) -> float:
    setting = session.scalar(select(SeriesSetting).where(SeriesSetting.series_key == key.canonical()))
    return setting.min_effect if setting is not None else DEFAULT_MIN_EFFECT


def set_min_effect(session: Session, key: rg.SeriesKey, value: float) -> None:
    if not 0 < value < 1:
        raise store.StoreError(f"minimum effect {value} must be between 0 and 1 (0.03 = 3%)")
    setting = session.scalar(select(SeriesSetting).where(SeriesSetting.series_key == key.canonical()))
    if setting is None:
        session.add(SeriesSetting(series_key=key.canonical(), min_effect=value))
    else:
        setting.min_effect = value
    session.flush()


# ---- fetching -----------------------------------------------------------------------------


def runs_of(session: Session, device_id: int, build_id: int, kind: JobKind, spec: SpecKey | None = None) -> list[Run]:
    """Succeeded runs of `kind` jobs of a build on a device (with that spec key, when given)."""
    rows = session.execute(
        select(Run, Job.spec).join(Job, Job.id == Run.job_id)
        .where(Run.device_id == device_id, Run.build_id == build_id, Run.status == RunStatus.succeeded,
               Job.kind == kind).order_by(Run.id)).all()
    return [run for run, job_spec in rows if spec is None or SpecKey.of(job_spec or {}) == spec]


def _flagged(session: Session, runs: list[Run]) -> dict[int, rg.ThermalFlag]:
    readings = defaultdict(list)
    for t in session.scalars(select(ThermalReading).where(ThermalReading.run_id.in_([r.id for r in runs]))):
        readings[t.run_id].append(rg.ThermalReading(t.phase, t.zone, t.celsius))
    return {r.id: rg.thermal_flag(cooldown_timed_out=r.cooldown_timed_out, readings=readings[r.id]) for r in runs}


def _samples(session: Session, key: rg.SeriesKey, runs: list[Run]) -> list[rg.SeriesSample]:
    rows = session.execute(select(Sample.run_id, Sample.unit, Sample.value).where(
        Sample.run_id.in_([r.id for r in runs]), Sample.metric == key.metric).order_by(Sample.id))
    return [rg.SeriesSample(key, unit, value, run_id) for run_id, unit, value in rows]


def _kernels(session: Session, runs: list[Run]) -> dict[str, list[float]]:
    """kernel -> its total ms in each (run, repetition)."""
    out: dict[str, list[float]] = defaultdict(list)
    rows = session.execute(select(KernelTiming.kernel, KernelTiming.total_ms).where(
        KernelTiming.run_id.in_([r.id for r in runs])).order_by(KernelTiming.run_id, KernelTiming.repetition))
    for kernel, total in rows:
        out[kernel].append(total)
    return out


def op_of(kernel: str) -> str:
    """The op a kernel belongs to: "attention/flash" -> attention, "conv2d" -> conv2d. The
    reference attention runs its softmax as a kernel of its own, so "softmax" is attention's."""
    op = kernel.split("/")[0]
    return "attention" if op == "softmax" else op


def _by_op(kernels: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per-kernel totals per (run, repetition) summed into per-op totals."""
    ops: dict[str, list[float]] = {}
    for kernel, totals in kernels.items():
        acc = ops.setdefault(op_of(kernel), [0.0] * len(totals))
        if len(acc) != len(totals):  # a kernel absent from some repetitions: keep what lines up
            acc.extend([0.0] * (len(totals) - len(acc)))
        for i, total in enumerate(totals):
            acc[i] += total
    return ops


def _before(build: Build):
    """SQL condition: a Build made before `build` (creation time, then id)."""
    return (Build.created < build.created) | ((Build.created == build.created) & (Build.id < build.id))


def _earlier_builds(session: Session, build: Build) -> list[Build]:
    return list(session.scalars(select(Build).where(_before(build)).order_by(Build.created.desc(), Build.id.desc())))


def _has_open_regression(session: Session, build_id: int, device_id: int, key: rg.SeriesKey) -> bool:
    alerts = session.scalars(select(Alert).where(
        Alert.build_id == build_id, Alert.device_id == device_id, Alert.kind == AlertKind.regression,
        Alert.state.in_(OPEN_STATES)))
    spec_part = {k: v for k, v in key.as_dict().items() if k != "metric"}
    return any({k: v for k, v in a.series.items() if k != "metric"} == spec_part for a in alerts)


def baseline_build(session: Session, build: Build, device: Device, spec: SpecKey,
                   key: rg.SeriesKey) -> tuple[Build, list[Run]] | None:
    """The newest earlier build with latency runs on this series and no open regression alert
    on it (the last accepted build), with those runs."""
    for earlier in _earlier_builds(session, build):
        runs = runs_of(session, device.id, earlier.id, JobKind.latency, spec)
        if runs and not _has_open_regression(session, earlier.id, device.id, key):
            return earlier, runs
    return None


# ---- comparing ----------------------------------------------------------------------------


def compare_builds(session: Session, device: Device, spec: SpecKey, metric: str, baseline: Build,
                   baseline_runs: list[Run], candidate: Build, candidate_runs: list[Run],
                   include_flagged: bool = False) -> dict[str, Any] | None:
    """One metric of two builds on one device and spec: the comparison, as a dict; None when
    neither build measured it."""
    key = series_key(device, spec, metric)
    base_samples, cand_samples = _samples(session, key, baseline_runs), _samples(session, key, candidate_runs)
    if not base_samples and not cand_samples:
        return None
    flags = _flagged(session, baseline_runs + candidate_runs)
    flagged = [run_id for run_id, flag in flags.items() if flag.flagged]
    base = rg.check_series(base_samples, flagged_runs=flagged, include_flagged=include_flagged)
    cand = rg.check_series(cand_samples, flagged_runs=flagged, include_flagged=include_flagged)
    if base.unit != cand.unit:
        raise ValueError(f"{metric}: baseline in {base.unit}, candidate in {cand.unit}: refusing to compare")
    drift, drift_runs = series_drift(session, device, spec, metric, candidate)
    comparison = rg.compare(base.values, cand.values, baseline_runs=base.run_ids, candidate_runs=cand.run_ids,
                            drift=drift, min_effect=min_effect(session, key),
                            higher_is_worse=HEADLINE_METRICS.get(metric, True))
    return {"device": device.serial, "metric": metric, "unit": cand.unit, "series": key.as_dict(),
            "baseline_build": baseline.name, "candidate_build": candidate.name,
            "drift_source": f"estimated from {drift_runs} earlier runs" if drift_runs else "default",
            "excluded_runs": sorted(set(base.excluded_runs) | set(cand.excluded_runs)),
            "thermal": {run_id: list(flags[run_id].reasons) for run_id in flagged}} | comparison.as_dict()


DRIFT_HISTORY_RUNS = 30  # the newest earlier runs the drift is estimated from


def series_drift(session: Session, device: Device, spec: SpecKey, metric: str, candidate: Build) -> tuple[float, int]:
    """(drift, runs used): the series' run-to-run drift, estimated (rg.estimate_drift) from the
    newest DRIFT_HISTORY_RUNS runs of builds before `candidate` on this device and spec, runs
    flagged for their thermal state left out, and runs of builds with an open regression alert
    on the series left out too: they are not part of the accepted series (baseline_build skips
    them alike), and their steps are no drift. With the demo's A, B, A, B, ... builds (B 2x
    slower) they made every consecutive pair a step, estimated a drift near 100% and turned
    B's regression and A's sameness into "inconclusive" (CI 0.15-29). (rg.DEFAULT_DRIFT, 0)
    with too little history."""
    rows = session.execute(
        select(Run, Job.spec).join(Job, Job.id == Run.job_id).join(Build, Build.id == Run.build_id)
        .where(Run.device_id == device.id, _before(candidate), Run.status == RunStatus.succeeded, Job.kind == JobKind.latency)
        .order_by(Run.id.desc()).limit(20 * DRIFT_HISTORY_RUNS)).all()  # other specs' runs are filtered below
    key, rejected = series_key(device, spec, metric), {}
    runs = []
    for run, job_spec in rows:
        if SpecKey.of(job_spec or {}) != spec:
            continue
        if run.build_id not in rejected:
            rejected[run.build_id] = _has_open_regression(session, run.build_id, device.id, key)
        if not rejected[run.build_id]:
            runs.append(run)
    runs = runs[:DRIFT_HISTORY_RUNS]
    flags = _flagged(session, runs)
    runs = [run for run in reversed(runs) if not flags[run.id].flagged]  # oldest first
    values: dict[int, list[float]] = defaultdict(list)
    for run_id, value in session.execute(select(Sample.run_id, Sample.value).where(
            Sample.run_id.in_([r.id for r in runs]), Sample.metric == metric).order_by(Sample.id)):
        values[run_id].append(value)
    history = [values[r.id] for r in runs if values[r.id]]
    drift = rg.estimate_drift(history)
    return (rg.DEFAULT_DRIFT, 0) if drift is None else (drift, len(history))


def analyze_batch(session: Session, batch_id: int, now: dt.datetime | None = None) -> dict[str, Any]:
    """Compare, alert and ask for more repetitions for batch `batch_id` (flushes only). Returns
    {"comparisons": [...], "alerts": [ids], "more_repetitions": [{device, spec, repetitions}],
    "fidelity": [...], "stoppages": [ids]}."""
    batch = store.get_batch(session, batch_id)
    report: dict[str, Any] = {"comparisons": [], "alerts": [], "more_repetitions": [], "fidelity": [],
                              "stoppages": []}
    if batch.build_id is None:
        return report
    build = session.get(Build, batch.build_id)
    jobs = list(session.scalars(select(Job).where(Job.batch_id == batch_id)))
    # A more-repetitions batch also reruns the baseline build; its jobs are not candidates.
    pairs = {(job.device_id, SpecKey.of(job.spec or {})): job for job in jobs
             if job.kind == JobKind.latency and job.build_id == build.id}
    for (device_id, spec), job in sorted(pairs.items(), key=lambda kv: kv[1].id):
        device = session.get(Device, device_id)
        candidate_runs = runs_of(session, device_id, build.id, JobKind.latency, spec)
        if not candidate_runs:
            continue
        first_key = series_key(device, spec, next(iter(HEADLINE_METRICS)))
        found = baseline_build(session, build, device, spec, first_key)
        if found is None:
            report["comparisons"].append({"device": device.serial, "candidate_build": build.name,
                                          "verdict": "no baseline", "reason": "first build on this series"})
            continue
        baseline, baseline_runs = found
        more = 0
        for metric in HEADLINE_METRICS:
            try:
                result = compare_builds(session, device, spec, metric, baseline, baseline_runs, build,
                                        candidate_runs)
            except ValueError as exc:  # mixed units or keys, no samples: refused, not averaged
                report["comparisons"].append({"device": device.serial, "metric": metric,
                                              "verdict": "refused", "reason": str(exc)})
                continue
            if result is None:
                continue
            report["comparisons"].append(result)
            if result["verdict"] in ("regression", "improvement"):
                alert = _record_alert(session, batch, build, baseline, device, spec, result,
                                      baseline_runs, candidate_runs)
                report["alerts"].append(alert.id)
            elif result["verdict"] == "inconclusive":
                more = max(more, result["more_repetitions_suggested"])
        if more:
            report["more_repetitions"].append({"device": device.serial, "spec": dict(job.spec or {}),
                                               "repetitions": more, "baseline_build": baseline.id})
    report["fidelity"] = _check_fidelity(session, batch, build, jobs, report["alerts"])
    report["stoppages"] = raise_stoppages(session, now or utcnow())
    return report


def _record_alert(session: Session, batch: Batch, build: Build, baseline: Build, device: Device, spec: SpecKey,
                  result: dict[str, Any], baseline_runs: list[Run], candidate_runs: list[Run]) -> Alert:
    """A regression or improvement alert for one series and build; the same finding again
    (a more-repetitions round) updates it instead of adding another."""
    kind = AlertKind(result["verdict"])
    detail: dict[str, Any] = {
        "baseline_median": result["baseline_median"], "candidate_median": result["candidate_median"],
        "n_baseline": result["n_baseline"], "n_candidate": result["n_candidate"], "unit": result["unit"],
        "reason": result["reason"], "min_effect": result["min_effect"], "excluded_runs": result["excluded_runs"],
    }
    if result["metric"] in LATENCY_METRICS:
        moves = rg.attribute(_kernels(session, baseline_runs), _kernels(session, candidate_runs))
        detail["attribution"] = [{"kernel": m.kernel, "baseline_ms": m.baseline_ms, "candidate_ms": m.candidate_ms,
                                  "delta_ms": m.delta_ms, "share": m.share} for m in moves]
        by_op = rg.attribute(_by_op(_kernels(session, baseline_runs)), _by_op(_kernels(session, candidate_runs)))
        detail["attribution_by_op"] = [{"op": m.kernel, "baseline_ms": m.baseline_ms, "candidate_ms": m.candidate_ms,
                                        "delta_ms": m.delta_ms, "share": m.share} for m in by_op]
    history = series_history(session, device, spec, result["metric"], until=build)
    if len(history) >= 2:
        points = rg.detect_change_points([h["values"] for h in history])
        detail["change_points"] = [{"build": history[p.index]["build"], "ratio": p.ratio, "p_value": p.p_value}
                                   for p in points]
    change = (result["ratio"] - 1) * 100
    summary = (f"{result['metric']} {'+' if change >= 0 else ''}{change:.1f}% on {device.serial}: "
               f"{build.name} vs {baseline.name} (ratio {result['ratio']:.3f}, "
               f"{result['confidence'] * 100:.0f}% CI {result['ci_low']:.3f}-{result['ci_high']:.3f}, "
               f"p={result['p_value']:.2g})")
    existing = session.scalar(select(Alert).where(Alert.build_id == build.id, Alert.device_id == device.id,
                                                  Alert.kind == kind, Alert.metric == result["metric"]))
    alert = existing or Alert(kind=kind, build_id=build.id, device_id=device.id, metric=result["metric"])
    alert.baseline_build_id, alert.batch_id, alert.series = baseline.id, batch.id, result["series"]
    alert.ratio, alert.ci_low, alert.ci_high, alert.p_value = (result["ratio"], result["ci_low"], result["ci_high"],
                                                               result["p_value"])
    alert.summary, alert.detail, alert.updated_at = summary, detail, utcnow()
    if existing is None:
        session.add(alert)
    session.flush()
    return alert


def job_spec(session: Session, run: Run) -> dict[str, Any]:
    """The spec of the job a run belongs to."""
    return session.get(Job, run.job_id).spec or {}


def series_history(session: Session, device: Device, spec: SpecKey, metric: str,
                   until: Build | None = None) -> list[dict[str, Any]]:
    """Every build's samples of one series on one device, in build order: [{build, values}]."""
    rows = session.execute(
        select(Build.name, Build.created, Build.id, Sample.value, Job.spec)
        .join(Run, Run.build_id == Build.id).join(Job, Job.id == Run.job_id).join(Sample, Sample.run_id == Run.id)
        .where(Run.device_id == device.id, Run.status == RunStatus.succeeded, Job.kind == JobKind.latency,
               Sample.metric == metric)
        .order_by(Build.created, Build.id, Sample.id)).all()
    history: dict[int, dict[str, Any]] = {}
    for name, created, build_id, value, job_spec in rows:
        if until is not None and (created, build_id) > (until.created, until.id):
            continue
        if SpecKey.of(job_spec or {}) == spec:
            history.setdefault(build_id, {"build": name, "values": []})["values"].append(value)
    return list(history.values())


# ---- fidelity and stoppages ---------------------------------------------------------------


def _check_fidelity(session: Session, batch: Batch, build: Build, jobs: list[Job], alerts: list[int]) -> list[dict]:
    """Each generated image against the newest earlier build's image of the same device, spec,
    prompt and seed; a change beyond the tolerance is a fidelity alert."""
    results = []
    for job in jobs:
        if job.kind != JobKind.generate:
            continue
        image = session.scalar(select(Image).join(Run, Run.id == Image.run_id).where(
            Run.job_id == job.id, Run.status == RunStatus.succeeded).order_by(Run.attempt.desc()).limit(1))
        if image is None:
            continue
        spec = job.spec or {}
        previous = _previous_image(session, job, build, spec)
        if previous is None:
            continue
        device = session.get(Device, job.device_id)
        try:
            check = rg.compare_images(previous.path, image.path)
        except (OSError, ValueError) as exc:
            results.append({"device": device.serial, "job": job.id, "error": str(exc)})
            continue
        entry = {"device": device.serial, "job": job.id, "psnr_db": check.psnr_db, "changed": check.changed,
                 "before": previous.path, "after": image.path}
        results.append(entry)
        if check.changed:
            key = series_key(device, SpecKey.of(spec), "image_psnr_db")
            previous_build = session.get(Build, session.get(Run, previous.run_id).build_id)
            alert = Alert(kind=AlertKind.fidelity, build_id=build.id, device_id=device.id, batch_id=batch.id,
                          baseline_build_id=previous_build.id if previous_build else None, metric="image_psnr_db",
                          series=key.as_dict() | {"prompt": spec.get("prompt", ""), "seed": spec.get("seed", 0)},
                          summary=f"image changed on {device.serial}: PSNR {check.psnr_db:.1f} dB against "
                                  f"{previous_build.name if previous_build else 'the previous build'}",
                          detail={"psnr_db": check.psnr_db, "images": {"before": previous.path, "after": image.path}})
            session.add(alert)
            session.flush()
            alerts.append(alert.id)
    return results


def _previous_image(session: Session, job: Job, build: Build, spec: dict[str, Any]) -> Image | None:
    wanted = (SpecKey.of(spec), spec.get("prompt", ""), spec.get("seed", 0))
    for earlier in _earlier_builds(session, build):
        rows = session.execute(select(Image, Job.spec).join(Run, Run.id == Image.run_id).join(Job, Job.id == Run.job_id)
                               .where(Run.device_id == job.device_id, Run.build_id == earlier.id,
                                      Job.kind == JobKind.generate, Run.status == RunStatus.succeeded)
                               .order_by(Image.id.desc())).all()
        for image, other in rows:
            other = other or {}
            if (SpecKey.of(other), other.get("prompt", ""), other.get("seed", 0)) == wanted:
                return image
    return None


def raise_stoppages(session: Session, now: dt.datetime) -> list[int]:
    """A data-stoppage alert for each device that reported before but not for STOPPAGE_AFTER
    (one open alert per device)."""
    created = []
    # When the control plane last heard a result from each device (its own clock, not the device's).
    last = session.execute(select(Job.device_id, func.max(Job.finished_at))
                           .where(Job.state.in_([JobState.succeeded, JobState.failed]))
                           .group_by(Job.device_id)).all()
    for device_id, finished in last:
        if finished is None or now - finished < STOPPAGE_AFTER:
            continue
        open_alert = session.scalar(select(Alert.id).where(
            Alert.device_id == device_id, Alert.kind == AlertKind.data_stoppage, Alert.state.in_(OPEN_STATES)))
        if open_alert is not None:
            continue
        device = session.get(Device, device_id)
        hours = (now - finished).total_seconds() / 3600
        alert = Alert(kind=AlertKind.data_stoppage, device_id=device_id, metric="", series={"device": device.serial},
                      summary=f"{device.serial} has not reported for {hours:.0f} h (last run {finished:%Y-%m-%d %H:%M} UTC)",
                      detail={"last_run_finished": finished.isoformat(), "state": str(device.state)})
        session.add(alert)
        session.flush()
        created.append(alert.id)
    return created
