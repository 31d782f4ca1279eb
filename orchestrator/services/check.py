"""A CI gate (`farm check`): a candidate build against a baseline on each device, measured
side by side as Pinpoint does. Each device runs the two builds' latency jobs interleaved
(baseline, candidate, baseline, candidate, ...) in one suite (orchestrator/jobs/jobservice.py), and
one generation of each for image fidelity; each metric's verdict comes from the analysis'
comparison (orchestrator/regressions.py compare_builds) of this check's runs only, so a build
can be checked against itself. A device with an undecided metric gets more-repetitions rounds
(orchestrator/jobs/batch_analysis.more_repetitions_jobs, a candidate and a baseline run each) until
every verdict is decided or `max_rounds` are spent. The outcome is an exit code: 0 no
regression, 1 a regression, 2 undecided after the budget; bad input raises CheckInput (3),
a check that could not run raises CheckFailed (4): a job failed, time ran out, or no worker
consumed a device's queue within `no_worker_s` (orchestrator/services/progress.py watches the
rounds and says so within seconds). Such a check cancels what it queued and its CheckFailed
carries the report so far (outcome "could_not_run", why, the jobs done), so that CI still
gets its JSON and Markdown."""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery import Celery

from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.analysis.stats import compare_images
from orchestrator.infra.escape import md_code
from orchestrator.jobs.batch_analysis import more_repetitions_jobs
from orchestrator.jobs.celery_app import settings_of
from orchestrator.jobs.dispatch import settle_batch
from orchestrator.jobs.jobservice import launch_suite, target_devices
from orchestrator.services import progress as watched
from orchestrator.store import Session
from orchestrator.store.models import (
    BATCH_CHECK,
    Build,
    JobKind,
    JobState,
    Run,
)

PASS, REGRESSION, UNDECIDED, BAD_INPUT, FAILED = 0, 1, 2, 3, 4
POLL_S = 1.0
COULD_NOT_RUN = "could_not_run"  # the outcome of a report that ended without its verdicts


class CheckInput(Exception):
    """Bad input: an unknown build, device or metric, or no baseline to compare with."""


class CheckFailed(Exception):
    """The check could not measure: a job failed, time ran out, or no worker took its jobs.
    `report`: what it had done by then (None when it failed before launching anything)."""

    def __init__(self, message: str, report: dict[str, Any] | None = None):
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class CheckRequest:
    candidate: str
    devices: list[str] | str  # serials, or "all"
    baseline: str | None = None  # None: each device's series' last accepted build, else the build before
    metrics: tuple[str, ...] = tuple(regressions.HEADLINE_METRICS)
    spec: dict[str, Any] = field(default_factory=dict)  # the latency jobs' spec
    pairs: int = 2  # baseline/candidate runs per device in the first round
    max_rounds: int = 2  # more-repetitions rounds after the first
    images: bool = True  # one generation of each build per device, for image fidelity
    timeout_s: float = 3600.0
    no_worker_s: float | None = watched.NO_WORKER_S  # None: wait for a worker as long as the timeout
    holder: str = ""  # who asks: a device they reserved is theirs to check on (jobservice.target_devices)


def latency_spec(*, precision: str = "fp16", steps: int = 4, size: int | None = None, repetitions: int = 5,
                 unet_repetitions: int = 10, timeout_s: float = 3600.0) -> dict[str, Any]:
    """The spec of a check's latency jobs (and, less the timing fields, of its generations):
    what `farm check` and the API's POST /v1/checks both send."""
    # One profiled UNet step a latency job: the report's kernels that moved take the median of
    # each build's profiled steps, and the interleaved pairs give each build one a pair (the
    # agent's default is one per timed step, which doubled the time a job spent on UNet steps).
    spec: dict[str, Any] = {"precision": precision, "steps": steps, "seed": 0, "warmup": 1,
                            "repetitions": repetitions, "unet_repetitions": unet_repetitions,
                            "kernel_repetitions": 1,
                            "prompt": "a red bicycle leaning on a wall", "time_limit_s": min(timeout_s, 3600.0)}
    if size:
        spec |= {"height": size, "width": size}
    return spec


