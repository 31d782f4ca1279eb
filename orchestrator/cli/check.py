"""`farm check`: the CI gate. Parses, runs the check (orchestrator/services/check.py), prints one table,
writes --json and --markdown, and exits 0 (no regression), 1 (a regression), 2 (undecided
after the budget), 3 (bad input: unknown build, device or metric, a bad option) or 4 (the
check could not run: a job failed, time ran out, no worker took its jobs within
--no-worker-timeout; its jobs are cancelled and --json and --markdown still say what it did).
While it waits it shows each device's jobs (orchestrator/cli/watching.py: a live table, or a
line per change when piped). Usage errors exit 3, as in every verb (cli/validate.py's FarmGroup),
not Click's 2, which would read as "undecided"."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from . import completion, labels, numbers, validate
from .common import cli_settings, current_user, open_store
from .output import Table, console, err_console, escape
from .watching import Reporter


def _bad(message: str, code: int) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def check(
    build: str = typer.Option(..., "--build", help="The candidate build (id, label or name).",
                              autocompletion=completion.builds),
    baseline: str = typer.Option(None, "--baseline", help="The build to compare with (default: each device's "
                                 "series' last accepted build, else the build made before the candidate)."),
    devices: list[str] = typer.Option(None, "--device", help="Device serial (repeat for several).",
                                      autocompletion=completion.devices),
    every: bool = typer.Option(False, "--all", help="Every device that is not quarantined."),
    metrics: list[str] = typer.Option(None, "--metric", help="Metric to gate on (repeat; default: unet_step_ms, "
                                      "e2e_ms, peak_gpu_bytes)."),
    json_path: Path = typer.Option(None, "--json", help="Write the report as JSON to this file."),
    markdown_path: Path = typer.Option(None, "--markdown", help="Write a Markdown summary (a PR comment)."),
    max_rounds: int = typer.Option(2, "--max-rounds", min=0, help="More-repetitions rounds after the first."),
    pairs: int = typer.Option(2, "--pairs", min=1, help="Baseline/candidate runs per device, interleaved."),
    precision: str = validate.precision_option(),
    steps: int = typer.Option(4, "--steps", min=1, help="Denoising steps per generation."),
    resolution: str = validate.resolution_option(),
    size: int = typer.Option(None, "--size", min=8, hidden=True, help="Deprecated: --resolution."),
    repetitions: int = validate.repetitions_option(),
    unet_repetitions: int = validate.unet_repetitions_option(),
    images: bool = typer.Option(True, "--images/--no-images", help="One generation of each build per device, "
                                "compared for image fidelity."),
    timeout: float = typer.Option(3600.0, "--timeout", min=1, help="Give up (exit 4) after this many seconds."),
    no_worker_timeout: float = typer.Option(45.0, "--no-worker-timeout", min=0,
                                            help="Give up (exit 4) when no worker has consumed a device's queue "
                                            "for this many seconds."),
):
    """Gate a change: run CANDIDATE against a baseline, interleaved, on each device; exit 0 no
    regression, 1 regression, 2 undecided, 3 bad input, 4 could not run."""
    from orchestrator.analysis import regressions
    from orchestrator.services import check as gate

    if bool(devices) == every:
        raise _bad("name devices with --device, or give --all (not both)", gate.BAD_INPUT)
    if size is not None:  # the old name of --resolution, kept for CI scripts that pass it
        err_console.print("warning: --size is deprecated; give --resolution", highlight=False, markup=False)
        resolution = resolution or validate.resolution(str(size))
    spec = gate.latency_spec(precision=precision, steps=steps, repetitions=repetitions,
                             unet_repetitions=unet_repetitions, timeout_s=timeout)
    if resolution:
        spec |= {"height": resolution[0], "width": resolution[1]}
    request = gate.CheckRequest(candidate=build, baseline=baseline, devices="all" if every else list(devices),
                                holder=current_user(),
                                metrics=tuple(metrics or regressions.HEADLINE_METRICS), spec=spec, pairs=pairs,
                                max_rounds=max_rounds, images=images, timeout_s=timeout,
                                no_worker_s=no_worker_timeout)
    settings = cli_settings()
    try:
        report = _run(gate, settings, request, build)
    except typer.Exit as exc:
        # open_store's one red line (a store it cannot open) exits 4 already; nothing exits 1
        # for an error, which would read as a regression.
        raise typer.Exit(gate.FAILED if exc.exit_code == 1 else exc.exit_code) from None
    except gate.CheckFailed as exc:
        if exc.report is not None:  # what it did, for CI to attach: written before the error line
            _write(gate, exc.report, json_path, markdown_path)
        raise _bad(str(exc), gate.FAILED) from None
    _write(gate, report, json_path, markdown_path)
    _print(report)
    raise typer.Exit(report["exit_code"])


def _write(gate, report: dict, json_path: Path | None, markdown_path: Path | None) -> None:
    if json_path:
        json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if markdown_path:
        markdown_path.write_text(gate.markdown(report))


def _run(gate, settings, request, build: str) -> dict:
    from orchestrator.jobs.celery_app import make_celery

    with open_store(settings) as sessions:
        try:
            def progress(line: str) -> None:  # the rounds; the watch's reports go to the Reporter
                console.print(line, highlight=False, markup=False)

            with Reporter(f"checking {build}", summary=False) as reporter:
                report = gate.run_check(make_celery(settings), sessions, request, progress, reporter)
        except gate.CheckInput as exc:
            raise _bad(str(exc), gate.BAD_INPUT) from None
    return report


def _print(report: dict) -> None:
    from orchestrator.services.check import fidelity_text

    display = report.get("display") or {}  # build name -> its label or distinguishing end
    table = Table("device", "metric", "baseline build", "baseline", "candidate", "ratio", "95% CI", "verdict",
                  "rounds",
                  title=f"{display.get(report['candidate'], report['candidate'])} against its baseline: "
                        f"{report['outcome']}")
    for c in report["comparisons"]:
        baseline = c.get("baseline_build", "-")
        table.add_row(c["device"], c["metric"], display.get(baseline, baseline),
                      numbers.metric_value(c["metric"], c.get("baseline_median")),
                      numbers.metric_value(c["metric"], c.get("candidate_median")),
                      numbers.ratio(c.get("ratio")), numbers.interval(c.get("ci_low"), c.get("ci_high")),
                      c["verdict"], str(c.get("rounds", "-")))
    console.print(table)
    labels.legend(display)
    for f in report["fidelity"]:
        if "error" not in f:
            console.print(f"{f['device']}: image against the baseline: {fidelity_text(f)}", highlight=False)
    for c in report["comparisons"]:
        if c["verdict"] not in ("same", "improvement", "regression"):
            console.print(f"undecided, {c['device']}, {c['metric']}: {c['reason']}", highlight=False, soft_wrap=True)
    console.print(f"exit code {report['exit_code']} ({report['outcome']})", highlight=False)
