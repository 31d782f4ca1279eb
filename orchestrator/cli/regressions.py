"""`farm regressions ...` (triage the analysis' alerts), `farm results compare` (two builds,
metric by metric, with ratios and confidence intervals) and `farm bisect` (run the builds
between a good and a bad one on a device and name the first bad one)."""

from __future__ import annotations

import functools
import time
from typing import Any

import typer

from . import common, completion, labels, numbers, validate
from .output import Table, console, escape

ALERT_ID = typer.Argument(..., help="Alert id.", parser=validate.record_id)

app = typer.Typer(help="Regressions, improvements, image changes and data stoppages found by the analysis.",
                  no_args_is_help=True)


def alert_dict(alert) -> dict[str, Any]:
    return {"id": alert.id, "kind": str(alert.kind), "state": str(alert.state),
            "device": alert.device.serial if alert.device else None,
            "build": alert.build.name if alert.build else None,
            "baseline_build": alert.baseline_build.name if alert.baseline_build else None,
            "metric": alert.metric, "ratio": alert.ratio, "ci_low": alert.ci_low, "ci_high": alert.ci_high,
            "p_value": alert.p_value, "summary": alert.summary, "note": alert.note, "series": alert.series,
            "detail": alert.detail, "batch": alert.batch_id, "created_at": common.iso(alert.created_at),
            "updated_at": common.iso(alert.updated_at)}


@app.command("list")
def list_alerts(
    state: str = typer.Option(None, "--state", help="new, acknowledged, invalid or fixed (default: new and "
                              "acknowledged)."),
    kind: str = typer.Option(None, "--kind", help="regression, improvement, fidelity or data_stoppage."),
    device: str = typer.Option(None, "--device", help="Device serial."),
    build: str = typer.Option(None, "--build", help="Build name."),
    all_states: bool = typer.Option(False, "--all", help="Every state."),
    as_json: bool = common.JSON_OPTION,
):
    """List alerts, newest first."""
    from orchestrator import store
    from orchestrator.store import queries
    from orchestrator.store.models import AlertKind, AlertState

    try:
        states = (list(AlertState) if all_states else [AlertState(state)] if state
                  else [AlertState.new, AlertState.acknowledged])
        kinds = [AlertKind(kind)] if kind else list(AlertKind)
    except ValueError as exc:
        common.fail(f"{exc}; states: {', '.join(AlertState)}; kinds: {', '.join(AlertKind)}")
    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        device_id = common.get_or_fail(store.get_device, session, device).id if device else None
        build_id = common.get_or_fail(store.get_build, session, build).id if build else None
        rows = [alert_dict(a) for a in queries.list_alerts(session, states=states, kinds=kinds, device_id=device_id,
                                                           build_id=build_id)]
    if common.print_json_or_empty(rows, as_json, "no alerts"):
        return
    table = Table()
    for header in ("id", "kind", "state"):
        table.add_column(header, no_wrap=True)
    for header in ("device", "build", "metric", "change", "CI", "top ops"):
        table.add_column(header)
    # A finding across an environment change (a phone update, a new driver) is not the build's alone.
    with_env = any((r["detail"] or {}).get("environment_change") for r in rows)
    if with_env:
        table.add_column("environment changed")
    for r in rows:
        change = f"{(r['ratio'] - 1) * 100:+.1f}%" if r["ratio"] is not None else "-"
        ci = f"{r['ci_low']:.3f}-{r['ci_high']:.3f}" if r["ci_low"] is not None else "-"
        detail = r["detail"] or {}
        top = ", ".join(f"{m['op']} {m['share'] * 100:.0f}%" for m in detail.get("attribution_by_op", [])[:2])
        env = ["; ".join(detail.get("environment_change") or []) or "-"] if with_env else []
        table.add_row(str(r["id"]), r["kind"], r["state"], r["device"] or "-", r["build"] or "-", r["metric"] or "-",
                      change, ci, top or "-", *env)
    console.print(table)


