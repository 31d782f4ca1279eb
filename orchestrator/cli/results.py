"""`farm results ...`: what the runs measured. `list` gives one row per run with the medians
of its key metrics, `show` one run in full (the environment it ran in, every metric's n,
median, min and max, kernel times summed per kernel, thermal readings, images, cool-down), `export --csv` every raw
sample of the runs matching the filters, streamed to a file. Reads go through
orchestrator/store/queries.py."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import Any

import typer

from orchestrator.store.models import JobKind

from . import completion, labels, numbers, validate
from .common import (
    JSON_OPTION,
    cli_settings,
    fail,
    iso,
    open_store,
    print_json,
    print_json_or_empty,
)
from .jobs import _state, _when
from .output import Table, console

app = typer.Typer(help="Read and export what the runs measured.", no_args_is_help=True)

DEVICE_OPTION = typer.Option(None, "--device", help="Only runs on this device (serial).",
                             autocompletion=completion.devices)
BUILD_OPTION = typer.Option(None, "--build", help="Only runs of this build (id, label or name).",
                            autocompletion=completion.builds)
METRIC_OPTION = typer.Option(None, "--metric", help="Only runs that measured this metric (e.g. unet_step_ms).")
KIND_OPTION = typer.Option(None, "--kind", help="Only runs of jobs of this kind.")


def _resolve(session, device: str | None, build: str | None) -> tuple[int | None, int | None]:
    """Device and build names to ids; an unknown one is the user's error, not an empty list."""
    from orchestrator import store

    try:
        device_id = store.get_device(session, device).id if device else None
        build_id = store.get_build(session, build).id if build else None
    except store.StoreError as exc:
        fail(str(exc))
    return device_id, build_id


@app.command("list")
def list_results(
    device: str = DEVICE_OPTION,
    build: str = BUILD_OPTION,
    metric: str = METRIC_OPTION,
    kind: JobKind = KIND_OPTION,
    limit: int = typer.Option(50, "--limit", min=1, help="At most this many runs, newest first."),
    as_json: bool = JSON_OPTION,
):
    """One row per run: job, device, build, status and the medians of its key metrics."""
    from orchestrator.store import queries

    with open_store(cli_settings()) as sessions, sessions() as session:
        device_id, build_id = _resolve(session, device, build)
        runs = queries.list_runs(session, device_id=device_id, build_id=build_id, metric=metric, kind=kind,
                                 limit=limit)
        shown = labels.build_names(session, [r.build for r in runs])
    rows = [{"run_id": r.id, "job_id": r.job_id, "attempt": r.attempt, "device": r.device, "build": r.build,
             "kind": r.kind, "status": r.status, "started_at": iso(r.started_at), "finished_at": iso(r.finished_at),
             "medians": r.medians} for r in runs]
    if print_json_or_empty(rows, as_json, "no runs" + (" match" if any((device, build, metric, kind)) else
                                                       "; run some with `farm jobs submit latency --all`")):
        return
    metrics = [m for m in queries.KEY_METRICS if any(m in r.medians for r in runs)]
    if metric and metric not in metrics:
        metrics.append(metric)
    table = Table("run", "job", "device", "build", "kind", "status", "finished", *metrics,
                  drop_first=("job", "kind", "finished", "status"), keep=("device", *metrics[:1]))
    for r in runs:
        table.add_row(str(r.id), str(r.job_id), r.device, shown.get(r.build or "", "-"), r.kind, _state(r.status),
                      _when(r.finished_at), *(numbers.metric_value(m, r.medians.get(m)) for m in metrics))
    console.print(table)
    labels.legend(shown)


def run_dict(session, run_id: int) -> dict[str, Any]:
    from orchestrator.store import queries

    run = queries.get_run(session, run_id)
    return {
        "run_id": run.id,
        "job_id": run.job_id,
        "attempt": run.attempt,
        "device": run.job.device.serial,
        "build": run.job.build.name if run.job.build is not None else None,
        "build_label": run.job.build.label if run.job.build is not None else None,
        "kind": str(run.job.kind),
        "status": str(run.status),
        "error": run.error,
        "adapter": run.adapter,
        "started_at": iso(run.started_at),
        "finished_at": iso(run.finished_at),
        "cooldown": {"wait_s": run.cooldown_wait_s, "timed_out": run.cooldown_timed_out},
        "engine": run.engine,
        "environment": run.environment,
        "env_key": run.env_key,
        "metrics": queries.metric_stats(session, run.id),
        "kernels": queries.kernel_totals(session, run.id),
        "thermal": [{"phase": t.phase, "zone": t.zone, "celsius": t.celsius}
                    for t in queries.thermal_readings(session, run.id)],
        "images": [{"path": i.path, "sha256": i.sha256, "size": i.size, "prompt": i.prompt, "seed": i.seed}
                   for i in queries.images(session, run.id)],
        "artifacts": run.artifacts,
    }