@dataclass
class _Round:
    """What one round launched: batch ids, and each check job's role by (batch, entry index)."""

    batches: list[int] = field(default_factory=list)
    roles: dict[tuple[int, int], str] = field(default_factory=dict)


def builds_compared(session: Session, request: CheckRequest,
                    skipped: list[dict[str, Any]] | None = None) -> tuple[Build, dict[str, Build]]:
    """The candidate and each device's baseline (serial -> build); `skipped` gets a line for
    each device "all" left out because someone reserved it. CheckInput names what is unknown
    or missing."""
    unknown = [m for m in request.metrics if m not in regressions.HEADLINE_METRICS]
    if unknown:
        raise CheckInput(f"unknown metric {unknown[0]!r}; choose from {', '.join(regressions.HEADLINE_METRICS)}")
    try:
        candidate = store.get_build(session, request.candidate)
        named = store.get_build(session, request.baseline) if request.baseline else None
        devices = target_devices(session, request.devices, refuse_quarantined=True, holder=request.holder,
                                 skipped=skipped)
        model = store.default_model(candidate)
    except store.StoreError as exc:
        raise CheckInput(str(exc)) from None
    spec = regressions.SpecKey.of({"model": model} | request.spec)
    baselines = {}
    for device in devices:
        baseline = named
        if baseline is None:
            key = regressions.series_key(device, spec, next(iter(regressions.HEADLINE_METRICS)))
            found = regressions.baseline_build(session, candidate, device, spec, key)
            baseline = found[0] if found else next(iter(store.builds_before(session, candidate)), None)
        if baseline is None:
            raise CheckInput(f"no build before {candidate.name} to compare it with on {device.serial}; "
                             "name one with --baseline")
        baselines[device.serial] = baseline
    return candidate, baselines


def interleaved_jobs(spec: dict[str, Any], baseline: int | str, pairs: int, images: bool) -> list[dict[str, Any]]:
    """A B B A A B ...: the baseline's and the candidate's latency runs alternating on one
    device, each pair in the other order than the last, so a slow drift of the device falls
    on both, and so does anything that alternates run by run (in A B A B, b1 against itself
    came out 1.10 and 1.13 on UNet steps, the second of each pair the slower; the worker's two
    processes took the jobs in turn, the likely cause); then one generation of each, for
    fidelity."""
    a = {"kind": "latency", "spec": spec, "build": baseline, "role": "baseline"}
    b = {"kind": "latency", "spec": spec, "role": "candidate"}
    latency = [job for i in range(pairs) for job in ((a, b) if i % 2 == 0 else (b, a))]
    generate = {k: v for k, v in spec.items() if k not in ("repetitions", "unet_repetitions", "warmup",
                                                              "kernel_repetitions")}
    generate["kernel_timings"] = False  # for fidelity: no profiled step after it
    pictures = [{"kind": "generate", "spec": generate, "build": baseline, "role": "baseline"},
                {"kind": "generate", "spec": generate, "role": "candidate"}] if images else []
    return latency + pictures


