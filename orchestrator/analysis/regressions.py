"""The regression analysis of a finished batch, on the store: for every latency run of the
batch's build, each headline metric's samples against its series' baseline (the newest earlier
build on the same series that has no open regression alert there, measured in the environment
the candidate's runs recorded where such a build exists), with thermally flagged runs left out;
a comparison across an environment change (a phone update, a new driver) says so in its verdict
and its alert, and asks for the baseline to be measured again in the new environment;
regressions and improvements become alerts, with the kernels that moved most attributed for
latency; an inconclusive comparison asks for more repetitions (bounded; always when its cause
is the sample count);
generated images are checked against the series' previous image (fidelity); devices that stop
reporting raise a data-stoppage alert. The statistics are orchestrator/analysis/stats's pure
functions; this module only fetches and records. Every function takes a session and flushes;
the caller commits."""

from __future__ import annotations

import datetime as dt
import json
from collections import defaultdict
from typing import Any

from orchestrator import store
from orchestrator.analysis import stats as rg
from orchestrator.analysis.keys import (  # noqa: F401  (the keys, named from here too)
    HEADLINE_METRICS,
    SERIES_ID_CHARS,
    SpecKey,
    env_key_of,
    run_environment,
    series_ident,
    series_key,
)
from orchestrator.analysis.series_state import catch_up, record_verdict
from orchestrator.analysis.stats.compare import MIN_SAMPLES
from orchestrator.store import Session, queries
from orchestrator.store import environment as run_env
from orchestrator.store.models import (
    BATCH_CHECK,
    Alert,
    AlertKind,
    AlertState,
    Batch,
    Build,
    Device,
    Image,
    Job,
    JobKind,
    Run,
    utcnow,
)

LATENCY_METRICS = ("unet_step_ms", "e2e_ms")
DEFAULT_MIN_EFFECT = 0.03
OPEN_STATES = store.OPEN_ALERT_STATES
# The builds of a series change-point detection looks at: the newest so many (an alert's
# context, the nightly scan's tail), so that neither grows with the series' age.
CHANGE_POINT_WINDOW = 90
STOPPAGE_AFTER = dt.timedelta(hours=48)  # a device silent this long after reporting raises an alert


def _series_setting(session: Session, key: rg.SeriesKey, field: str) -> float | None:
    """A series setting's `field` (min_effect or drift): set for this series in this
    environment, else set for it in any environment (the newest such setting: a driver update
    keeps the series' tolerance), else None."""
    setting = store.series_setting(session, key.canonical())
    if setting is not None and getattr(setting, field) is not None:
        return getattr(setting, field)
    wanted = key.in_any_environment()
    device_part = json.dumps({"device": key.device}, separators=(",", ":"), ensure_ascii=False)[1:-1]
    found = None
    for other in store.series_settings_naming(session, device_part):
        try:
            if getattr(other, field) is not None and rg.SeriesKey.parse(other.series_key).in_any_environment() == wanted:
                found = other
        except ValueError:  # not a key this version reads: not this series
            continue
    return getattr(found, field) if found is not None else None


def min_effect(session: Session, key: rg.SeriesKey) -> float:
    """The series' minimum effect (a series setting, else DEFAULT_MIN_EFFECT)."""
    value = _series_setting(session, key, "min_effect")
    return DEFAULT_MIN_EFFECT if value is None else value


def drift_prior(session: Session, key: rg.SeriesKey) -> float | None:
    """The run-to-run drift set for the series (a series setting), which the analysis assumes
    until the series' history is long enough to estimate its own; None: not set."""
    return _series_setting(session, key, "drift")


def set_min_effect(session: Session, key: rg.SeriesKey, value: float) -> None:
    if not 0 < value < 1:
        raise store.StoreError(f"minimum effect {value} must be between 0 and 1 (0.03 = 3%)")
    store.set_series_setting(session, key.canonical(), min_effect=value)


