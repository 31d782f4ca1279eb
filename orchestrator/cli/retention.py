"""`farm retention ...`: how long a run's raw data is kept (raw samples, kernel timings, images,
job log files) and what is kept of it after (orchestrator/store/retention.py). `show` prints the
policy and what applying it now would do; `apply` does it (beat does it daily). The ages come
from the settings (FARM_RETENTION_*_DAYS, farm.toml), or from the command line for one run."""

from __future__ import annotations

from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import common
from .output import Table, console

app = typer.Typer(help="How long raw samples, kernel timings, images and job logs are kept.",
                  no_args_is_help=True)


def _days(name: str, what: str) -> Any:
    return typer.Option(None, f"--{name}-days", min=0, help=f"Keep {what} this many days (0: for ever); "
                        f"default: the setting retention_{name}_days.")


RAW, KERNEL = _days("raw", "raw samples"), _days("kernel", "kernel timings")
IMAGE, LOG = _days("image", "images"), _days("log", "job log files")


def _settings(raw: float | None, kernel: float | None, image: float | None, log: float | None):
    try:
        return common.cli_settings(retention_raw_days=raw, retention_kernel_days=kernel,
                                   retention_image_days=image, retention_log_days=log)
    except ValueError as exc:  # pydantic's ValidationError: a FARM_* variable or farm.toml value
        errors = exc.errors() if callable(getattr(exc, "errors", None)) else []
        if not errors:
            common.fail(str(exc))
        name = ".".join(str(part) for part in errors[0].get("loc", ())) or "settings"
        common.fail(f"bad setting {name} (FARM_{name.upper()} or farm.toml): {errors[0]['msg']}, "
                    f"got {errors[0].get('input')!r}")


def _apply(settings, dry_run: bool, quiet: bool):
    from orchestrator.store import retention

    with common.open_store(settings) as sessions:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True, disable=quiet or not console.is_terminal) as bar:
            tasks: dict[str, Any] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = bar.add_task(stage, total=total)
                bar.update(tasks[stage], completed=done, total=total)

            return retention.apply(sessions, retention.Policy.of(settings), settings.data_dir, dry_run=dry_run,
                                   progress=progress)


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def _print_report(report, verb: dict[str, str]) -> None:
    r = report
    console.print(f"{verb['downsample']} {r.runs_downsampled:,} runs: {r.summaries:,} sample sets summarized "
                  f"({r.sample_rows_removed:,} rows fewer), {r.kernel_rows_removed:,} kernel-timing rows fewer; "
                  f"{r.runs_protected:,} old runs kept raw (open alerts' builds and baselines, the newest builds)",
                  highlight=False, markup=False)
    console.print(f"{verb['delete']} {r.images_deleted:,} images ({_size(r.image_bytes)}); {r.images_kept:,} old "
                  f"images kept (the newest of their device, workload, prompt and seed, or a protected run's)"
                  + (f"; {r.image_files_left:,} files outside the data dir left in place" if r.image_files_left
                     else ""), highlight=False, markup=False)
    console.print(f"{verb['delete']} {r.log_files_deleted:,} job log files ({_size(r.log_bytes)})",
                  highlight=False, markup=False)


@app.command()
def show(raw: float = RAW, kernel: float = KERNEL, image: float = IMAGE, log: float = LOG,
         as_json: bool = common.JSON_OPTION):
    """The retention policy, and what applying it now would do (a dry run: nothing changes)."""
    from orchestrator.store import retention

    settings = _settings(raw, kernel, image, log)
    policy = retention.Policy.of(settings)
    report = _apply(settings, dry_run=True, quiet=as_json)
    if as_json:
        common.print_json({"policy": policy.describe(), "would": report.as_dict()})
        return
    table = Table("data", "kept", "then", "setting")
    for row in policy.describe():
        table.add_row(row["data"], f"{row['days']:g} days" if row["days"] else "for ever", row["then"],
                      row["setting"])
    console.print(table)
    console.print("a run's age counts from its job's end, by the control plane's clock; applying the policy now "
                  "would:", highlight=False, markup=False)
    _print_report(report, {"downsample": "  downsample", "delete": "  delete"})


@app.command("apply")
def apply_policy(raw: float = RAW, kernel: float = KERNEL, image: float = IMAGE, log: float = LOG,
                 dry_run: bool = typer.Option(False, "--dry-run", help="Say what would change; change nothing."),
                 as_json: bool = common.JSON_OPTION):
    """Apply the retention policy now: downsample old runs, delete old images and job logs.

    What beat does daily; a few hundred runs a transaction, so the farm keeps running meanwhile."""
    settings = _settings(raw, kernel, image, log)
    report = _apply(settings, dry_run=dry_run, quiet=as_json)
    if as_json:
        common.print_json(report.as_dict())
        return
    if dry_run:
        _print_report(report, {"downsample": "would downsample", "delete": "would delete"})
    else:
        _print_report(report, {"downsample": "downsampled", "delete": "deleted"})
        console.print(f"{_size(report.bytes_freed)} of files freed", highlight=False, markup=False)