def run_check(app: Celery, sessions, request: CheckRequest,
              progress: Callable[[str], None] = lambda line: None,
              report: Callable[[watched.Progress], None] | None = None) -> dict[str, Any]:
    """Measure and judge (steps below); returns the report (see report_exit_code). `progress`
    hears each round and, unless `report` takes the watch's reports itself (the CLI's live
    table), a line per report of the watch (orchestrator/services/progress.py). A check that
    cannot go on cancels what it queued, and its CheckFailed carries the report so far."""
    started, deadline = time.monotonic(), time.monotonic() + request.timeout_s
    token = uuid.uuid4().hex[:12]
    skipped: list[dict[str, Any]] = []
    with sessions() as session:
        candidate, baselines = builds_compared(session, request, skipped)
        names = (candidate.name, {serial: b.name for serial, b in baselines.items()})
        # what a report's reader calls them: labels, else the ends that tell them apart
        display = store.build_display_names(session, [candidate.name, *names[1].values()])
    for entry in skipped:
        progress(f"left out: {entry['reason']}")
    spec = dict(request.spec)
    rounds: list[_Round] = []
    results: dict[tuple[str, str], dict[str, Any]] = {}
    # 1. The first round: every device, its builds interleaved.
    todo = {serial: interleaved_jobs(spec, baselines[serial].id, request.pairs, request.images)
            for serial in names[1]}
    try:
        _rounds(app, sessions, request, token, todo, rounds, results, names, candidate.id,
                {serial: b.id for serial, b in baselines.items()}, deadline, progress, report)
    except CheckFailed as exc:
        exc.report = _abandon(app, sessions, request, rounds, results, names, spec, started, str(exc))
        exc.report["skipped"] = skipped
        raise
    with sessions() as session:
        fidelity = _fidelity(session, rounds) if request.images else []
    out = {"candidate": names[0], "baselines": names[1], "metrics": list(request.metrics), "spec": spec,
           "comparisons": [results[k] for k in sorted(results)], "fidelity": fidelity,
           "batches": [b for r in rounds for b in r.batches], "seconds": round(time.monotonic() - started, 1),
           "display": display, "skipped": skipped}
    out["exit_code"], out["outcome"] = report_exit_code(out)
    return out


def _rounds(app: Celery, sessions, request: CheckRequest, token: str, todo: dict[str, list[dict[str, Any]]],
            rounds: list[_Round], results: dict[tuple[str, str], dict[str, Any]],
            names: tuple[str, dict[str, str]], candidate_id: int, baseline_ids: dict[str, int], deadline: float,
            progress: Callable[[str], None], report: Callable[[watched.Progress], None] | None) -> None:
    """The check's rounds, filling `rounds` and `results` as they go (what an abandoned check
    reports)."""
    spec = dict(request.spec)
    while todo:
        number = len(rounds)
        progress(f"round {number}: {len(todo)} device{'s' * (len(todo) != 1)}")
        # 2. Launch the round (one suite per device: each has its own baseline) and wait for it.
        launched = _Round()
        rounds.append(launched)  # before any launch: what an abandoned check cancels
        for serial, jobs in todo.items():
            key = f"check:{token}:{number}:{serial}"
            try:
                batch_id = launch_suite(app, f"check {names[0]} round {number} on {serial}",
                                        [{k: v for k, v in j.items() if k != "role"} for j in jobs],
                                        build=candidate_id, devices=[serial], idempotency_key=key,
                                        max_extra_rounds=0, purpose=BATCH_CHECK, holder=request.holder)
            except store.StoreError as exc:  # (someone reserved the device since, say): what ran is cancelled
                raise CheckFailed(f"round {number} could not start on {serial}: {exc}") from None
            launched.batches.append(batch_id)
            launched.roles |= {(batch_id, i): j["role"] for i, j in enumerate(jobs)}
        _wait(app, sessions, request, launched.batches, deadline, progress, report)
        # 3. Judge every device this round ran on, on all of the check's runs so far.
        with sessions() as session:
            for serial in todo:
                results |= _judge(session, rounds, serial, candidate_id, baseline_ids[serial], request, number)
        # 4. More repetitions where a verdict is open and rounds are left.
        entries = []
        for serial in todo:
            open_ = [r for (s, _), r in results.items() if s == serial and r["verdict"] == "inconclusive"
                     and r.get("more_repetitions_suggested")]
            if open_ and number < request.max_rounds:
                entries.append({"device": serial, "spec": spec, "baseline_build": baseline_ids[serial],
                                "repetitions": max(r["more_repetitions_suggested"] for r in open_),
                                "metrics": [r["metric"] for r in open_]})
        todo = {serial: [j | {"role": "baseline" if "build" in j else "candidate"} for j in jobs]
                for serial, jobs in more_repetitions_jobs(entries).items()}