def set_drift(session: Session, key: rg.SeriesKey, value: float) -> None:
    """Assume `value` run-to-run drift (0.1 = 10% a run) on the series until its history
    estimates its own: for devices known to move from one run to the next by more than
    DEFAULT_DRIFT (several devices sharing one machine's CPU, a phone without fixed clocks)."""
    if not 0 <= value < 1:
        raise store.StoreError(f"drift {value} must be in [0, 1) (0.01 = 1% a run)")
    store.set_series_setting(session, key.canonical(), drift=value)


# ---- fetching -----------------------------------------------------------------------------


def runs_of(session: Session, device_id: int, build_id: int, kind: JobKind, spec: SpecKey | None = None, *,
            checks: bool = False) -> list[Run]:
    """Succeeded runs of `kind` jobs of a build on a device (with that spec key, when given): the
    series' runs, and with `checks` also those of `farm check`s."""
    rows = store.runs_with_specs(session, device_id, build_id, kind, checks=checks)
    return [run for run, job_spec in rows if spec is None or SpecKey.of(job_spec or {}) == spec]


def _flagged(session: Session, runs: list[Run]) -> dict[int, rg.ThermalFlag]:
    readings = defaultdict(list)
    for t in store.thermal_readings_of(session, [r.id for r in runs]):
        readings[t.run_id].append(rg.ThermalReading(t.phase, t.zone, t.celsius))
    return {r.id: rg.thermal_flag(cooldown_timed_out=r.cooldown_timed_out, readings=readings[r.id]) for r in runs}


def _samples(session: Session, key: rg.SeriesKey, runs: list[Run]) -> list[rg.SeriesSample]:
    return [rg.SeriesSample(key, unit, value, run_id)
            for run_id, unit, value in store.samples_of(session, [r.id for r in runs], key.metric)]


def _kernels(session: Session, runs: list[Run]) -> dict[str, list[float]]:
    """kernel -> its total ms in each (run, repetition)."""
    out: dict[str, list[float]] = defaultdict(list)
    for _, _, kernel, total in store.kernel_timings_of(session, [r.id for r in runs]):
        out[kernel].append(total)
    return out


KERNELS_MOVED = 10  # the kernels an alert and a series page name as the ones that moved


def moves_of(baseline: dict[str, list[float]], candidate: dict[str, list[float]],
             top: int | None = KERNELS_MOVED) -> list[dict[str, Any]]:
    """The kernels whose timings moved most between two builds (kernel -> its total ms in each
    repetition: rg.attribute), biggest absolute change first, as dicts: what an alert's
    attribution and a series page's "kernels that moved" both show."""
    return [{"kernel": m.kernel, "baseline_ms": m.baseline_ms, "candidate_ms": m.candidate_ms,
             "delta_ms": m.delta_ms, "share": m.share} for m in rg.attribute(baseline, candidate, top=top)]


def kernel_moves(session: Session, baseline_runs: list[Run], candidate_runs: list[Run],
                 top: int | None = KERNELS_MOVED) -> list[dict[str, Any]]:
    """The kernels whose timings moved most between two builds' runs (moves_of); empty when
    the runs timed no kernels."""
    return moves_of(_kernels(session, baseline_runs), _kernels(session, candidate_runs), top=top)


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


_NOT_SPEC = ("metric", "os_driver", "environment")


def _same_workload(series: dict[str, Any], key: rg.SeriesKey) -> bool:
    """Whether an alert's series is `key`'s device and workload, in whichever environment."""
    mine = {k: v for k, v in key.as_dict().items() if k not in _NOT_SPEC}
    return {k: v for k, v in (series or {}).items() if k not in _NOT_SPEC} == mine


def _has_open_regression(session: Session, build_id: int, device_id: int, key: rg.SeriesKey) -> bool:
    """Whether the build has an open regression alert on this device and workload. An alert
    raised across an environment change does not count: it does not say the build is worse."""
    alerts = queries.list_alerts(session, states=OPEN_STATES, kinds=(AlertKind.regression,), device_id=device_id,
                                 build_id=build_id)
    return any(_same_workload(a.series, key) and not (a.detail or {}).get("environment_change") for a in alerts)


