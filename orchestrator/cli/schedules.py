"""`farm schedules ...`: recurring suites kept in the database (cron expression read in a time
zone). Beat (`farm beat`) fires each due schedule once: the build (the newest at firing time,
or a named one) is deployed to the schedule's devices, its jobs run on each, and the batch's
analysis follows when the last job settles."""

from __future__ import annotations

import datetime as dt
from typing import Any

import typer

from . import completion, validate
from .common import JSON_OPTION, cli_settings, fail, get_or_fail, iso, open_store, print_json
from .output import Table, console

app = typer.Typer(help="Nightly (or any cron) suites: deploy, run, analyse.", no_args_is_help=True)

JOB_KINDS = ("generate", "latency", "tune")


def schedule_dict(schedule, now: dt.datetime) -> dict[str, Any]:
    from orchestrator import store

    suite = schedule.suite or {}
    error = schedule.last_error
    try:
        next_at = (store.next_fire_time(schedule.cron, schedule.timezone, max(now, schedule.last_run_at or now))
                   if schedule.enabled else None)
    except Exception as exc:  # noqa: BLE001  (a stored cron or zone this version cannot read: this row's error)
        next_at, error = None, f"cannot fire: {exc}"
    return {"id": schedule.id, "name": schedule.name, "cron": schedule.cron, "timezone": schedule.timezone,
            "enabled": schedule.enabled, "build": suite.get("build"), "devices": suite.get("devices"),
            "jobs": suite.get("jobs"), "last_run_at": iso(schedule.last_run_at), "next_run_at": iso(next_at),
            "error": error}


@app.command()
def add(
    name: str = typer.Argument(..., help="Schedule name."),
    cron: str = typer.Option(..., "--cron", help="Five-field cron expression, e.g. '0 2 * * *' (02:00 daily)."),
    timezone: str = typer.Option("UTC", "--tz", help="IANA time zone the cron expression is read in."),
    build: str = typer.Option(None, "--build", help="Build to run: id, label or name (default: the newest build "
                              "at firing time).", autocompletion=completion.builds),
    device: list[str] = typer.Option(None, "--device", "-d", help="Device serial (repeatable; default: all).",
                                     autocompletion=completion.devices),
    job: list[str] = typer.Option(None, "--job", help="Job kind to run on each device, in order (repeatable; "
                                  "default: latency)."),
    model: str = typer.Option(None, "--model", help="Model folder in the build (default: its only one).",
                              callback=validate.path_in_build),
    precision: str = validate.precision_option(),
    steps: int = typer.Option(None, "--steps", min=1, help="Denoising steps (default: the job's, 20)."),
    resolution: str = validate.resolution_option(),
    repetitions: int = validate.repetitions_option(),
    profile: str = typer.Option(None, "--profile", help="Kernel profile (auto, reference, a name or a path).",
                                callback=validate.path_in_build),
    prompt: str = typer.Option(None, "--prompt", help="Prompt of generate and latency jobs."),
    seed: int = typer.Option(None, "--seed", help="Seed."),
    cooldown: float = typer.Option(None, "--cooldown", help="Before each job, wait until the device is at "
                                   "most this many degrees C (or until its temperature has settled)."),
    cooldown_wait: float = typer.Option(None, "--cooldown-wait", min=0, help="Longest cool-down wait, seconds "
                                        "(default 300)."),
    tuning_loop: bool = typer.Option(False, "--tuning-loop", help="Tune each device's GPU, then time the "
                                     "profile just tuned and its GPU family's: the analysis reports the gain "
                                     "(`farm profiles list`). Instead of --job."),
    disabled: bool = typer.Option(False, "--disabled", help="Add it disabled."),
):
    """Add a schedule."""
    from orchestrator import store

    if tuning_loop and job:
        fail("--tuning-loop runs tune, then latency with the family's and the tuned profile: give it without --job")
    if tuning_loop and profile is not None:
        fail("--tuning-loop times the family's and the tuned profile: give it without --profile")
    kinds = job or ["latency"]
    bad = [k for k in kinds if k not in JOB_KINDS]
    if bad:
        fail(f"unknown job kind {bad[0]!r}; choose from {', '.join(JOB_KINDS)}")
    spec = {key: value for key, value in {
        "model": model, "precision": precision, "steps": steps, "repetitions": repetitions,
        "profile": profile, "prompt": prompt, "seed": seed,
        "height": resolution and resolution[0], "width": resolution and resolution[1]}.items()
        if value is not None}
    if cooldown_wait is not None and cooldown is None:
        fail("--cooldown-wait needs --cooldown CELSIUS")
    if cooldown is not None:
        spec["cooldown"] = {"max_celsius": cooldown} | ({} if cooldown_wait is None else {"max_wait_s": cooldown_wait})
    entries = [{"kind": kind, "spec": spec} for kind in kinds]
    if tuning_loop:
        entries = [{"kind": "tune", "spec": spec}, {"kind": "latency", "spec": spec | {"profile": "family"}},
                   {"kind": "latency", "spec": spec | {"profile": "tuned"}}]
    _check_specs(entries)
    suite = {"build": build, "devices": list(dict.fromkeys(device)) if device else "all", "jobs": entries}
    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        try:
            if build is not None:
                store.get_build(session, build)
            for serial in device or ():
                store.get_device(session, serial)
            schedule = store.create_schedule(session, name, cron, timezone, suite, enabled=not disabled)
        except store.StoreError as exc:
            fail(str(exc))
        session.commit()
        data = schedule_dict(schedule, store.utcnow())
    console.print(f"added schedule [bold]{name}[/] ({cron} {timezone}); next run {data['next_run_at'] or '-'}",
                  highlight=False)