def report_exit_code(report: dict[str, Any]) -> tuple[int, str]:
    """0 pass, 1 a regression (on any device and metric), 2 a verdict left open."""
    verdicts = [c["verdict"] for c in report["comparisons"]]
    if "regression" in verdicts:
        return REGRESSION, "regression"
    if not verdicts or any(v not in ("same", "improvement") for v in verdicts):
        return UNDECIDED, "undecided"
    return PASS, "pass"


def _wait(app: Celery, sessions, request: CheckRequest, batch_ids: list[int], deadline: float,
          progress: Callable[[str], None], report: Callable[[watched.Progress], None] | None) -> None:
    """Until every batch has finished; CheckFailed for a job that did not succeed, for time
    running out, and for a device's host whose queue no worker consumed for no_worker_s."""
    def read(session: Session) -> list[watched.Step]:
        jobs = store.jobs_of_batches(session, batch_ids)
        bad = [j for j in jobs if j.state in (JobState.failed, JobState.infra_failed, JobState.cancelled)]
        if bad:
            job = bad[0]
            raise CheckFailed(f"{job.kind} job {job.id} on {job.device.serial} "
                              f"{job.state}: {job.error or 'no error recorded'}")
        return watched.job_steps(jobs)

    def finished(session: Session, steps: list[watched.Step]) -> bool:
        return all(store.get_batch(session, b).finished_at is not None for b in batch_ids)

    def line(p: watched.Progress) -> None:  # one line per report: the API keeps the last
        if p.why not in ("end", "poll"):
            progress("; ".join([f"{p.counts()} jobs"] + (p.silence_lines() if p.silent else [])))

    ending = watched.watch(sessions, settings_of(app), read, report or line, done=finished,
                           timeout_s=max(0.0, deadline - time.monotonic()), no_worker_s=request.no_worker_s,
                           poll_s=POLL_S)
    if ending.reason == "no_worker":
        raise CheckFailed(f"the check could not run ({ending.done} jobs done): {ending.why()}")
    if ending.reason == "timeout":
        silent = f": {'; '.join(s.text(ending.now) for s in ending.silent)}" if ending.silent else ""
        raise CheckFailed(f"the check ran out of time ({ending.done} jobs done){silent}; raise --timeout or "
                          "look at `farm jobs list`")


def _abandon(app: Celery, sessions, request: CheckRequest, rounds: list[_Round],
             results: dict[tuple[str, str], dict[str, Any]], names: tuple[str, dict[str, str]],
             spec: dict[str, Any], started: float, reason: str) -> dict[str, Any]:
    """A check that cannot go on: cancel its queued and running jobs (a running one is stopped
    by its worker, as `farm jobs cancel` does), settle its batches, and return the report so
    far: outcome could_not_run, why, and how many of its jobs had succeeded."""
    batches = [b for r in rounds for b in r.batches]
    cancelled: list[int] = []
    with sessions() as session:
        jobs = store.jobs_of_batches(session, batches)
        total, succeeded = len(jobs), sum(j.state == JobState.succeeded for j in jobs)
        for job in jobs:
            if job.state in (JobState.queued, JobState.running):
                try:
                    store.transition_job(session, job.id, JobState.cancelled,
                                         error=f"cancelled: its check could not go on ({reason})")
                    cancelled.append(job.id)
                except store.InvalidTransition:
                    pass  # it ended meanwhile
        session.commit()
    for batch_id in batches:  # each may have ended with its last job: its analysis follows
        settle_batch(app, batch_id)
    return {"candidate": names[0], "baselines": names[1], "metrics": list(request.metrics), "spec": spec,
            "comparisons": [results[k] for k in sorted(results)], "fidelity": [], "batches": batches,
            "seconds": round(time.monotonic() - started, 1), "exit_code": FAILED, "outcome": COULD_NOT_RUN,
            "reason": reason, "jobs_done": succeeded, "jobs_total": total, "jobs_cancelled": cancelled}