@app.command()
def show(alert_id: int = ALERT_ID, as_json: bool = common.JSON_OPTION):
    """Show one alert: the comparison, the kernels that moved, the images, the change points."""
    from orchestrator.store.models import Alert

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        alert = session.get(Alert, alert_id)
        if alert is None:
            common.fail(f"no alert {alert_id}; `farm regressions list --all` shows them")
        data = alert_dict(alert)
    if as_json:
        common.print_json(data)
        return
    console.print(f"[bold]alert {data['id']}[/] {data['kind']} ({data['state']}): {escape(data['summary'] or '')}",
                  highlight=False)
    detail = data["detail"] or {}
    for change in detail.get("environment_change") or []:
        console.print(f"environment changed: {change}", highlight=False, markup=False)
    if detail.get("environment"):
        console.print(f"environment: {detail['environment']}", highlight=False, markup=False)
    for key in ("baseline_build", "metric", "p_value", "batch", "note"):
        if data[key] not in (None, ""):
            console.print(f"{key}: {data[key]}", highlight=False, markup=False)
    for key in ("baseline_median", "candidate_median", "n_baseline", "n_candidate", "unit", "reason", "psnr_db"):
        if key in detail:
            console.print(f"{key}: {detail[key]}", highlight=False, markup=False)
    for key, name, title in (("attribution_by_op", "op", "attribution by op"),
                             ("attribution", "kernel", "kernel attribution")):
        if detail.get(key):
            table = Table(name, "baseline ms", "candidate ms", "delta ms", "share", title=title)
            for m in detail[key]:
                table.add_row(m[name], f"{m['baseline_ms']:.2f}", f"{m['candidate_ms']:.2f}",
                              f"{m['delta_ms']:+.2f}", f"{m['share'] * 100:.0f}%")
            console.print(table)
    if detail.get("images"):
        console.print(f"image before: {detail['images']['before']}\nimage after:  {detail['images']['after']}",
                      highlight=False)
    for point in detail.get("change_points", []):
        console.print(f"change point at build {point['build']} (ratio {point['ratio']:.3f}, p={point['p_value']:.3g})",
                      highlight=False)


def _triage(alert_id: int, state, note: str | None) -> None:
    from orchestrator import store

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            store.triage_alert(session, alert_id, state, note)
        except store.StoreError as exc:
            common.fail(str(exc))
        session.commit()
    console.print(f"alert {alert_id} {state}", highlight=False)


NOTE_OPTION = typer.Option(None, "--note", help="Why (kept on the alert).")


@app.command()
def ack(alert_id: int = ALERT_ID, note: str = NOTE_OPTION):
    """Acknowledge an alert: someone is on it."""
    from orchestrator.store.models import AlertState

    _triage(alert_id, AlertState.acknowledged, note)


@app.command()
def invalidate(alert_id: int = ALERT_ID, note: str = NOTE_OPTION):
    """Mark an alert invalid (noise, a broken device): its build becomes a baseline again."""
    from orchestrator.store.models import AlertState

    _triage(alert_id, AlertState.invalid, note)


@app.command()
def fixed(alert_id: int = ALERT_ID, note: str = NOTE_OPTION):
    """Mark an alert fixed."""
    from orchestrator.store.models import AlertState

    _triage(alert_id, AlertState.fixed, note)


# ---- farm regressions scan ---------------------------------------------------------------


@app.command()
def scan(
    device: str = typer.Option(None, "--device", help="Only this device's series (default: every device)."),
    metric: str = typer.Option(None, "--metric", help="Only this metric (unet_step_ms, e2e_ms, peak_gpu_bytes)."),
    as_json: bool = common.JSON_OPTION,
):
    """Change-point detection over each series' whole history; records what it finds (beat
    runs it after every batch, on the batch's devices)."""
    from orchestrator import store
    from orchestrator.analysis import changepoints, regressions

    if metric is not None and metric not in regressions.HEADLINE_METRICS:
        common.fail(f"unknown metric {metric!r}; choose from {', '.join(regressions.HEADLINE_METRICS)}")
    settings = common.cli_settings()
    with common.open_store(settings) as sessions, sessions() as session:
        dev = common.get_or_fail(store.get_device, session, device) if device is not None else None
        with console.status("scanning series histories"):
            found = changepoints.scan_change_points(session, dev, metric)
        session.commit()
    if as_json:
        common.print_json(found)
        return
    if not found:
        console.print("no change points: every series is level (or has fewer than "
                      f"{2 * changepoints.MIN_SEGMENT} builds of history)")
        return
    table = Table("device", "metric", "series", "first build after", "before", "after", "ratio", "p", "",
                  title=f"{len(found)} change points ({sum(f['new'] for f in found)} new)")
    for f in found:
        series = f["series"]
        table.add_row(f["device"], f["metric"], f"{series['model']} {series['resolution']} {series['steps']} steps "
                      f"{series['precision']} {series['profile']}", f["build"], f"{f['median_before']:.4g}",
                      f"{f['median_after']:.4g}", f"{f['ratio']:.3f}" if f["ratio"] is not None else "-",
                      f"{f['p_value']:.3f}", "new" if f["new"] else "")
    console.print(table)


# ---- farm results compare -----------------------------------------------------------------


