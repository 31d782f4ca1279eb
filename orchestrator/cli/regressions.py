"""`farm regressions ...` (triage the analysis' alerts), `farm results compare` (two builds,
metric by metric, with ratios and confidence intervals) and `farm bisect` (run the builds
between a good and a bad one on a device and name the first bad one)."""

from __future__ import annotations

import functools
from typing import Any

import typer

from . import common, completion, labels, numbers, validate
from .output import Table, console, escape

ALERT_ID = typer.Argument(..., help="Alert id.", parser=validate.record_id, autocompletion=completion.alerts)
GROUP_ID = typer.Argument(..., help="Alert group id (`farm regressions list` shows them).", parser=validate.record_id)

app = typer.Typer(help="Regressions, improvements, image changes and data stoppages found by the analysis.",
                  no_args_is_help=True)


def alert_series_id(alert) -> str | None:
    """The id of the latency series a regression or improvement is about (the API's
    /v1/series/ID, the dashboard's series page); None for a fidelity alert or a data stoppage."""
    from orchestrator.dashboard import views

    return views.alert_series_id(alert) if alert.kind in views.SERIES_KINDS else None


def alert_dict(alert) -> dict[str, Any]:
    return {"id": alert.id, "kind": str(alert.kind), "state": str(alert.state),
            "device": alert.device.serial if alert.device else None,
            "build": alert.build.name if alert.build else None,
            "baseline_build": alert.baseline_build.name if alert.baseline_build else None,
            "metric": alert.metric, "ratio": alert.ratio, "ci_low": alert.ci_low, "ci_high": alert.ci_high,
            "p_value": alert.p_value, "summary": alert.summary, "note": alert.note, "series": alert.series,
            "detail": alert.detail, "batch": alert.batch_id, "group": alert.group_id,
            "series_id": alert_series_id(alert),
            "created_at": common.iso(alert.created_at), "updated_at": common.iso(alert.updated_at)}


def group_dict(view) -> dict[str, Any]:
    """An alert group as `--json` gives it (the fields of the API's /v1/alert-groups)."""
    group, worst = view.group, view.worst
    return {"id": group.id, "build": group.build.name if group.build else None,
            "baseline_build": group.baseline_build.name if group.baseline_build else None,
            "owner": group.owner, "bug_url": group.bug_url, "note": group.note, "devices": view.devices,
            "metrics": view.metrics, "kinds": view.kinds, "states": view.states, "size": len(view.alerts),
            "open": view.open, "worst_ratio": worst.ratio if worst else None, "worst_alert": worst.id if worst else None,
            "created_at": common.iso(group.created_at), "updated_at": common.iso(group.updated_at),
            "alerts": [alert_dict(a) for a in view.alerts]}


@app.command("list")
def list_alerts(
    state: str = typer.Option(None, "--state", help="new, acknowledged, invalid or fixed (default: new and "
                              "acknowledged): groups with an alert in it."),
    kind: str = typer.Option(None, "--kind", help="regression, improvement, fidelity or data_stoppage."),
    device: str = typer.Option(None, "--device", help="Device serial."),
    build: str = typer.Option(None, "--build", help="Build (id, label or name): the candidate build."),
    metric: str = typer.Option(None, "--metric", help="unet_step_ms, e2e_ms, peak_gpu_bytes, image_psnr_db."),
    owner: str = typer.Option(None, "--owner", help="Groups this person owns (\"\" for unowned ones)."),
    sort: str = typer.Option("created", "--sort", help="created (newest first), worst (the worst change first) "
                             "or size (most alerts first)."),
    all_states: bool = typer.Option(False, "--all", help="Every state."),
    flat: bool = typer.Option(False, "--alerts", help="One line per alert instead of one per group."),
    as_json: bool = common.JSON_OPTION,
):
    """List regressions: one line per group (the alerts one build raised against one baseline),
    newest first; --alerts lists the alerts themselves."""
    from orchestrator import store
    from orchestrator.store import queries
    from orchestrator.store.models import AlertKind, AlertState

    try:
        states = (list(AlertState) if all_states else [AlertState(state)] if state
                  else [AlertState.new, AlertState.acknowledged])
        kinds = [AlertKind(kind)] if kind else None
    except ValueError as exc:
        common.fail(f"{exc}; states: {', '.join(AlertState)}; kinds: {', '.join(AlertKind)}")
    if sort not in store.GROUP_SORTS:
        common.fail(f"unknown sort {sort!r}; choose from {', '.join(store.GROUP_SORTS)}")
    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        device_id = common.get_or_fail(store.get_device, session, device).id if device else None
        build_id = common.get_or_fail(store.get_build, session, build).id if build else None
        if flat:
            rows = [alert_dict(a) for a in queries.list_alerts(session, states=states, kinds=kinds or list(AlertKind),
                                                               device_id=device_id, build_id=build_id, metric=metric)]
            shown = {}
        else:
            views = store.list_alert_groups(session, states=states, kinds=kinds, build_id=build_id,
                                            device_id=device_id, metric=metric, owner=owner, sort=sort)
            session.commit()  # alerts raised before groups existed were grouped just now
            rows = [group_dict(v) for v in views]
            shown = labels.build_names(session, [n for r in rows for n in (r["baseline_build"], r["build"])])
    if common.print_json_or_empty(rows, as_json, "no alerts" if flat else "no open regressions" if not (
            all_states or state) else "no alert groups"):
        return
    if flat:
        _alert_table(rows)
    else:
        _group_table(rows, shown)
        labels.legend(shown)