def _check_runs(session: Session, rounds: list[_Round], serial: str) -> dict[str, list[Run]]:
    """role -> the check's succeeded latency runs of that role on the device (by job)."""
    roles: dict[str, list[Run]] = {"baseline": [], "candidate": []}
    batches = [b for r in rounds for b in r.batches]
    by_batch = {b: r for r in rounds for b in r.batches}
    for run, job in store.runs_of_batches(session, batches, JobKind.latency, serial):
        index = int(job.idempotency_key.rsplit(":", 1)[1])
        roles[by_batch[job.batch_id].roles[(job.batch_id, index)]].append(run)
    return roles


def _judge(session: Session, rounds: list[_Round], serial: str, candidate_id: int, baseline_id: int,
           request: CheckRequest, number: int) -> dict[tuple[str, str], dict[str, Any]]:
    device = store.get_device(session, serial)
    candidate, baseline = store.get_build(session, candidate_id), store.get_build(session, baseline_id)
    runs = _check_runs(session, rounds, serial)
    spec = regressions.SpecKey.of({"model": store.default_model(candidate)} | request.spec)
    out = {}
    for metric in request.metrics:
        try:
            result = regressions.compare_builds(session, device, spec, metric, baseline, runs["baseline"], candidate,
                                             runs["candidate"], runs_left=request.max_rounds - number)
        except ValueError as exc:
            result = {"device": serial, "metric": metric, "verdict": "refused", "reason": str(exc)}
        if result is None:
            result = {"device": serial, "metric": metric, "verdict": "refused",
                      "reason": f"neither build measured {metric}"}
        result |= {"rounds": number + 1, "baseline_build": baseline.name, "candidate_build": candidate.name}
        if result["verdict"] in ("regression", "improvement") and metric in regressions.LATENCY_METRICS:
            result["kernels"] = regressions.kernel_moves(session, runs["baseline"], runs["candidate"], top=5)
        out[(serial, metric)] = result
    return out


def _fidelity(session: Session, rounds: list[_Round]) -> list[dict[str, Any]]:
    """Per device, the candidate's generated image against the baseline's (same spec and seed)."""
    first = rounds[0]
    images: dict[str, dict[str, str]] = {}
    for path, job, serial in store.images_of_batches(session, first.batches, JobKind.generate):
        role = first.roles[(job.batch_id, int(job.idempotency_key.rsplit(":", 1)[1]))]
        images.setdefault(serial, {})[role] = path
    out = []
    for serial, pair in sorted(images.items()):
        if set(pair) != {"baseline", "candidate"}:
            continue
        try:
            found = compare_images(pair["baseline"], pair["candidate"])
            identical = math.isinf(found.psnr_db)  # JSON has no infinity: identical images say so instead
            out.append({"device": serial, "psnr_db": None if identical else found.psnr_db, "identical": identical,
                        "changed": found.changed, "baseline_image": pair["baseline"],
                        "candidate_image": pair["candidate"]})
        except (OSError, ValueError) as exc:
            out.append({"device": serial, "error": str(exc)})
    return out


def fidelity_text(f: dict[str, Any]) -> str:
    """One device's image fidelity in words: "identical images" or "PSNR 41.2 dB (changed)"."""
    if f.get("identical"):
        return "identical images"
    return f"PSNR {f['psnr_db']:.1f} dB" + (" (changed)" if f["changed"] else "")


