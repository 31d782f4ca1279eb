"""Retention (issue 40): how old a run's raw data may get, and what is kept of it after. A
policy gives four ages (days; 0 keeps that data for ever): raw samples and kernel timings
(90) are then downsampled, images (180) and job log files (30) deleted. `apply` does it in
bounded transactions (RUNS_PER_TRANSACTION runs or images each, so SQLite's write lock is never
held long), is idempotent (a run is marked when it is done; a second pass finds nothing to do)
and reports what it did, or with `dry_run` what it would do. Beat runs it daily
(orchestrator/jobs/retention.py); `farm retention` shows and applies it.

What is never downsampled: the runs, on a device, of a build that is the build or the baseline
build of an open alert there; of the newest build measured on the device (per job kind and
workload: the next comparison's baseline) and of the builds back to the first one without an
open regression alert (the newest's own baseline, which a more-repetitions round or a second
analysis of the newest batch compares it with again). Runs younger than the policy are never
touched, farm checks' included. Images: the newest image per (device, workload, prompt, seed)
stays whatever its age (the fidelity check compares a new image with it; among the series'
generate images and among all), and so do the images of protected runs.

What downsampling keeps, per (run, metric) with more samples than its summary (notation:
x the run's n samples of the metric, sorted; L = log x; M = median(L); D = median(|L - M|),
the MAD of the logs; s = D sqrt(k / n) for a summary of k values):
    n odd   k = 3: the median sample x_(n+1)/2 and exp(M - s), exp(M + s)
    n even  k = 4: the two middle samples a <= b and exp(M - e), exp(M + e) with
            e = 2 s - (log b - log a) / 2; k = 6, 8, ... (pairs at exp(M +/- s)) when the two
            middle samples lie so far apart that s < (log b - log a) / 2 at k = 4; the raw
            samples stay when no k < n will do
so the run's median is its own exactly (the same middle sample or samples), and so are the
median of its log samples and D^2 / n, the within-run variance of the run's log median: all
that the run-to-run drift estimate (orchestrator/analysis/stats/compare.py estimate_drift) reads
of a run, which therefore comes out the same. The outer values are not measurements: the
spread of the kept values is that of the run's median, not of one repetition. What the
summary does not keep is in Run.retained: per metric the sample count n, the lowest and the
highest sample. A build measured in several runs on one series is charted and scanned by the
median of all its runs' samples pooled, which the summaries keep only approximately. A run
whose samples of a metric are not all positive (no logarithm) or mix units keeps them raw.
Kernel timings: one row per (run, kernel), the median over the repetitions of its total
(calls and time summed per repetition first), repetition 0. Thermal readings are kept.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from sqlalchemy import case, delete, func, select, update
from sqlalchemy.orm import Session

from .alerts import OPEN_ALERT_STATES
from .models import (
    Alert,
    AlertKind,
    Build,
    Image,
    Job,
    JobKind,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    UTCDateTime,
    utcnow,
)
from .rows import bulk_insert, in_series
from .session import read_snapshot

__all__ = ["Policy", "Report", "apply", "protected_builds", "run_folder", "summarize"]

RUNS_PER_TRANSACTION = 500
# The job-spec fields a series' workload is made of: at least those of the analysis' SpecKey
# (orchestrator/analysis/regressions.py: model, resolution, steps, precision, profile); more
# would only protect more. An image's also has its prompt and seed (regressions._previous_image).
WORKLOAD_FIELDS = ("model", "height", "width", "steps", "precision", "profile")
IMAGE_FIELDS = (*WORKLOAD_FIELDS, "prompt", "seed")

Sessions = Callable[[], Session]
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class Policy:
    """How many days a run's data is kept as it came (0: for ever)."""

    raw_days: float = 90.0  # raw samples, then summarized
    kernel_days: float = 90.0  # kernel timings, then one per (run, kernel)
    image_days: float = 180.0  # images, then deleted (file and row)
    log_days: float = 30.0  # job log files under the data dir, then deleted

    # (field, what, what is kept after, setting)
    ROWS = (("raw_days", "raw samples", "per (run, metric): the median and a summary of the spread",
             "retention_raw_days"),
            ("kernel_days", "kernel timings", "one per (run, kernel): the median over repetitions",
             "retention_kernel_days"),
            ("image_days", "images", "the newest per (device, workload, prompt, seed)", "retention_image_days"),
            ("log_days", "job log files", "nothing (the log tail in the store stays)", "retention_log_days"))

    def __post_init__(self) -> None:
        for name, *_ in self.ROWS:
            days = getattr(self, name)
            if not isinstance(days, (int, float)) or not math.isfinite(days) or days < 0:
                raise ValueError(f"retention {name} must be a number of days >= 0 (0: keep for ever), got {days!r}")

    @classmethod
    def of(cls, settings: Any) -> Policy:
        """The policy of the farm's settings (retention_*_days)."""
        return cls(*(getattr(settings, setting) for *_, setting in cls.ROWS))

    def cutoff(self, days: float, now: dt.datetime) -> dt.datetime | None:
        """Data of runs older than this goes (None: kept for ever)."""
        return now - dt.timedelta(days=days) if days > 0 else None

    def describe(self) -> list[dict[str, Any]]:
        return [{"data": what, "days": getattr(self, name), "then": kept, "setting": f"FARM_{setting.upper()}"}
                for name, what, kept, setting in self.ROWS]