def _counts(counts: dict[str, int]) -> str:
    """{"new": 4, "fixed": 2, "invalid": 0} -> "4 new, 2 fixed"."""
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n) or "-"


def _group_table(rows: list[dict[str, Any]], shown: dict[str, str]) -> None:
    table = Table(title=f"{len(rows)} alert group{'s' if len(rows) != 1 else ''} (`farm regressions group show ID`)",
                  drop_first=("bug", "kinds", "owner", "devices x metrics", "alerts"), keep=("worst",))
    for header in ("group", "builds"):
        table.add_column(header, no_wrap=True)
    for header in ("devices x metrics", "worst", "alerts", "kinds", "owner", "bug"):
        table.add_column(header)
    for r in rows:
        builds = f"{shown.get(r['baseline_build'], r['baseline_build'] or '?')} -> {shown.get(r['build'], r['build'])}"
        table.add_row(str(r["id"]), builds, f"{len(r['devices'])} x {len(r['metrics'])}",
                      numbers.change(r["worst_ratio"]), _counts(r["states"]), _counts(r["kinds"]),
                      r["owner"] or "-", r["bug_url"] or "-")
    console.print(table)


def _alert_table(rows: list[dict[str, Any]]) -> None:
    # On a narrow terminal the change and what it is about stay; the detail goes first.
    table = Table(drop_first=("top ops", "group", "environment changed", "CI", "state", "kind"),
                  keep=("device", "metric", "change"))
    for header in ("id", "kind", "state"):
        table.add_column(header, no_wrap=True)
    for header in ("device", "build", "metric", "change", "CI", "top ops", "group"):
        table.add_column(header)
    # A finding across an environment change (a phone update, a new driver) is not the build's alone.
    with_env = any((r["detail"] or {}).get("environment_change") for r in rows)
    if with_env:
        table.add_column("environment changed")
    for r in rows:
        detail = r["detail"] or {}
        top = ", ".join(f"{m['op']} {_share(m['share'])}" for m in detail.get("attribution_by_op", [])[:2])
        env = ["; ".join(detail.get("environment_change") or []) or "-"] if with_env else []
        table.add_row(str(r["id"]), r["kind"], r["state"], r["device"] or "-", r["build"] or "-", r["metric"] or "-",
                      numbers.change(r["ratio"]), numbers.interval(r["ci_low"], r["ci_high"]), top or "-",
                      str(r["group"] or "-"), *env)
    console.print(table)


def _share(share: float | None) -> str:
    """A kernel's share of a change in whole percent, never -0%."""
    if share is None:
        return "-"
    percent = round(share * 100)
    return f"{percent:.0f}%" if percent else "0%"


def _p(value: float | None) -> str:
    """A p-value people read: 0.042, 1.8e-04 (the exponent where three decimals would say 0.000)."""
    if value is None:
        return "-"
    return f"{value:.3f}" if value >= 0.001 else f"{value:.1e}"


def _signed_ms(value: float | None) -> str:
    if value is None:
        return "-"
    text = numbers.plain(value)
    return f"+{text}" if value > 0 and text != "0" else text