def compare(
    builds: list[str] = typer.Option(..., "--build", help="Baseline build, then candidate build (give it twice; "
                                     "id, label or name).", autocompletion=completion.builds),
    device: str = typer.Option(None, "--device", help="Device serial (default: every device that ran both).",
                               autocompletion=completion.devices),
    include_flagged: bool = typer.Option(False, "--include-flagged", help="Keep thermally flagged runs."),
    as_json: bool = common.JSON_OPTION,
):
    """Compare two builds metric by metric: medians, ratio, confidence interval, verdict."""
    from orchestrator import store
    from orchestrator.analysis import regressions
    from orchestrator.store.models import JobKind

    if len(builds) != 2:
        common.fail("give --build twice: the baseline build, then the candidate build")
    rows: list[dict[str, Any]] = []
    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            base, cand = (store.get_build(session, b) for b in builds)
            devices = [store.get_device(session, device)] if device else store.all_devices(session)
        except store.StoreError as exc:
            common.fail(str(exc))
        shown = labels.build_names(session, [base.name, cand.name])
        for dev in devices:
            specs = {regressions.SpecKey.of(spec) for spec in store.latency_specs(session, dev.id, cand.id)}
            for spec in sorted(specs, key=repr):
                # two builds named by hand: a farm check's runs of them count too
                base_runs = regressions.runs_of(session, dev.id, base.id, JobKind.latency, spec, checks=True)
                cand_runs = regressions.runs_of(session, dev.id, cand.id, JobKind.latency, spec, checks=True)
                if not base_runs or not cand_runs:
                    continue
                for metric in regressions.HEADLINE_METRICS:
                    try:
                        row = regressions.compare_builds(session, dev, spec, metric, base, base_runs, cand, cand_runs,
                                                      include_flagged)
                        if row is not None:
                            rows.append(row)
                    except ValueError as exc:
                        rows.append({"device": dev.serial, "metric": metric, "verdict": "refused", "reason": str(exc)})
    if not rows:
        common.fail(f"no device ran latency jobs of both {builds[0]} and {builds[1]} with the same settings")
    if as_json:
        common.print_json(rows)
        return
    base_shown, cand_shown = shown[base.name], shown[cand.name]
    table = Table("device", "metric", base_shown, cand_shown, "ratio", "change", "95% CI", "p", "verdict",
                  title=f"{cand_shown} against {base_shown}")
    for r in rows:
        if r["verdict"] == "refused":
            table.add_row(r["device"], r["metric"], "-", "-", "-", "-", "-", "-", f"refused: {r['reason']}")
            continue
        changes = r.get("environment_change") or []
        verdict = f"{r['verdict']} (environment changed: {'; '.join(changes)})" if changes else r["verdict"]
        unit = r.get("unit")
        table.add_row(r["device"], r["metric"],
                      f"{numbers.metric_value(r['metric'], r['baseline_median'], unit)} (n={r['n_baseline']})",
                      f"{numbers.metric_value(r['metric'], r['candidate_median'], unit)} (n={r['n_candidate']})",
                      numbers.ratio(r["ratio"]), numbers.change(r["ratio"]), numbers.interval(r["ci_low"], r["ci_high"]),
                      numbers.p_value(r["p_value"]), verdict)
    console.print(table)
    labels.legend(shown)


# ---- farm bisect --------------------------------------------------------------------------