def _builds_with_open_regressions(session: Session, device_id: int, key: rg.SeriesKey) -> set[int]:
    """The builds _has_open_regression holds true of on this device and workload, in one query."""
    alerts = queries.list_alerts(session, states=OPEN_STATES, kinds=(AlertKind.regression,), device_id=device_id)
    return {a.build_id for a in alerts
            if _same_workload(a.series, key) and not (a.detail or {}).get("environment_change")}


def baseline_build(session: Session, build: Build, device: Device, spec: SpecKey, key: rg.SeriesKey,
                   environment: str | None = None) -> tuple[Build, list[Run]] | None:
    """The newest earlier build with latency runs on this series and no open regression alert
    on it (the last accepted build), with those runs; with `environment` (an env_key), the
    newest such build that has runs in that environment where one exists, else the newest in
    any (compare_builds then reports the environment change). Read from the series state: the
    newest few builds of the workload's series, however long its history."""
    catch_up(session)
    rejected = _builds_with_open_regressions(session, device.id, key)
    states = store.series_of_device(session, device.id, spec.canonical())
    in_env = [s.id for s in states if environment and s.env_key == environment]
    for series_ids in ([in_env] if in_env else []) + [[s.id for s in states]]:
        # At most len(rejected) builds are passed over: the next is the baseline.
        for build_id in store.series_builds_before(session, series_ids, (build.created, build.id), len(rejected) + 1):
            if build_id in rejected:
                continue
            runs = runs_of(session, device.id, build_id, JobKind.latency, spec)
            if runs:
                return store.get_build(session, build_id), runs
    return None


def _environment_group(runs: list[Run], device: Device, prefer: str | None = None) -> tuple[list[Run], dict | None]:
    """The runs of one environment among `runs`: those of `prefer` (an env_key) when some ran
    in it, else of the newest run's; with that environment (None for no runs)."""
    if not runs:
        return [], None
    keys = {r.id: env_key_of(r, device) for r in runs}
    chosen = prefer if prefer in keys.values() else keys[max(keys)]
    group = [r for r in runs if keys[r.id] == chosen]
    return group, run_environment(max(group, key=lambda r: r.id), device)


# ---- comparing ----------------------------------------------------------------------------


def compare_builds(session: Session, device: Device, spec: SpecKey, metric: str, baseline: Build,
                   baseline_runs: list[Run], candidate: Build, candidate_runs: list[Run],
                   include_flagged: bool = False, runs_left: int | None = None) -> dict[str, Any] | None:
    """One metric of two builds on one device and spec: the comparison, as a dict; None when
    neither build measured it. The candidate's runs of its newest environment are compared with
    the baseline's runs of that environment, or of the baseline's newest when it has none
    there; then "environment_change" lists what differs ("driver changed 512.3 -> 530.1") and
    the reason says so first, since the build is not the only thing that changed. Runs of
    other environments are left out ("other_environment_runs")."""
    all_runs = baseline_runs + candidate_runs
    candidate_runs, cand_env = _environment_group(candidate_runs, device)
    prefer = run_env.environment_key(cand_env) if cand_env is not None else None
    baseline_runs, base_env = _environment_group(baseline_runs, device, prefer)
    cand_env = cand_env if cand_env is not None else base_env
    base_env = base_env if base_env is not None else cand_env
    key, base_key = series_key(device, spec, metric, cand_env), series_key(device, spec, metric, base_env)
    base_samples, cand_samples = _samples(session, base_key, baseline_runs), _samples(session, key, candidate_runs)
    if not base_samples and not cand_samples:
        return None
    changes = run_env.changes(base_env, cand_env) if key.environment != base_key.environment else []
    left_out = sorted({r.id for r in all_runs} - {r.id for r in baseline_runs + candidate_runs})
    flags = _flagged(session, baseline_runs + candidate_runs)
    flagged = [run_id for run_id, flag in flags.items() if flag.flagged]
    base = rg.check_series(base_samples, flagged_runs=flagged, include_flagged=include_flagged)
    cand = rg.check_series(cand_samples, flagged_runs=flagged, include_flagged=include_flagged)
    if base.unit != cand.unit:
        raise ValueError(f"{metric}: baseline in {base.unit}, candidate in {cand.unit}: refusing to compare")
    drift, drift_runs = series_drift(session, device, spec, metric, candidate, environment=key.environment)
    comparison = rg.compare(base.values, cand.values, baseline_runs=base.run_ids, candidate_runs=cand.run_ids,
                            drift=drift, min_effect=min_effect(session, key),
                            higher_is_worse=HEADLINE_METRICS.get(metric, True), runs_left=runs_left)
    result = {"device": device.serial, "metric": metric, "unit": cand.unit, "series": key.as_dict(),
              "baseline_build": baseline.name, "candidate_build": candidate.name,
              "drift_source": (f"estimated from {drift_runs} earlier runs" if drift_runs
                               else "series setting" if drift_prior(session, key) is not None else "default"),
              "excluded_runs": sorted(set(base.excluded_runs) | set(cand.excluded_runs)),
              "thermal": {run_id: list(flags[run_id].reasons) for run_id in flagged}} | comparison.as_dict()
    result |= {"environment": run_env.label(cand_env), "baseline_environment": run_env.label(base_env),
               "environment_change": changes, "other_environment_runs": left_out}
    if changes:
        result["reason"] = f"environment changed: {'; '.join(changes)}; {result['reason']}"
    return result