@app.command()
def show(alert_id: int = ALERT_ID, as_json: bool = common.JSON_OPTION):
    """Show one alert: the comparison, the kernels that moved, the images, the change points, its group."""
    from orchestrator import store
    from orchestrator.store.models import Alert

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        alert = session.get(Alert, alert_id)
        if alert is None:
            common.fail(f"no alert {alert_id}; `farm regressions list --alerts --all` shows them")
        data = alert_dict(alert)
        group = group_dict(store.get_alert_group(session, alert.group_id)) if alert.group_id else None
    if as_json:
        common.print_json(data | {"group": group})
        return
    console.print(f"[bold]alert {data['id']}[/] {data['kind']} ({data['state']}): {escape(data['summary'] or '')}",
                  highlight=False)
    detail = data["detail"] or {}
    metric, unit = data["metric"] or "", detail.get("unit")

    def line(key: str, text: str) -> None:
        console.print(f"{key}: {text}", highlight=False, markup=False)

    if group is not None:
        line("group", f"{group['id']}: {group['baseline_build'] or '?'} -> {group['build']}, "
                      f"{len(group['devices'])} devices x {len(group['metrics'])} metrics, {group['size']} alerts "
                      f"({_counts(group['states'])}); owner {group['owner'] or '-'}; bug {group['bug_url'] or '-'}")
    for change in detail.get("environment_change") or []:
        line("environment changed", change)
    if detail.get("environment"):
        line("environment", detail["environment"])
    for key in ("baseline_build", "metric"):
        if data[key]:
            line(key, data[key])
    if data["ratio"] is not None:
        line("ratio", f"{numbers.ratio(data['ratio'])} ({numbers.change(data['ratio'])}), 95% CI "
                      f"{numbers.interval(data['ci_low'], data['ci_high'])}, p={_p(data['p_value'])}")
    for key, n_key in (("baseline_median", "n_baseline"), ("candidate_median", "n_candidate")):
        if key in detail:
            n = f" (n={detail[n_key]})" if n_key in detail else ""
            line(key, numbers.metric_value(metric, detail[key], unit) + n)
    if "min_effect" in detail and detail["min_effect"] is not None:
        line("minimum effect", f"{detail['min_effect'] * 100:.1f}%")
    if detail.get("reason"):
        line("reason", detail["reason"])
    if "psnr_db" in detail:
        line("PSNR", f"{detail['psnr_db']:.1f} dB")
    for key in ("batch", "note"):
        if data[key] not in (None, ""):
            line(key, str(data[key]))
    for key, name, title in (("attribution_by_op", "op", "attribution by op"),
                             ("attribution", "kernel", "kernel attribution")):
        if detail.get(key):
            table = Table(name, "baseline ms", "candidate ms", "delta ms", "share", title=title)
            for m in detail[key]:
                table.add_row(m[name], numbers.plain(m["baseline_ms"]), numbers.plain(m["candidate_ms"]),
                              _signed_ms(m["delta_ms"]), _share(m["share"]))
            console.print(table)
    if detail.get("images"):
        console.print(f"image before: {detail['images']['before']}\nimage after:  {detail['images']['after']}",
                      highlight=False)
    for point in detail.get("change_points", []):
        console.print(f"change point at build {point['build']} (ratio {numbers.ratio(point['ratio'])}, "
                      f"p={_p(point['p_value'])})", highlight=False)


# ---- groups -------------------------------------------------------------------------------

group_app = typer.Typer(help="Alert groups: the alerts one build raised against one baseline.", no_args_is_help=True)
app.add_typer(group_app, name="group")


@group_app.command("show")
def group_show(group_id: int = GROUP_ID, as_json: bool = common.JSON_OPTION):
    """Show one group: its builds, owner, bug and note, and every alert in it."""
    from orchestrator import store

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        data = group_dict(common.get_or_fail(store.get_alert_group, session, group_id))
        shown = labels.build_names(session, [data["baseline_build"], data["build"]])
    if as_json:
        common.print_json(data)
        return
    base, cand = shown.get(data["baseline_build"], "?"), shown[data["build"]] if data["build"] else "?"
    console.print(f"[bold]group {data['id']}[/]: {escape(cand)} against {escape(base)}, "
                  f"{len(data['devices'])} devices x {len(data['metrics'])} metrics, worst "
                  f"{numbers.change(data['worst_ratio'])} (alert {data['worst_alert'] or '-'})", highlight=False)
    for key, text in (("alerts", _counts(data["states"])), ("kinds", _counts(data["kinds"])),
                      ("owner", data["owner"] or "-"), ("bug", data["bug_url"] or "-"), ("note", data["note"] or "-")):
        console.print(f"{key}: {text}", highlight=False, markup=False)
    table = Table("alert", "kind", "state", "device", "metric", "ratio", "change", "95% CI", "p")
    for a in data["alerts"]:
        table.add_row(str(a["id"]), a["kind"], a["state"], a["device"] or "-", a["metric"] or "-",
                      numbers.ratio(a["ratio"]), numbers.change(a["ratio"]), numbers.interval(a["ci_low"], a["ci_high"]),
                      _p(a["p_value"]))
    console.print(table)
    labels.legend(shown)


def _triage(alert_id: int | None, group_id: int | None, only: list[int] | None, state, note: str | None) -> None:
    from orchestrator import store

    if (alert_id is None) == (group_id is None):
        common.fail("give an alert id or --group ID (one of them): `farm regressions list` shows groups, "
                    "`farm regressions list --alerts` alerts")
    if only and group_id is None:
        common.fail("--only picks alerts of a group: give --group ID too")
    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            if group_id is None:
                store.triage_alert(session, alert_id, state, note)
                said = f"alert {alert_id} {state}"
            else:
                view = store.triage_group(session, group_id, state, note, only or None)
                count = len(view.triaged)
                said = f"group {group_id}: {count} alert{'s' if count != 1 else ''} {state} ({_counts(view.states)})"
        except store.StoreError as exc:
            common.fail(str(exc))
        session.commit()
    console.print(said, highlight=False)