def _check_specs(entries: list[dict[str, Any]]) -> None:
    """Each job of the suite read through the protocol as the worker will read it at firing
    time (the model is resolved then: any name stands for it here), so a bad number fails at
    `add`, not every night on the device."""
    from agent.protocol import JobSpec, ProtocolError, from_dict
    from orchestrator import store

    for entry in entries:
        try:
            from_dict(JobSpec, {"model": "models/checked"} | entry["spec"] | {"job_id": "schedule",
                                                                            "kind": entry["kind"]})
        except ProtocolError as exc:
            fail(store.spec_problem(exc))


@app.command("list")
def list_schedules(as_json: bool = JSON_OPTION):
    """List the schedules with their next firing."""
    from orchestrator import store

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        now = store.utcnow()
        rows = [schedule_dict(s, now) for s in store.all_schedules(session)]
        for r in rows:  # the devices its newest batch skipped: people held them (`farm devices reserve`)
            newest = store.newest_batch_skips(session, r["id"])
            r["last_batch"], r["last_batch_skipped"] = newest if newest is not None else (None, [])
    if as_json:
        print_json(rows)
        return
    table = Table()
    table.add_column("name", no_wrap=True)
    for header in ("when", "on", "build", "devices", "jobs", "cool-down", "next run (UTC)"):
        table.add_column(header)
    for r in rows:
        devices = r["devices"] if isinstance(r["devices"], str) else ", ".join(r["devices"] or [])
        next_run = r["next_run_at"][:16].replace("T", " ") if r["next_run_at"] else "-"
        table.add_row(r["name"], f"{r['cron']} {r['timezone']}", "yes" if r["enabled"] else "no",
                      r["build"] or "newest", devices, ", ".join(_job_text(j) for j in r["jobs"] or []),
                      _cooldown_text(r["jobs"]), next_run if r["next_run_at"] or not r["error"] else "never")
    console.print(table)
    for r in rows:  # whole, on lines of their own: a table cell would cut them
        if r["error"]:
            console.print(f"schedule {r['name']}: {r['error']}", highlight=False, soft_wrap=True, markup=False)
        for skipped in r["last_batch_skipped"]:
            console.print(f"schedule {r['name']}: batch {r['last_batch']} skipped {skipped['reason']}",
                          highlight=False, soft_wrap=True, markup=False)


def _job_text(entry: dict[str, Any]) -> str:
    profile = (entry.get("spec") or {}).get("profile")
    return entry["kind"] + (f" ({profile})" if profile and entry["kind"] != "tune" else "")


def _cooldown_text(jobs: list[dict[str, Any]] | None) -> str:
    """The suite's cool-down (`farm schedules add` gives every job the same spec)."""
    cooldown = next(iter(jobs or []), {}).get("spec", {}).get("cooldown")
    if not cooldown:
        return "-"
    return f"<= {cooldown['max_celsius']:g} C" + (f", {cooldown['max_wait_s']:g} s max"
                                                  if "max_wait_s" in cooldown else "")


def _set_enabled(name: str, enabled: bool) -> None:
    from orchestrator import store

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        schedule = get_or_fail(store.get_schedule, session, name)
        if enabled and not schedule.enabled:
            schedule.last_run_at = store.utcnow()  # resume from now: no burst of missed firings
        schedule.enabled = enabled
        session.commit()
    console.print(f"schedule {name} {'enabled' if enabled else 'disabled'}", highlight=False)


@app.command()
def enable(name: str = typer.Argument(..., help="Schedule name.", autocompletion=completion.schedules)):
    """Enable a schedule (it fires from now on)."""
    _set_enabled(name, True)


@app.command()
def disable(name: str = typer.Argument(..., help="Schedule name.", autocompletion=completion.schedules)):
    """Disable a schedule (kept, not fired)."""
    _set_enabled(name, False)


@app.command()
def remove(name: str = typer.Argument(..., help="Schedule name.", autocompletion=completion.schedules)):
    """Remove a schedule (its past jobs and results stay)."""
    from orchestrator import store

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        try:
            session.delete(store.get_schedule(session, name))
        except store.StoreError as exc:
            fail(str(exc))
        session.commit()
    console.print(f"removed schedule {name}", highlight=False)


@app.command("run-now")
def run_now(name: str = typer.Argument(..., help="Schedule name.", autocompletion=completion.schedules)):
    """Fire a schedule now (its regular firings are unchanged)."""
    from orchestrator import store
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.jobs.jobservice import fire_schedule

    settings = cli_settings()
    with open_store(settings) as sessions, sessions() as session:
        try:
            schedule_id = store.get_schedule(session, name).id
        except store.StoreError as exc:
            fail(str(exc))
    try:
        batch_id = fire_schedule(make_celery(settings), schedule_id, store.utcnow())
    except store.StoreError as exc:
        fail(str(exc))
    console.print(f"schedule {name} fired: batch {batch_id}; follow it with `farm jobs list --batch {batch_id}`",
                  highlight=False)
    with open_store(settings) as sessions, sessions() as session:
        for skipped in store.skipped_by_reservation(session, store.get_batch(session, batch_id)):
            console.print(f"skipped {skipped['reason']}", highlight=False, markup=False, soft_wrap=True)
        for job in store.get_batch(session, batch_id).jobs:
            if job.state == "failed" and job.attempts == 0:  # failed as it was made: it cannot fit its device
                console.print(f"job {job.id} ({job.kind}) failed at once: {job.error}", highlight=False, markup=False)