DRIFT_HISTORY_RUNS = 30  # the newest earlier runs the drift is estimated from


def series_drift(session: Session, device: Device, spec: SpecKey, metric: str, candidate: Build,
                 environment: str | None = None) -> tuple[float, int]:
    """(drift, runs used): the series' run-to-run drift, estimated (rg.estimate_drift) from the
    newest DRIFT_HISTORY_RUNS runs of builds before `candidate` on this device and spec (and in
    `environment`, an env_key, when given: another environment's level is no drift), runs
    flagged for their thermal state left out, and runs of builds with an open regression alert
    on the series left out too: they are not part of the accepted series (baseline_build skips
    them alike), and their steps are no drift. With the demo's A, B, A, B, ... builds (B 2x
    slower) they made every consecutive pair a step, estimated a drift near 100% and turned
    B's regression and A's sameness into "inconclusive" (CI 0.15-29). With too little
    history, (the series' drift setting, else rg.DEFAULT_DRIFT, 0). Read from the series
    state (each run's log median and its variance: stats.run_spread), not from raw samples."""
    catch_up(session)
    key = series_key(device, spec, metric)
    rejected = _builds_with_open_regressions(session, device.id, key)
    states = [s.id for s in store.series_of_device(session, device.id, spec.canonical(), environment or None)
              if s.metric == metric]
    runs = store.series_run_stats(session, states, (candidate.created, candidate.id), rejected, DRIFT_HISTORY_RUNS)
    runs = [run for run in reversed(runs) if not run.flagged]  # oldest first
    drift = rg.drift_from_spreads([(r.log_median, r.within) if r.log_median is not None else None for r in runs])
    if drift is None:
        prior = drift_prior(session, key)  # a setting holds in every environment of the series
        return (rg.DEFAULT_DRIFT if prior is None else prior), 0
    return drift, len(runs)