@app.command()
def show(run_id: int = typer.Argument(..., help="Run id (`farm results list`).", parser=validate.record_id),
         as_json: bool = JSON_OPTION):
    """One run in full: every metric, kernel times, thermal readings, images, cool-down."""
    from orchestrator import store

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:
            data = run_dict(session, run_id)
        except store.StoreError as exc:
            fail(str(exc))
    if as_json:
        print_json(data)
        return
    engine = data["engine"] or {}
    cooldown = data["cooldown"]
    head = Table(show_header=False, box=None)
    for key in ("run_id", "job_id", "attempt", "device", "build", "kind", "status", "adapter", "started_at",
                "finished_at", "error"):
        value = data[key]
        if key == "build" and data["build_label"]:
            value = f"{data['build_label']} = {value}"
        head.add_row(key, _state(value) if key == "status" else "-" if value in (None, "") else str(value))
    for key in ("profile", "precision", "height", "width"):
        if key in engine:
            head.add_row(key, str(engine[key]))
    head.add_row("cool-down", "-" if cooldown["wait_s"] is None else
                 f"waited {cooldown['wait_s']:.1f} s" + (" (timed out)" if cooldown["timed_out"] else ""))
    console.print(head)
    if data["environment"]:
        from orchestrator.store.environment import describe

        environment = Table(show_header=False, box=None, title=f"environment {data['env_key']}")
        for key, text in describe(data["environment"]).items():
            environment.add_row(key, text)
        console.print(environment)

    metrics = Table("metric", "unit", "n", "median", "min", "max", title="metrics")
    for m in data["metrics"]:
        metrics.add_row(m["metric"], m["unit"], str(m["n"]), *(f"{m[k]:,.3f}" for k in ("median", "min", "max")))
    console.print(metrics if data["metrics"] else "no samples")
    if data["kernels"]:
        kernels = Table("kernel", "calls", "total ms", "repetitions", "ms per repetition", title="kernel timings")
        for k in data["kernels"]:
            per = k["ms_per_repetition"]
            kernels.add_row(k["kernel"], str(k["calls"]), f"{k['total_ms']:,.3f}", str(k["repetitions"]),
                            "-" if per is None else f"{per:,.3f}")
        console.print(kernels)
    if data["thermal"]:
        thermal = Table("phase", "zone", "celsius", title="thermal")
        for t in data["thermal"]:
            thermal.add_row(t["phase"], t["zone"], f"{t['celsius']:.1f}")
        console.print(thermal)
    for image in data["images"]:
        console.print(f"image: {image['path']} ({image['size']:,} bytes, sha256 {image['sha256'][:12]}, "
                      f"seed {image['seed']})", highlight=False, soft_wrap=True)


@app.command()
def export(
    csv_path: Path = typer.Option(..., "--csv", help="File to write (- for stdout)."),
    device: str = DEVICE_OPTION,
    build: str = BUILD_OPTION,
    metric: str = typer.Option(None, "--metric", help="Only this metric's samples."),
    kind: JobKind = KIND_OPTION,
):
    """Write every raw sample of the matching runs as CSV, one row per sample."""
    from orchestrator.store import queries

    to_stdout = str(csv_path) == "-"
    with open_store(cli_settings()) as sessions:
        with sessions() as session:
            device_id, build_id = _resolve(session, device, build)
        rows = queries.iter_samples(sessions, device_id=device_id, build_id=build_id, metric=metric, kind=kind)
        try:
            out = sys.stdout if to_stdout else csv_path.expanduser().open("w", newline="", encoding="utf-8")
        except OSError as exc:
            fail(f"cannot write {csv_path}: {exc.strerror or exc}")
        count, runs = 0, set()
        try:
            writer = csv.writer(out)
            writer.writerow(queries.EXPORT_COLUMNS)
            for row in rows:
                writer.writerow(row)
                count += 1
                runs.add(row[0])
        finally:
            if not to_stdout:
                out.close()
    if not to_stdout:
        console.print(f"wrote {count:,} samples of {len(runs):,} runs to {csv_path}", highlight=False)