NOTE_OPTION = typer.Option(None, "--note", help="Why (kept on the alert).")
OPTIONAL_ALERT_ID = typer.Argument(None, help="Alert id (or give --group).", parser=validate.record_id,
                                   show_default=False)
GROUP_OPTION = typer.Option(None, "--group", help="The open alerts of this group (`farm regressions list`); "
                            "a closed one only with --only.", parser=validate.record_id)
ONLY_OPTION = typer.Option(None, "--only", help="With --group: only this alert of it, whatever its state "
                           "(repeat for several).", parser=validate.record_id)


@app.command()
def ack(alert_id: int = OPTIONAL_ALERT_ID, group: int = GROUP_OPTION, only: list[int] = ONLY_OPTION,
        note: str = NOTE_OPTION):
    """Acknowledge an alert, or the group's open alerts: someone is on it."""
    from orchestrator.store.models import AlertState

    _triage(alert_id, group, only, AlertState.acknowledged, note)


@app.command()
def invalidate(alert_id: int = OPTIONAL_ALERT_ID, group: int = GROUP_OPTION, only: list[int] = ONLY_OPTION,
               note: str = NOTE_OPTION):
    """Mark an alert, or the group's open alerts, invalid (noise, a broken device): its build becomes a baseline again."""
    from orchestrator.store.models import AlertState

    _triage(alert_id, group, only, AlertState.invalid, note)


@app.command()
def fixed(alert_id: int = OPTIONAL_ALERT_ID, group: int = GROUP_OPTION, only: list[int] = ONLY_OPTION,
          note: str = NOTE_OPTION):
    """Mark an alert, or the group's open alerts, fixed."""
    from orchestrator.store.models import AlertState

    _triage(alert_id, group, only, AlertState.fixed, note)


@app.command()
def assign(
    group_id: int = GROUP_ID,
    owner: str = typer.Option(None, "--owner", help="Who is on it (\"\" clears it)."),
    bug: str = typer.Option(None, "--bug", help="The bug's http(s) link (\"\" clears it)."),
    note: str = typer.Option(None, "--note", help="The group's note (\"\" clears it)."),
):
    """Give a group an owner, a bug link and a note."""
    from orchestrator import store

    if owner is None and bug is None and note is None:
        common.fail("nothing to set: give --owner, --bug or --note")
    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            view = store.update_alert_group(session, group_id, owner=owner, bug_url=bug, note=note)
        except store.StoreError as exc:
            common.fail(str(exc))
        session.commit()
        console.print(f"group {group_id}: owner {view.group.owner or '-'}, bug {view.group.bug_url or '-'}"
                      + (f", note {view.group.note}" if view.group.note else ""), highlight=False, markup=False)


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
    good: str = typer.Option(..., "--good", help="A build without the regression (id, label or name).",
                             autocompletion=completion.builds),
    bad: str = typer.Option(..., "--bad", help="A build with it.", autocompletion=completion.builds),
    device: str = typer.Option(..., "--device", help="Device serial to run on.", autocompletion=completion.devices),
    metric: str = typer.Option("unet_step_ms", "--metric", help="Metric that regressed."),
    repetitions: int = typer.Option(10, "--repetitions", min=validate.REPETITIONS,
                                    help="Timed generations and UNet steps per build run (at least 5; 10 by "
                                    "default: each bisect step decides alone, with no more-repetitions rounds)."),
    timeout: float = typer.Option(3600.0, "--timeout", help="Seconds to wait for each build's run."),
    as_json: bool = common.JSON_OPTION,
):
    """Find the first bad build between --good and --bad (builds in the order they were made)."""
    from orchestrator import store
    from orchestrator.analysis import regressions
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.jobs.jobservice import launch_suite
    from orchestrator.services import progress as watched
    from orchestrator.store.models import Build, JobKind

    from .watching import Reporter

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
                # Its jobs line by line (a live table on a terminal), a host no worker serves named.
                with Reporter(f"running {name} on {device}", quiet=as_json, summary=False) as reporter:
                    ending = watched.watch(sessions, settings, lambda s: watched.batch_steps(s, [batch_id]), reporter,
                                           done=lambda s, _: store.get_batch(s, batch_id).finished_at is not None,
                                           timeout_s=timeout, poll_s=1.0)
                if ending.reason != "done":
                    silent = "".join(f"; {s.text(ending.now)}" for s in ending.silent)
                    common.could_not_run(f"{name} did not finish on {device} within {timeout:g} s{silent}")
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