def analyze_batch(session: Session, batch_id: int, now: dt.datetime | None = None) -> dict[str, Any]:
    """Compare, alert and ask for more repetitions for batch `batch_id` (flushes only). Returns
    {"comparisons": [...], "alerts": [ids], "more_repetitions": [{device, spec, repetitions}],
    "fidelity": [...], "stoppages": [ids]}."""
    batch = store.get_batch(session, batch_id)
    report: dict[str, Any] = {"comparisons": [], "alerts": [], "more_repetitions": [], "fidelity": [],
                              "stoppages": []}
    if batch.build_id is None:
        return report
    if batch.purpose == BATCH_CHECK:  # the check judges its own runs: no alert, no round, no series
        return report | {"skipped": "a farm check's batch: the check judges its runs"}
    catch_up(session, thorough=True)  # the series state holds the batch's runs
    build = store.get_build(session, batch.build_id)
    jobs = store.jobs_of_batches(session, [batch_id])
    # Each more-repetitions round adds one run of each build: what is left of the batch's rounds.
    runs_left = None if batch.max_extra_rounds is None else max(0, batch.max_extra_rounds - store.extra_round(batch.idempotency_key))
    # A more-repetitions batch also reruns the baseline build; its jobs are not candidates.
    pairs = {(job.device_id, SpecKey.of(job.spec or {})): job for job in jobs
             if job.kind == JobKind.latency and job.build_id == build.id}
    for (device_id, spec), job in sorted(pairs.items(), key=lambda kv: kv[1].id):
        device = store.get_device(session, device_id)
        candidate_runs = runs_of(session, device_id, build.id, JobKind.latency, spec)
        if not candidate_runs:
            continue
        first_key = series_key(device, spec, next(iter(HEADLINE_METRICS)))
        newest_env = env_key_of(max(candidate_runs, key=lambda r: r.id), device)
        found = baseline_build(session, build, device, spec, first_key, environment=newest_env)
        if found is None:
            report["comparisons"].append({"device": device.serial, "candidate_build": build.name,
                                          "verdict": "no baseline", "reason": "first build on this series"})
            continue
        baseline, baseline_runs = found
        more, changes, undecided = 0, [], []
        for metric in HEADLINE_METRICS:
            try:
                result = compare_builds(session, device, spec, metric, baseline, baseline_runs, build,
                                        candidate_runs, runs_left=runs_left)
            except ValueError as exc:  # mixed units or keys, no samples: refused, not averaged
                report["comparisons"].append({"device": device.serial, "metric": metric,
                                              "verdict": "refused", "reason": str(exc)})
                continue
            if result is None:
                continue
            report["comparisons"].append(result)
            record_verdict(session, result, build, baseline)  # what the overview shows, decided or not
            if result["verdict"] in ("regression", "improvement"):
                alert = _record_alert(session, batch, build, baseline, device, spec, result,
                                      baseline_runs, candidate_runs)
                report["alerts"].append(alert.id)
            elif result["verdict"] == "inconclusive" and result["more_repetitions_suggested"] and (
                    batch.round_metrics is None or metric in batch.round_metrics
                    or result["cause"] in rg.SAMPLE_LIMITED):
                # A verdict the sample counts alone keep out of reach is rounded on whatever
                # metrics the batch rounds on: more samples are what it needs.
                more = max(more, result["more_repetitions_suggested"])
                undecided.append(metric)
            if result["environment_change"]:
                changes = result["environment_change"]
                # Only the baseline measured in the candidate's environment tells the build's share.
                more = max(more, MIN_SAMPLES, result["n_candidate"] // max(1, result["runs_candidate"]))
            else:
                _settle_environment_alerts(session, build, device, result)
        if more:
            entry = {"device": device.serial, "spec": store.workload(job.spec), "repetitions": more,
                     "baseline_build": baseline.id, "metrics": undecided or list(HEADLINE_METRICS)}
            report["more_repetitions"].append(entry | ({"environment_change": changes} if changes else {}))
    report["fidelity"] = _check_fidelity(session, batch, build, jobs, report["alerts"])
    report["stoppages"] = raise_stoppages(session, now or utcnow())
    return report


def _settle_environment_alerts(session: Session, build: Build, device: Device, result: dict[str, Any]) -> None:
    """An open alert this build got across an environment change, which a decided comparison in
    one environment now contradicts, is closed as invalid with the reason in its note (when the
    two agree, _record_alert updates the alert instead)."""
    if result["verdict"] not in ("regression", "improvement", "same"):
        return
    key = rg.SeriesKey.from_dict(result["series"])
    for alert in queries.list_alerts(session, states=OPEN_STATES, kinds=(AlertKind.regression, AlertKind.improvement),
                                     device_id=device.id, build_id=build.id, metric=result["metric"]):
        if (alert.detail or {}).get("environment_change") and alert.kind != result["verdict"] \
                and _same_workload(alert.series, key):
            alert.state, alert.updated_at = AlertState.invalid, utcnow()
            alert.note = (f"measured again in one environment ({result['environment']}) against "
                          f"{result['baseline_build']}: {result['verdict']} ({result['reason']})")
    session.flush()


def _record_alert(session: Session, batch: Batch, build: Build, baseline: Build, device: Device, spec: SpecKey,
                  result: dict[str, Any], baseline_runs: list[Run], candidate_runs: list[Run]) -> Alert:
    """A regression or improvement alert for one series and build; the same finding again
    (a more-repetitions round) updates it instead of adding another. Across an environment
    change the summary starts with "environment changed: ..." and the detail lists the changes:
    the alert does not blame the build alone."""
    kind = AlertKind(result["verdict"])
    changes = result.get("environment_change") or []
    detail: dict[str, Any] = {
        "baseline_median": result["baseline_median"], "candidate_median": result["candidate_median"],
        "n_baseline": result["n_baseline"], "n_candidate": result["n_candidate"], "unit": result["unit"],
        "reason": result["reason"], "min_effect": result["min_effect"], "excluded_runs": result["excluded_runs"],
        "environment": result.get("environment", ""), "environment_change": changes,
    }
    if result["metric"] in LATENCY_METRICS:
        detail["attribution"] = kernel_moves(session, baseline_runs, candidate_runs)
        by_op = rg.attribute(_by_op(_kernels(session, baseline_runs)), _by_op(_kernels(session, candidate_runs)))
        detail["attribution_by_op"] = [{"op": m.kernel, "baseline_ms": m.baseline_ms, "candidate_ms": m.candidate_ms,
                                        "delta_ms": m.delta_ms, "share": m.share} for m in by_op]
    history = store.series_points(session, series_ident(rg.SeriesKey.from_dict(result["series"])),
                                  until=(build.created, build.id), newest=CHANGE_POINT_WINDOW)
    if len(history) >= 2:
        points = rg.detect_change_points([point.median for point, _ in history])
        detail["change_points"] = [{"build": history[p.index][1], "ratio": p.ratio, "p_value": p.p_value}
                                   for p in points]
    change = (result["ratio"] - 1) * 100
    summary = (f"{result['metric']} {'+' if change >= 0 else ''}{change:.1f}% on {device.serial}: "
               f"{build.name} vs {baseline.name} (ratio {result['ratio']:.3f}, "
               f"{result['confidence'] * 100:.0f}% CI {result['ci_low']:.3f}-{result['ci_high']:.3f}, "
               f"p={result['p_value']:.2g})")
    if changes:
        summary = (f"environment changed: {'; '.join(changes)}; {summary}; not the build's alone "
                   f"until {baseline.name} is measured again in the new environment")
    alert = (store.find_alert(session, build.id, device.id, kind, result["metric"])
             or Alert(kind=kind, build_id=build.id, device_id=device.id, metric=result["metric"]))
    alert.baseline_build_id, alert.batch_id, alert.series = baseline.id, batch.id, result["series"]
    alert.ratio, alert.ci_low, alert.ci_high, alert.p_value = (result["ratio"], result["ci_low"], result["ci_high"],
                                                               result["p_value"])
    alert.summary, alert.detail, alert.updated_at = summary, detail, utcnow()
    return store.save_alert(session, alert)


def job_spec(session: Session, run: Run) -> dict[str, Any]:
    """The spec of the job a run belongs to."""
    return store.get_job(session, run.job_id).spec or {}


def series_history(session: Session, device: Device, spec: SpecKey, metric: str,
                   until: Build | None = None, environment: str | None = None) -> list[dict[str, Any]]:
    """Every build's samples of one series on one device, in build order: [{build, values}];
    with `environment` (an env_key), only the runs that recorded that environment. Read from
    the raw samples over the series' whole history: the reference the series state is checked
    against; the nightly analysis and the faces read the state (orchestrator/analysis/series.py)."""
    legacy = run_env.environment_key(store.result_environment(device))  # runs stored with no environment
    rows = store.series_history_rows(session, device.id, metric)
    history: dict[int, dict[str, Any]] = {}
    for name, created, build_id, value, job_spec, env_key in rows:
        if until is not None and (created, build_id) > (until.created, until.id):
            continue
        if environment and (env_key or legacy) != environment:
            continue
        if SpecKey.of(job_spec or {}) == spec:
            history.setdefault(build_id, {"build": name, "build_id": build_id, "values": []})["values"].append(value)
    return list(history.values())


# ---- fidelity and stoppages ---------------------------------------------------------------


def _check_fidelity(session: Session, batch: Batch, build: Build, jobs: list[Job], alerts: list[int]) -> list[dict]:
    """Each generated image against the newest earlier build's image of the same device, spec,
    prompt and seed; a change beyond the tolerance is a fidelity alert."""
    results = []
    for job in jobs:
        if job.kind != JobKind.generate:
            continue
        image = store.newest_image_of_job(session, job.id)
        if image is None:
            continue
        spec = job.spec or {}
        previous = _previous_image(session, job, build, spec)
        if previous is None:
            continue
        device = store.get_device(session, job.device_id)
        try:
            check = rg.compare_images(previous.path, image.path)
        except (OSError, ValueError) as exc:
            results.append({"device": device.serial, "job": job.id, "error": str(exc)})
            continue
        entry = {"device": device.serial, "job": job.id, "psnr_db": check.psnr_db, "changed": check.changed,
                 "before": previous.path, "after": image.path}
        results.append(entry)
        if check.changed:
            before_run, after_run = queries.get_run(session, previous.run_id), queries.get_run(session, image.run_id)
            before_env, after_env = run_environment(before_run, device), run_environment(after_run, device)
            changes = run_env.changes(before_env, after_env) if env_key_of(before_run, device) != \
                env_key_of(after_run, device) else []
            key = series_key(device, SpecKey.of(spec), "image_psnr_db", after_env)
            previous_build = (store.get_build(session, before_run.build_id) if before_run.build_id is not None
                              else None)
            summary = (f"image changed on {device.serial}: PSNR {check.psnr_db:.1f} dB against "
                       f"{previous_build.name if previous_build else 'the previous build'}")
            alert = Alert(kind=AlertKind.fidelity, build_id=build.id, device_id=device.id, batch_id=batch.id,
                          baseline_build_id=previous_build.id if previous_build else None, metric="image_psnr_db",
                          series=key.as_dict() | {"prompt": spec.get("prompt", ""), "seed": spec.get("seed", 0)},
                          summary=f"environment changed: {'; '.join(changes)}; {summary}" if changes else summary,
                          detail={"psnr_db": check.psnr_db, "images": {"before": previous.path, "after": image.path},
                                  "environment_change": changes})
            entry["environment_change"] = changes
            alerts.append(store.save_alert(session, alert).id)
    return results


def _previous_image(session: Session, job: Job, build: Build, spec: dict[str, Any]) -> Image | None:
    wanted = (SpecKey.of(spec), spec.get("prompt", ""), spec.get("seed", 0))
    for earlier in store.builds_before(session, build):
        for image, other in store.generated_images(session, job.device_id, earlier.id):
            other = other or {}
            if (SpecKey.of(other), other.get("prompt", ""), other.get("seed", 0)) == wanted:
                return image
    return None


def raise_stoppages(session: Session, now: dt.datetime) -> list[int]:
    """A data-stoppage alert for each device that reported before but not for STOPPAGE_AFTER
    (one open alert per device)."""
    created = []
    # When the control plane last heard a result from each device (its own clock, not the device's).
    for device_id, finished in store.last_reports(session):
        if finished is None or now - finished < STOPPAGE_AFTER:
            continue
        if store.has_open_alert(session, device_id, AlertKind.data_stoppage):
            continue
        device = store.get_device(session, device_id)
        hours = (now - finished).total_seconds() / 3600
        alert = Alert(kind=AlertKind.data_stoppage, device_id=device_id, metric="", series={"device": device.serial},
                      summary=f"{device.serial} has not reported for {hours:.0f} h (last run {finished:%Y-%m-%d %H:%M} UTC)",
                      detail={"last_run_finished": finished.isoformat(), "state": str(device.state)})
        created.append(store.save_alert(session, alert).id)
    return created
