"""`farm deploy BUILD`: send a build to devices through their hosts' workers, in parallel,
following each deployment's bytes as they are sent (a live table, or a line per change when
piped: orchestrator/cli/watching.py); only files a device lacks are pushed. A host whose queue
no worker consumes is named within seconds, with the command that starts one, and again with
every reminder while the deploy waits; at --timeout it exits 4 (the deployments go on)."""

from __future__ import annotations

from typing import Any

import typer

from . import completion
from .common import COULD_NOT_RUN, JSON_OPTION, cli_settings, fail, open_store, print_json
from .output import Table, console, escape
from .watching import Reporter

DEFAULT_TIMEOUT_S = 1800.0
POLL_S = 0.25


def deploy(
    build: str = typer.Argument(..., help="Build id, label or name (`farm builds list`).",
                                autocompletion=completion.builds),
    device: list[str] = typer.Option(None, "--device", "-d", help="Device serial (repeatable).",
                                     autocompletion=completion.devices),
    all_devices: bool = typer.Option(False, "--all", help="Every device that is not quarantined."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, "--timeout", help="Give up waiting after this many seconds "
                                  "(the deployments go on)."),
    allow_downgrade: bool = typer.Option(False, "--allow-downgrade",
                                         help="Make the build current on devices whose current build is newer "
                                              "(without it, an older build is installed beside the current one)."),
    as_json: bool = JSON_OPTION,
):
    """Deploy a build to devices; exits 4 (could not run) when any deployment fails or time runs out."""

    from orchestrator import store
    from orchestrator.jobs.celery_app import make_celery
    from orchestrator.jobs.health import stored_input_error
    from orchestrator.jobs.jobservice import deploy_build

    if bool(device) == all_devices:
        fail("name devices with --device SERIAL (repeatable) or pass --all")
    settings = cli_settings()
    with open_store(settings) as sessions:
        with sessions() as session:
            try:
                build_row = store.get_build(session, int(build) if build.isdigit() else build)
                if all_devices:
                    targets = store.in_service_devices(session)
                else:
                    targets = [store.get_device(session, serial) for serial in dict.fromkeys(device)]
            except store.StoreError as exc:
                fail(str(exc))
            if not targets:
                fail("no devices to deploy to; `farm devices add` registers one")
            unusable = [problem for problem in map(stored_input_error, targets) if problem]
            if unusable:
                fail("; ".join(unusable))
            bundle = settings.data_dir / "builds" / build_row.name
            if not bundle.is_dir():
                fail(f"{bundle}: the bundle of build {build_row.name} is not on this machine "
                     "(workers read it from the shared data dir)")
            plan = [(d.id, d.serial, None) for d in targets]
            build_id, build_name = build_row.id, build_row.name
            # The deployments are found again by their batch (no clock comparisons across hosts).
            batch_id = store.create_batch(session, f"deploy {build_name}", build_id=build_id).id
            session.commit()
        deploy_build(make_celery(settings), build_id, [device_id for device_id, _, _ in plan], batch_id,
                     allow_downgrade=allow_downgrade)
        rows = _follow(sessions, settings, batch_id, {device_id: serial for device_id, serial, _ in plan},
                       build_name, timeout, quiet=as_json, title=f"deploying {build_name}")
    if as_json:
        print_json(rows)
    for r in rows if not as_json else ():
        if r.get("note"):
            console.print(f"note: {escape(r['device'])}: {escape(r['note'])}", highlight=False)
    failed = [r for r in rows if r["status"] != "succeeded"]
    if failed:
        for r in failed if not as_json else ():  # the JSON carries each device's status and error
            console.print(f"[bold red]error:[/] {escape(r['device'])}: {escape(r['error'] or r['status'])}",
                          highlight=False)
        raise typer.Exit(COULD_NOT_RUN)  # a deployment failed, or time ran out: the farm could not do it


def _follow(sessions, settings, batch_id: int, devices: dict[int, str], build: str, timeout: float, *,
            quiet: bool, title: str) -> list[dict[str, Any]]:
    """Watch the deployments of batch `batch_id` to `devices` until all end (or `timeout`)."""
    from orchestrator import store
    from orchestrator.services import progress as watched

    rows: dict[int, dict[str, Any]] = {device_id: {"device": serial, "status": "queued", "bytes_sent": 0,
                                                   "bytes_total": None, "files_sent": 0, "files_skipped": 0,
                                                   "duration_s": None, "error": None}
                                       for device_id, serial in devices.items()}

    def read(session) -> list[watched.Step]:
        deployments = store.deployments_of_batch(session, batch_id)
        rows.update({dep.device_id: _row(dep, devices[dep.device_id]) for dep in deployments})
        return watched.deployment_steps(deployments, devices, session, build)

    with Reporter(title, quiet=quiet, view=lambda p: _table(title, list(rows.values()))) as reporter:
        ending = watched.watch(sessions, settings, read, reporter, timeout_s=timeout, poll_s=POLL_S)
    if ending.reason != "done":
        silent = f"; {'; '.join(s.text(ending.now) for s in ending.silent)}" if ending.silent else ""
        for r in rows.values():
            if r["status"] not in ("succeeded", "failed"):
                r["error"] = f"still {r['status']} after {timeout:g} s (it goes on in its worker){silent}"
    return [rows[d] for d in devices]


def _row(dep, serial: str) -> dict[str, Any]:
    return {"device": serial, "deployment": dep.id, "status": str(dep.status), "bytes_sent": dep.bytes_sent,
            "bytes_total": dep.bytes_total, "files_sent": dep.files_sent, "files_skipped": dep.files_skipped,
            "duration_s": dep.duration_s, "error": dep.error, "note": dep.note}


def _table(title: str, rows: list[dict[str, Any]]) -> Table:
    from orchestrator.services.progress import mib

    table = Table("device", "status", "sent", "files sent", "files already there", "seconds", title=title)
    for r in rows:
        sent = mib(r["bytes_sent"]) + (f" / {mib(r['bytes_total'])}" if r["bytes_total"] else "")
        seconds = f"{r['duration_s']:.1f}" if r["duration_s"] is not None else "-"
        table.add_row(r["device"], r["status"], sent, str(r["files_sent"]), str(r["files_skipped"]), seconds)
    return table