def markdown(report: dict[str, Any]) -> str:
    """The report as a pull-request comment: outcome, a table of verdicts, the kernels that
    moved, image fidelity, and why each open verdict is open. Every name and text a device or
    the pull request's code supplied (builds, serials, metrics, kernels, errors, reasons) is a
    code span (orchestrator/infra/escape.py): it shows as written and cannot add markup, links or
    @mentions, or shift the table's columns."""
    def cell(value: object) -> str:
        return md_code(value, table=True)

    icon = {"pass": "✅ no regression", "regression": "❌ regression", "undecided": "⚠️ undecided",
            COULD_NOT_RUN: "🛑 could not run"}
    lines = [f"## farm check: {icon[report['outcome']]}", "",
             f"Candidate {md_code(report['candidate'])} against "
             + ", ".join(f"{md_code(b)} on {md_code(d)}" for d, b in sorted(report["baselines"].items()))
             + f" (exit code {report['exit_code']}, {report['seconds']:.0f} s).", ""]
    if report["outcome"] == COULD_NOT_RUN:
        lines += [f"No verdict: {md_code(report['reason'])}. {report['jobs_done']} of its {report['jobs_total']} "
                  f"jobs succeeded; {len(report['jobs_cancelled'])} were cancelled.", ""]
    if report["comparisons"] or report["outcome"] != COULD_NOT_RUN:  # no empty table for a check that judged nothing
        lines += ["| device | metric | baseline | candidate | ratio | 95% CI | verdict | rounds |",
                  "|---|---|---|---|---|---|---|---|"]
    for c in report["comparisons"]:
        lines.append(f"| {cell(c['device'])} | {cell(c['metric'])} | "
                     f"{_num(c.get('baseline_median'), c.get('unit'))} | "
                     f"{_num(c.get('candidate_median'), c.get('unit'))} | {_fmt(c.get('ratio'))} | "
                     f"{_interval(c)} | **{c['verdict']}** | {c.get('rounds', '-')} |")
    moved = [c for c in report["comparisons"] if c.get("kernels")]
    for c in moved:
        lines += ["", f"Kernels that moved ({md_code(c['device'])}, {md_code(c['metric'])}):", "",
                  "| kernel | baseline ms | candidate ms | delta ms | share |", "|---|---|---|---|---|"]
        lines += [f"| {cell(k['kernel'])} | {k['baseline_ms']:.3f} | {k['candidate_ms']:.3f} | {k['delta_ms']:+.3f} | "
                  f"{k['share']:.0%} |" for k in c["kernels"]]
    if report["fidelity"]:
        lines += ["", "Image fidelity (candidate against baseline, same prompt and seed):", ""]
        lines += [f"- {md_code(f['device'])}: " + (f"error: {md_code(f['error'])}" if "error" in f else
                                                   fidelity_text(f))
                  for f in report["fidelity"]]
    if report.get("skipped"):
        lines += ["", "Left out (reserved by a person; not judged):", ""]
        lines += [f"- {md_code(e['reason'])}" for e in report["skipped"]]
    open_ = [c for c in report["comparisons"] if c["verdict"] not in ("same", "improvement", "regression")]
    if open_:
        lines += ["", "Undecided:", ""] + [f"- {md_code(c['device'])}, {md_code(c['metric'])}: {md_code(c['reason'])}"
                                           for c in open_]
    return "\n".join(lines) + "\n"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _num(v: float | None, unit: str | None) -> str:
    """A median and its unit for the comment: a unit a device reported that is not plain letters
    (ms, MiB, %) is a code span."""
    if v is None:
        return "-"
    shown = unit if unit is None or re.fullmatch(r"[A-Za-z0-9%/]*", unit) else md_code(unit, table=True)
    return f"{v:,.1f} {shown or ''}".rstrip()


def _interval(c: dict[str, Any]) -> str:
    return "-" if c.get("ci_low") is None else f"{c['ci_low']:.3f}-{c['ci_high']:.3f}"
