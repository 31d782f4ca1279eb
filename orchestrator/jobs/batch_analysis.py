"""A finished batch's hand-off to the analysis (the analyze_batch task): its per-device summary
and the regression analysis (orchestrator/regressions.py), stored on the batch and written as a
report, and the more-repetitions rounds an inconclusive comparison asks for, launched as suites
through the job service (orchestrator/jobs/jobservice.py)."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from celery import Celery

from orchestrator import store
from orchestrator.analysis import profiles
from orchestrator.jobs import notify
from orchestrator.jobs.celery_app import session_for, settings_of
from orchestrator.jobs.jobservice import launch_suite
from orchestrator.store import Session, notifications
from orchestrator.store.models import BATCH_CHECK
from orchestrator.store.session import read_snapshot

log = logging.getLogger(__name__)


def analyze(app: Celery, batch_id: int) -> dict:
    """A finished batch's analysis: its per-device summary and the regression analysis
    (orchestrator/regressions.py: comparisons against each series' baseline, alerts, fidelity,
    data stoppages), stored on the batch and written to <data_dir>/reports/batch-<id>.json for
    whatever sends notifications. Inconclusive comparisons launch a follow-up batch with more
    repetitions on those devices (at most the batch's max_extra_rounds rounds; idempotent)."""
    from agent.files import atomic_write

    settings = settings_of(app)
    summary, follow_up, deliveries = analyze_in_store(lambda: session_for(app), batch_id)
    notify.publish_deliveries(app, deliveries)
    report_path = settings.data_dir / "reports" / f"batch-{batch_id}.json"
    report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(report_path, json.dumps(summary, indent=2, default=str).encode())
    rounds = follow_up.rounds
    for device, jobs in more_repetitions_jobs(follow_up.entries).items():
        try:
            launch_suite(app, f"{follow_up.name} (more repetitions, round {rounds + 1})", jobs,
                         build=follow_up.build_id, devices=[device],
                         idempotency_key=f"more:{follow_up.root}:{rounds + 1}:{device}",
                         max_extra_rounds=follow_up.max_rounds, round_metrics=follow_up.round_metrics)
        except store.StoreError as exc:  # reserved by a person since: its verdict stays open
            log.warning("batch %s: no more-repetitions round on %s: %s", batch_id, device, exc)
    return summary


@dataclass
class FollowUp:
    """What the analysis of one batch asks for next: the more-repetitions rounds (the analysis'
    entries, empty when the batch has had its rounds) and what to launch them as."""

    entries: list[dict]
    name: str
    build_id: int | None
    root: int
    rounds: int  # rounds done before this one (0: the original batch)
    max_rounds: int
    round_metrics: list[str] | None


def analyze_in_store(new_session: Callable[[], Session], batch_id: int,
                     now: dt.datetime | None = None) -> tuple[dict, FollowUp, list]:
    """The store's part of a batch's analysis, which analyze() then reports and acts on:
    (the summary stored on the batch, the follow-up rounds, the deliveries recorded for its
    alerts). `now`: the clock data stoppages are judged by (the store's). What
    benchmarks/store_scale.py times."""
    from orchestrator.analysis import changepoints, regressions
    from orchestrator.analysis.series_state import catch_up
    from orchestrator.analysis.summary import batch_summary

    # 0. The series state brought up to the batch's runs, in a short transaction of its own: the
    # scan below reads it in a snapshot, which must write nothing (on SQLite a snapshot that
    # writes fails at once with "database is locked" when another writer holds the lock).
    with new_session() as session, session.begin():
        catch_up(session, thorough=True)
    # 1. Each series the batch fed, scanned over its recent history (not only inside an alert):
    # read in a snapshot that holds no write lock (on SQLite every other transaction takes it
    # first, and a worker recording a result would wait for all of it; benchmarks/analysis_lock.py).
    with new_session() as session, session.begin():
        read_snapshot(session)
        batch = store.get_batch(session, batch_id)
        devices = [] if batch.purpose == BATCH_CHECK else sorted({job.device for job in batch.jobs},
                                                                  key=lambda d: d.serial)  # no series fed
        found = [point for device in devices for point in changepoints.find_change_points(session, device)]
    # 2. The comparisons and everything written, in one short transaction.
    with new_session() as session, session.begin():
        batch = store.get_batch(session, batch_id)
        report = regressions.analyze_batch(session, batch_id, now)
        report["profile_gains"] = profiles.measure_gains(session, batch_id)
        report["change_points"] = changepoints.record_change_points(session, found)
        summary = batch_summary(session, batch_id) | {"analysis": report}
        skipped = store.skipped_by_reservation(session, batch)  # devices people held (reserved)
        if skipped:
            summary["skipped"] = skipped
        rounds = store.extra_round(batch.idempotency_key)  # 0: the original batch
        follow_up = FollowUp(report["more_repetitions"] if rounds < batch.max_extra_rounds else [], batch.name,
                             batch.build_id, _root_batch(batch), rounds, batch.max_extra_rounds,
                             batch.round_metrics)
        batch.summary = summary
        # 3. Who hears of the alerts: deliveries recorded with them (never twice, however often
        # this batch is analysed), sent once this commits; a receiver's trouble is the task's.
        deliveries = notifications.record_alerts(session, report["alerts"] + report["stoppages"])
    return summary, follow_up, deliveries


def more_repetitions_jobs(entries: list[dict]) -> dict[str, list[dict]]:
    """Device serial -> the jobs of its more-repetitions round, from the analysis'
    "more_repetitions" entries: a new latency run of the candidate (the batch's build) and one
    of its baseline (the entry's "baseline_build"), each with the repetitions asked for.
    Run-to-run drift averages only over runs, and the baseline's single earlier run would
    otherwise bound what any number of candidate runs can show. Only the samples of the
    undecided metrics ("metrics": UNet steps for unet_step_ms, end-to-end generations for the
    others) are asked for; kernel timings, which the first runs already gave, are not taken
    again."""
    jobs_by_device: dict[str, list[dict]] = {}
    for entry in entries:
        metrics = entry.get("metrics") or ["unet_step_ms", "e2e_ms"]
        spec = dict(entry["spec"]) | {"unet_repetitions": entry["repetitions"], "warmup": 1, "kernel_timings": False}
        # End-to-end generations: as many as asked when an end-to-end metric is undecided, else
        # one (a UNet-step round's generations would only add time).
        spec["repetitions"] = entry["repetitions"] if set(metrics) - {"unet_step_ms"} else 1
        spec.pop("job_id", None)
        jobs_by_device.setdefault(entry["device"], []).extend(
            [{"kind": "latency", "spec": spec}, {"kind": "latency", "spec": spec, "build": entry["baseline_build"]}])
    return jobs_by_device


def _root_batch(batch) -> int:
    key = batch.idempotency_key
    return int(key.split(":")[1]) if key and key.startswith("more:") else batch.id