def bisect(
    good: str = typer.Option(..., "--good", help="A build without the regression."),
    bad: str = typer.Option(..., "--bad", help="A build with it."),
    device: str = typer.Option(..., "--device", help="Device serial to run on."),
    metric: str = typer.Option("unet_step_ms", "--metric", help="Metric that regressed."),
    repetitions: int = typer.Option(10, "--repetitions", min=5, help="Repetitions per build run."),
    timeout: float = typer.Option(3600.0, "--timeout", help="Seconds to wait for each build's run."),
    as_json: bool = common.JSON_OPTION,
):
    """Find the first bad build between --good and --bad (builds in the order they were made)."""
    from orchestrator import store
    from orchestrator.analysis import regressions
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.jobs.jobservice import launch_suite
    from orchestrator.store.models import Batch, Build, JobKind

    if metric not in regressions.HEADLINE_METRICS:
        common.fail(f"unknown metric {metric!r}; choose from {', '.join(regressions.HEADLINE_METRICS)}")
    settings = common.cli_settings()
    app = make_celery(settings)
    steps: list[dict[str, Any]] = []
    with common.open_store(settings) as sessions:
        with sessions() as session:
            try:
                good_b, bad_b = store.get_build(session, good), store.get_build(session, bad)
                dev = store.get_device(session, device)
            except store.StoreError as exc:
                common.fail(str(exc))
            order = store.builds_in_order(session)
            ids = [b.id for b in order]
            lo, hi = ids.index(good_b.id), ids.index(bad_b.id)
            if lo >= hi:
                common.fail(f"{good} must be older than {bad}")
            candidates = [(b.id, b.name) for b in order[lo:hi + 1]]
            bad_runs = regressions.runs_of(session, dev.id, bad_b.id, JobKind.latency)
            if not bad_runs:
                common.fail(f"{bad} has no latency runs on {device}: nothing says what to reproduce")
            spec_dict = dict(regressions.job_spec(session, bad_runs[-1]))
        spec = regressions.SpecKey.of(spec_dict)
        job_spec = {k: v for k, v in spec_dict.items() if k not in ("job_id", "build", "kind")}
        job_spec |= {"repetitions": repetitions, "unet_repetitions": repetitions}

        @functools.cache  # each build is measured once; the good build is the baseline of every step
        def measured(index: int) -> list:
            build_id, name = candidates[index]
            with sessions() as session:
                pending = not regressions.runs_of(session, dev.id, build_id, JobKind.latency, spec)
            if pending:
                # No more-repetitions rounds: bisect judges each step itself (--repetitions).
                batch_id = launch_suite(app, f"bisect {good}..{bad} {name}", [{"kind": "latency", "spec": job_spec}],
                                        build=build_id, devices=[device], max_extra_rounds=0)
                with console.status(f"running {name} on {device}"):
                    deadline = time.monotonic() + timeout
                    while True:
                        with sessions() as session:
                            if session.get(Batch, batch_id).finished_at is not None:
                                break
                        if time.monotonic() > deadline:
                            common.fail(f"{name} did not finish on {device} within {timeout:g} s")
                        time.sleep(1.0)
            with sessions() as session:
                return regressions.runs_of(session, dev.id, build_id, JobKind.latency, spec)

        def judged(base: int, index: int) -> dict[str, Any]:
            base_runs, runs = measured(base), measured(index)  # before the session: they may wait for runs
            with sessions() as session:
                base_row, row = session.get(Build, candidates[base][0]), session.get(Build, candidates[index][0])
                result = regressions.compare_builds(session, session.get(type(dev), dev.id), spec, metric, base_row,
                                                 base_runs, row, runs)
            if result is None:
                common.fail(f"neither {base_row.name} nor {row.name} measured {metric} on {device}")
            return result

        def is_bad(index: int) -> bool:
            """The bad end must be a regression against the good one. A build in between is bad
            when it regresses against the good build (the first regression came at or before
            it, whether or not a later build slowed things further: then it is an improvement
            on the bad one too), good when it improves on the bad build and does not regress
            against the good one: a single run of each cannot prove "same" once run-to-run
            drift is counted, but it can say which end a build sits with. A build that does
            neither cannot be placed."""
            name = candidates[index][1]
            vs_good = judged(0, index)
            vs_bad = judged(len(candidates) - 1, index) if index != len(candidates) - 1 else None
            worse = vs_good["verdict"] == "regression"
            better = vs_bad is not None and vs_bad["verdict"] == "improvement"
            changes = vs_good.get("environment_change") or []
            steps.append({"build": name, "verdict": vs_good["verdict"], "ratio": vs_good["ratio"],
                          "ci_low": vs_good["ci_low"], "ci_high": vs_good["ci_high"],
                          "verdict_against_bad": None if vs_bad is None else vs_bad["verdict"],
                          "environment_change": changes})
            if not as_json:
                against_bad = "" if vs_bad is None else f"; against {bad}: {vs_bad['verdict']}"
                env = f" (environment changed: {'; '.join(changes)})" if changes else ""
                console.print(f"{name}: {vs_good['verdict']}{env} against {good} "
                              f"(ratio {vs_good['ratio'] or float('nan'):.3f}){against_bad}", highlight=False)
            if vs_bad is not None and not worse and not better:
                common.fail(f"{name} cannot be placed: {vs_good['verdict']} against {good} ({vs_good['reason']}), "
                     f"{vs_bad['verdict']} against {bad}; bisect again with more --repetitions")
            return worse

        low, high = 0, len(candidates) - 1  # low is good, high is bad
        if not is_bad(high):
            last = steps[-1]
            common.fail(f"{bad} does not regress {metric} against {good} on {device} ({last['verdict']}, ratio "
                 f"{last['ratio'] or float('nan'):.3f}, 95% CI {last['ci_low'] or float('nan'):.3f}-"
                 f"{last['ci_high'] or float('nan'):.3f}): nothing to bisect")
        while high - low > 1:
            mid = (low + high) // 2
            if is_bad(mid):
                high = mid
            else:
                low = mid
    first_bad = candidates[high][1]
    if as_json:
        common.print_json({"first_bad": first_bad, "last_good": candidates[low][1], "steps": steps})
        return
    console.print(f"first bad build: [bold]{first_bad}[/] (last good: {candidates[low][1]})", highlight=False)