@dataclass
class Report:
    """What a pass did (or, dry, would do)."""

    now: dt.datetime
    policy: Policy
    dry_run: bool
    runs_downsampled: int = 0  # runs whose samples or kernel timings were summarized
    runs_protected: int = 0  # runs old enough that were kept raw (alert builds, newest builds)
    summaries: int = 0  # (run, metric) sample sets replaced by a summary
    sample_rows_removed: int = 0  # net: raw rows deleted minus summary rows written
    kernel_rows_removed: int = 0  # net
    images_deleted: int = 0
    images_kept: int = 0  # old enough, kept: the newest of their kind, or of a protected run
    image_bytes: int = 0
    image_files_left: int = 0  # rows deleted whose file lies outside the data dir: not touched
    log_files_deleted: int = 0
    log_bytes: int = 0

    @property
    def bytes_freed(self) -> int:
        return self.image_bytes + self.log_bytes

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["now"], data["policy"] = self.now.isoformat(), asdict(self.policy)
        data["bytes_freed"] = self.bytes_freed
        return data


# ---- the summary ----------------------------------------------------------------------------


def summarize(values: Iterable[float]) -> list[float] | None:
    """The k values that stand for a run's samples of one metric (the module's docstring says
    which), in ascending order; None when the samples stay as they are (k would not be fewer,
    or a value is not positive and finite)."""
    x = np.sort(np.asarray(list(values), dtype=float))  # (n,)
    n = x.size
    if n <= 3 or not np.all(np.isfinite(x)):
        return None
    if x[0] == x[-1]:
        return [float(x[0])] * 3
    if x[0] <= 0:
        return None
    L = np.log(x)
    M = float(np.median(L))
    D = float(np.median(np.abs(L - M)))
    if n % 2:
        mid = float(x[n // 2])
        s = D * math.sqrt(3 / n)
        return [min(math.exp(M - s), mid), mid, max(math.exp(M + s), mid)]
    a, b = float(x[n // 2 - 1]), float(x[n // 2])
    half_gap = (float(L[n // 2]) - float(L[n // 2 - 1])) / 2
    for k in range(4, n, 2):
        s = D * math.sqrt(k / n)
        if s < half_gap:
            continue
        # k = 4: the outer pair sets the MAD alone, with the middle pair's deviation half_gap;
        # more: the pairs at +/- s are the MAD's middle values themselves.
        e = 2 * s - half_gap if k == 4 else s
        pairs = (k - 2) // 2
        low, high = min(math.exp(M - e), a), max(math.exp(M + e), b)
        return [low] * pairs + [a, b] + [high] * pairs
    return None


# ---- what is protected ----------------------------------------------------------------------


def protected_builds(session: Session) -> set[tuple[int, int]]:
    """(device id, build id) of the builds whose runs on that device keep their raw data: the
    build and the baseline build of each open alert there, and per (job kind, workload) the
    newest build measured on the device and those before it back to the first without an open
    regression alert there."""
    protected: set[tuple[int, int]] = set()
    regressed: set[tuple[int, int]] = set()
    for device_id, build_id, baseline_id, kind in session.execute(
            select(Alert.device_id, Alert.build_id, Alert.baseline_build_id, Alert.kind)
            .where(Alert.state.in_(OPEN_ALERT_STATES), Alert.device_id.is_not(None))):
        protected |= {(device_id, b) for b in (build_id, baseline_id) if b is not None}
        if kind == AlertKind.regression and build_id is not None:
            regressed.add((device_id, build_id))
    # The walk below stops at the first build without an open regression: never deeper than this.
    depth = 2 + max(Counter(device for device, _ in regressed).values(), default=0)
    keys = [Job.spec[name].as_string().label(name) for name in WORKLOAD_FIELDS]
    measured = (select(Run.device_id, Job.kind, *keys, Run.build_id, Build.created)
                .join(Job, Job.id == Run.job_id).join(Build, Build.id == Run.build_id)
                .where(Run.status == RunStatus.succeeded, in_series()).distinct().subquery())
    group = [measured.c.device_id, measured.c.kind, *(measured.c[name] for name in WORKLOAD_FIELDS)]
    rank = func.row_number().over(partition_by=group, order_by=(measured.c.created.desc(),
                                                                measured.c.build_id.desc())).label("rank")
    ranked = select(*group, measured.c.build_id, rank).subquery()
    newest: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for row in session.execute(select(ranked).where(ranked.c.rank <= depth)):
        *key, build_id, position = row
        newest[tuple(key)].append((position, build_id))
    for key, builds in newest.items():
        device_id = key[0]
        for i, (_, build_id) in enumerate(sorted(builds)):
            protected.add((device_id, build_id))
            if i >= 1 and (device_id, build_id) not in regressed:
                break
    return protected


def _age():
    """When a run was made, by the control plane's clock (a device's own clock may be wrong):
    its job's end, else its creation."""
    return func.coalesce(Job.finished_at, Job.created_at, type_=UTCDateTime())


def run_folder(data_dir: Path, job_id: int, attempt: int) -> Path:
    """Where the worker fetches an attempt's files (result.json, job.log, artifacts)."""
    return Path(data_dir) / "results" / f"job{job_id}" / f"attempt{attempt}"


# ---- applying it ----------------------------------------------------------------------------


def apply(sessions: Sessions, policy: Policy, data_dir: Path, *, now: dt.datetime | None = None,
          dry_run: bool = False, progress: Progress | None = None,
          per_transaction: int = RUNS_PER_TRANSACTION) -> Report:
    """Apply `policy` as of `now`: 1. downsample old runs' samples and kernel timings, 2. delete
    old images, 3. delete old job log files under `data_dir`. Each stage reads its plan in a
    read-only snapshot, then works through it `per_transaction` runs (or images) a transaction,
    each committed before the next (a dry run reads them in snapshots and writes nothing).
    Idempotent. `progress(stage, done, total)` is told after each transaction."""
    now = now or utcnow()
    report = Report(now=now, policy=policy, dry_run=dry_run)
    data_dir = Path(data_dir)

    # 1. The plan: what is protected, and which runs are old enough for each stage.
    raw_cut, kernel_cut = policy.cutoff(policy.raw_days, now), policy.cutoff(policy.kernel_days, now)
    image_cut, log_cut = policy.cutoff(policy.image_days, now), policy.cutoff(policy.log_days, now)
    with sessions() as session, session.begin():
        read_snapshot(session)
        protected = protected_builds(session)
        cuts = [c for c in (raw_cut, kernel_cut) if c is not None]
        old_runs = list(session.scalars(
            select(Run.id).join(Job, Job.id == Run.job_id)
            .where(Run.downsampled_at.is_(None), _age() < max(cuts)).order_by(Run.id))) if cuts else []
        images = _old_images(session, image_cut) if image_cut is not None else []
        log_runs = list(session.scalars(
            select(Run.id).join(Job, Job.id == Run.job_id)
            .where(Run.logs_deleted_at.is_(None), _age() < log_cut).order_by(Run.id))) if log_cut else []

    # 2. Each stage in bounded transactions.
    def chunks(stage: str, items: list, work: Callable[[Session, list], None]) -> None:
        for start in range(0, len(items), per_transaction):
            chunk = items[start:start + per_transaction]
            with sessions() as session, session.begin():
                if dry_run:
                    read_snapshot(session)
                work(session, chunk)
            if progress is not None:
                progress(stage, min(start + per_transaction, len(items)), len(items))

    chunks("samples and kernel timings", old_runs,
           lambda s, ids: _downsample(s, ids, raw_cut, kernel_cut, protected, report))
    kept = [row for row in images if row.rank == 1 or (row.device_id, row.build_id) in protected]
    report.images_kept = len(kept)
    doomed = [row for row in images if row.rank > 1 and (row.device_id, row.build_id) not in protected]
    chunks("images", doomed, lambda s, rows: _delete_images(s, rows, data_dir, report))
    chunks("job logs", log_runs, lambda s, ids: _delete_logs(s, ids, data_dir, report))
    return report


def _downsample(session: Session, run_ids: list[int], raw_cut: dt.datetime | None,
                kernel_cut: dt.datetime | None, protected: set[tuple[int, int]], report: Report) -> None:
    """Summarize the samples and kernel timings of the runs `run_ids` that are old enough and
    not protected, and mark the runs every policy is done with."""
    raw_ids, kernel_ids, done, retained = [], [], [], {}
    for run_id, device_id, build_id, made, kept in session.execute(
            select(Run.id, Run.device_id, Run.build_id, _age(), Run.retained).join(Job, Job.id == Run.job_id)
            .where(Run.id.in_(run_ids), Run.downsampled_at.is_(None))):  # another pass may have been first
        if build_id is not None and (device_id, build_id) in protected:
            report.runs_protected += 1
            continue
        raw, kernels = raw_cut is not None and made < raw_cut, kernel_cut is not None and made < kernel_cut
        raw_ids += [run_id] if raw else []
        kernel_ids += [run_id] if kernels else []
        if (raw or raw_cut is None) and (kernels or kernel_cut is None):
            done.append(run_id)
        retained[run_id] = dict(kept or {})
    changed = _summarize_samples(session, raw_ids, retained, report) | _reduce_kernels(
        session, kernel_ids, retained, report)
    report.runs_downsampled += len(changed)
    if report.dry_run:
        return
    for run_id in changed - set(done):
        session.execute(update(Run).where(Run.id == run_id).values(retained=retained[run_id]))
    for run_id in done:
        session.execute(update(Run).where(Run.id == run_id).values(downsampled_at=report.now,
                                                                   retained=retained[run_id]))


def _summarize_samples(session: Session, run_ids: list[int], retained: dict[int, dict], report: Report) -> set[int]:
    if not run_ids:
        return set()
    groups: dict[tuple[int, str], list[tuple[str, float]]] = defaultdict(list)
    for run_id, metric, unit, value in session.execute(
            select(Sample.run_id, Sample.metric, Sample.unit, Sample.value)
            .where(Sample.run_id.in_(run_ids)).order_by(Sample.run_id, Sample.id)):
        groups[(run_id, metric)].append((unit, value))
    by_metric: dict[str, list[int]] = defaultdict(list)
    rows = []
    for (run_id, metric), samples in groups.items():
        units = {unit for unit, _ in samples}
        values = [value for _, value in samples]
        kept = summarize(values) if len(units) == 1 else None
        if kept is None:
            continue
        by_metric[metric].append(run_id)
        rows += [{"run_id": run_id, "metric": metric, "unit": samples[0][0], "value": v, "repetition": i}
                 for i, v in enumerate(kept)]
        retained[run_id].setdefault("samples", {})[metric] = {"n": len(values), "min": min(values),
                                                               "max": max(values), "kept": len(kept)}
        report.summaries += 1
        report.sample_rows_removed += len(values) - len(kept)
    if not report.dry_run:
        for metric, ids in by_metric.items():
            session.execute(delete(Sample).where(Sample.metric == metric, Sample.run_id.in_(ids)))
        bulk_insert(session, Sample, rows)
    return {run_id for ids in by_metric.values() for run_id in ids}


def _reduce_kernels(session: Session, run_ids: list[int], retained: dict[int, dict], report: Report) -> set[int]:
    if not run_ids:
        return set()
    # (run, kernel) -> repetition -> [calls, ms] summed, and how many rows there were
    per: dict[tuple[int, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    count: Counter = Counter()
    for run_id, kernel, repetition, calls, ms in session.execute(
            select(KernelTiming.run_id, KernelTiming.kernel, KernelTiming.repetition, KernelTiming.calls,
                   KernelTiming.total_ms).where(KernelTiming.run_id.in_(run_ids))):
        acc = per[(run_id, kernel)][repetition]
        acc[0] += calls
        acc[1] += ms
        count[(run_id, kernel)] += 1
    changed: dict[int, list[str]] = defaultdict(list)
    rows = []
    for (run_id, kernel), reps in per.items():
        if count[(run_id, kernel)] <= 1:
            continue
        changed[run_id].append(kernel)
        rows.append({"run_id": run_id, "kernel": kernel, "repetition": 0,
                     "calls": int(round(float(np.median([c for c, _ in reps.values()])))),
                     "total_ms": float(np.median([ms for _, ms in reps.values()]))})
        report.kernel_rows_removed += count[(run_id, kernel)] - 1
        retained[run_id]["kernel_repetitions"] = max(len(reps), retained[run_id].get("kernel_repetitions", 0))
    if not report.dry_run and changed:
        session.execute(delete(KernelTiming).where(KernelTiming.run_id.in_(list(changed))))
        # a run's kernels that had one row already: written back as they were
        keep = [(r, k) for (r, k), n in count.items() if r in changed and n <= 1]
        rows += [{"run_id": r, "kernel": k, "repetition": rep, "calls": int(c), "total_ms": ms}
                 for r, k in keep for rep, (c, ms) in per[(r, k)].items()]
        bulk_insert(session, KernelTiming, rows)
    return set(changed)


def _old_images(session: Session, cutoff: dt.datetime) -> list:
    """Every image older than `cutoff`, with its rank among the images of its (device, job
    kind, series or not, workload, prompt, seed): 1 for the newest (by build, then id)."""
    series = case((in_series() & (Run.status == RunStatus.succeeded) & (Job.kind == JobKind.generate), 1), else_=0)
    group = [Run.device_id, Job.kind, series, *(Job.spec[name].as_string() for name in IMAGE_FIELDS)]
    rank = func.row_number().over(partition_by=group, order_by=(
        Build.created.desc().nulls_last(), Build.id.desc().nulls_last(), Image.id.desc())).label("rank")
    ranked = (select(Image.id, Image.path, Run.device_id, Run.build_id, _age().label("made"), rank)
              .join(Run, Run.id == Image.run_id).join(Job, Job.id == Run.job_id)
              .outerjoin(Build, Build.id == Run.build_id).subquery())
    return list(session.execute(select(ranked).where(ranked.c.made < cutoff).order_by(ranked.c.id)))


def _delete_images(session: Session, rows: list, data_dir: Path, report: Report) -> None:
    ids = [row.id for row in rows]
    present = set(session.scalars(select(Image.id).where(Image.id.in_(ids))))  # another pass may have been first
    gone = [row for row in rows if row.id in present]
    paths = {row.path for row in gone}
    # a file another image row still names stays
    shared = set(session.scalars(select(Image.path).where(Image.path.in_(paths), Image.id.not_in(ids))))
    for path in sorted(paths - shared):
        if not _inside(Path(path), data_dir):
            report.image_files_left += 1
            continue
        report.image_bytes += _remove(Path(path), report.dry_run) or 0
    report.images_deleted += len(gone)
    if not report.dry_run and gone:
        session.execute(delete(Image).where(Image.id.in_([row.id for row in gone])))


def _delete_logs(session: Session, run_ids: list[int], data_dir: Path, report: Report) -> None:
    ids = []
    for run_id, job_id, attempt, artifacts in session.execute(
            select(Run.id, Run.job_id, Run.attempt, Run.artifacts)
            .where(Run.id.in_(run_ids), Run.logs_deleted_at.is_(None))):
        ids.append(run_id)
        folder = run_folder(data_dir, job_id, attempt)
        for artifact in artifacts or []:
            rel = PurePosixPath(str((artifact or {}).get("path", "")))
            if (artifact or {}).get("kind") != "log" or rel.is_absolute() or ".." in rel.parts or not rel.parts:
                continue
            freed = _remove(folder / rel, report.dry_run)
            if freed is not None:
                report.log_files_deleted += 1
                report.log_bytes += freed
    if not report.dry_run and ids:
        session.execute(update(Run).where(Run.id.in_(ids)).values(logs_deleted_at=report.now))


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def _remove(path: Path, dry_run: bool) -> int | None:
    """Delete a file (not when `dry_run`); its size, or None when there was none."""
    try:
        size = path.lstat().st_size
        if not dry_run:
            os.unlink(path)
    except FileNotFoundError:
        return None
    return size
