"""Retention (orchestrator/store/retention.py) on SQLite and PostgreSQL: a downsampled run keeps
its median exactly and what the drift estimate reads of it, with fewer rows; the runs of open
alerts' builds and baselines and of each device's newest builds keep every raw sample; the
analysis' verdicts, ratios and change points are the same after every run the policy allows is
downsampled; old images and job logs go but the newest image of each kind; `farm retention`
shows, dry-runs and applies it, and refuses bad input in one line; beat runs it daily."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select, update
from support import latency_result, record_job, seed_nightlies, tiny_manifest

from agent.protocol import Artifact, JobResult, KernelTiming, Sample
from orchestrator import store
from orchestrator.analysis import changepoints, regressions
from orchestrator.analysis.stats import estimate_drift
from orchestrator.store import retention
from orchestrator.store.models import Alert, AlertKind, AlertState, Image, Job, Run, utcnow
from orchestrator.store.models import KernelTiming as KernelRow
from orchestrator.store.models import Sample as SampleRow

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "prompt": "a red bicycle", "seed": 0}
POLICY = retention.Policy()
FAR = dt.timedelta(days=3650)  # every run is old by then


def _values(session, run_id: int, metric: str = "unet_step_ms") -> list[float]:
    return list(session.scalars(select(SampleRow.value).where(SampleRow.run_id == run_id, SampleRow.metric == metric)))


def _spread(values) -> tuple[float, float]:
    """What the drift estimate reads of one run: its log median and MAD(log)^2 / n."""
    logs = np.log(np.asarray(values, dtype=float))
    return float(np.median(logs)), float(np.median(np.abs(logs - np.median(logs))) ** 2 / logs.size)


def _counts(report) -> dict:
    """What a pass did (or would do), without when and whether it was dry."""
    return {k: v for k, v in report.as_dict().items() if k not in ("now", "dry_run")}


def _device(session, serial: str):
    return store.upsert_device(session, serial, "local", f"/tmp/{serial}", host="h")


# ---- the summary ------------------------------------------------------------------------------


def test_a_summary_keeps_the_median_and_what_the_drift_estimate_reads(fresh_rng):
    """Fresh random runs of 4..40 samples, odd and even counts, tight and wide spreads, ties
    (numpy reference): the summary's median is the run's exactly, its log median and MAD^2 / n
    the run's to 1e-9, it has 3 values for an odd count and 4 (or a few more) for an even one,
    and the drift estimated from summaries is the one estimated from the raw runs."""
    raw, summaries = [], []
    for _ in range(400):
        n = int(fresh_rng.integers(4, 41))
        x = 100 * fresh_rng.lognormal(0.0, fresh_rng.choice([0.002, 0.03, 0.3]), n)
        x = np.round(x, 1) if fresh_rng.random() < 0.2 else x
        kept = retention.summarize(x)
        if kept is None:  # an even count whose middle samples lie too far apart for fewer values (ties
            # from rounding make the MAD small beside that gap, at any n)
            assert n % 2 == 0, x
            kept = list(x)
        else:
            assert len(kept) == 3 if n % 2 else 4 <= len(kept) < n and len(kept) % 2 == 0
            assert np.median(kept) == np.median(x)
            assert _spread(kept) == pytest.approx(_spread(x), rel=1e-9, abs=1e-15)
        raw.append(list(x))
        summaries.append(kept)
    assert estimate_drift(summaries) == pytest.approx(estimate_drift(raw), rel=1e-9, abs=1e-12)
    assert retention.summarize([5.0, 5.0, 5.0, 5.0, 5.0]) == [5.0, 5.0, 5.0]
    assert retention.summarize([1.0, 2.0, 3.0]) is None  # nothing to gain
    assert retention.summarize([0.0, 1.0, 2.0, 3.0, 4.0]) is None  # no logarithm of 0: kept raw


# ---- downsampling on the store ------------------------------------------------------------------


def _latency_with_kernels(rng, reps: int) -> JobResult:
    """`reps` UNet steps, and per repetition two kernels, conv2d timed in two parts."""
    steps = 100.0 * rng.lognormal(0.0, 0.02, reps)
    kernels = []
    for r in range(reps):
        kernels += [KernelTiming("attention/flash", 4, 40.0 + rng.normal(0, 0.5), r),
                    KernelTiming("conv2d", 6, 30.0 + rng.normal(0, 0.5), r),
                    KernelTiming("conv2d", 4, 20.0 + rng.normal(0, 0.5), r)]
    return JobResult(job_id="j", kind="latency", status="succeeded", kernel_timings=kernels,
                     samples=[Sample("unet_step_ms", float(v), "ms", r) for r, v in enumerate(steps)]
                     + [Sample("peak_gpu_bytes", 1e9, "bytes", r) for r in range(reps)])


def test_downsampling_keeps_each_runs_median_exactly_and_the_rows_drop(Session, tmp_path):  # noqa: N803
    """Four nightly builds of one device, runs of 9 and 10 samples with kernel timings: before
    the policy's age nothing changes; after it the two oldest runs (the newest build and its
    baseline are protected) keep their medians exactly, 3 or 4 samples and one kernel timing
    per kernel (the median of its per-repetition totals); the run says so and what it stood
    for. A dry run first says exactly that and changes nothing; a second pass finds nothing."""
    rng = np.random.default_rng(40)
    with Session() as s, s.begin():
        device = _device(s, "p1")
        runs = []
        for i, reps in enumerate((9, 10, 9, 10), start=1):
            build = store.create_build(s, tiny_manifest(f"b{i}", 1_700_000_000.0 + 86400 * i))
            runs.append(record_job(s, "latency", SPEC, device.id, build.id, _latency_with_kernels(rng, reps)).id)
        before = {r: _values(s, r) for r in runs}
        kernels = {r: {(k.repetition, k.kernel, k.total_ms) for k in s.scalars(select(KernelRow).where(
            KernelRow.run_id == r))} for r in runs}
        rows = s.scalar(select(func.count()).select_from(SampleRow)), s.scalar(select(func.count()).select_from(KernelRow))

    young = retention.apply(Session, POLICY, tmp_path, now=utcnow() + dt.timedelta(days=89))
    assert (young.runs_downsampled, young.summaries, young.kernel_rows_removed) == (0, 0, 0)
    dry = retention.apply(Session, POLICY, tmp_path, now=utcnow() + FAR, dry_run=True)
    with Session() as s:
        assert (s.scalar(select(func.count()).select_from(SampleRow)),
                s.scalar(select(func.count()).select_from(KernelRow))) == rows
        assert s.scalar(select(func.count()).select_from(Run).where(Run.downsampled_at.is_not(None))) == 0
    done = retention.apply(Session, POLICY, tmp_path, now=utcnow() + FAR)
    assert _counts(dry) == _counts(done)
    # unet_step_ms 9 -> 3 and 10 -> 4; peak_gpu_bytes (all equal) 9 -> 3, 10 -> 3; kernels 27 -> 2, 30 -> 2
    assert (done.runs_downsampled, done.runs_protected, done.summaries) == (2, 2, 4)
    assert done.sample_rows_removed == (9 - 3) + (10 - 4) + (9 - 3) + (10 - 3)
    assert done.kernel_rows_removed == (27 - 2) + (30 - 2)
    with Session() as s:
        assert s.scalar(select(func.count()).select_from(SampleRow)) == rows[0] - done.sample_rows_removed
        for run_id, n in zip(runs[:2], (9, 10), strict=True):
            kept, run = _values(s, run_id), s.get(Run, run_id)
            assert len(kept) == (3 if n % 2 else 4) and np.median(kept) == np.median(before[run_id])
            assert _spread(kept) == pytest.approx(_spread(before[run_id]), rel=1e-9)
            assert _values(s, run_id, "peak_gpu_bytes") == [1e9] * 3
            assert run.downsampled_at is not None and run.retained["samples"]["unet_step_ms"] == {
                "n": n, "min": min(before[run_id]), "max": max(before[run_id]), "kept": len(kept)}
            assert run.retained["kernel_repetitions"] == n
            per_rep: dict[str, dict[int, float]] = {}
            for rep, kernel, ms in kernels[run_id]:
                per_rep.setdefault(kernel, {}).setdefault(rep, 0.0)
                per_rep[kernel][rep] += ms
            timings = {k.kernel: k for k in s.scalars(select(KernelRow).where(KernelRow.run_id == run_id))}
            assert sorted(timings) == ["attention/flash", "conv2d"] and timings["conv2d"].calls == 10
            for kernel, reps in per_rep.items():
                assert timings[kernel].total_ms == pytest.approx(float(np.median(list(reps.values()))), rel=1e-12)
        for run_id in runs[2:]:  # the newest build and its baseline
            assert sorted(_values(s, run_id)) == sorted(before[run_id]) and s.get(Run, run_id).downsampled_at is None
    again = retention.apply(Session, POLICY, tmp_path, now=utcnow() + FAR)
    assert (again.runs_downsampled, again.sample_rows_removed, again.kernel_rows_removed) == (0, 0, 0)


def _alert(session, device, build, baseline, state=AlertState.new, kind=AlertKind.regression) -> None:
    store.save_alert(session, Alert(kind=kind, state=state, device_id=device.id, build_id=build.id,
                                    baseline_build_id=baseline.id, metric="unet_step_ms", series={}, detail={}))


def test_open_alert_builds_their_baselines_and_the_newest_builds_keep_every_raw_sample(Session, tmp_path):  # noqa: N803
    """Builds b1..b5 on two devices. p1: an open regression on b3 (baseline b2) and a fixed one
    on b4 (baseline b1), which protects nothing; its newest build b5 and b5's baseline b4 are
    protected: only b1 is downsampled. p2: open regressions on b5 and b4 (baseline b3): the
    newest, the builds back to the first without an open regression (b3): b1 and b2 are
    downsampled. p1's alert protects nothing on p2."""
    rng = np.random.default_rng(41)
    with Session() as s, s.begin():
        p1, p2 = _device(s, "p1"), _device(s, "p2")
        seed_nightlies(s, [p1, p2], SPEC, lambda slow: latency_result(rng, slow), slows=(1.0,) * 5)
        b = {name: store.get_build(s, name) for name in ("b1", "b2", "b3", "b4", "b5")}
        _alert(s, p1, b["b3"], b["b2"])
        _alert(s, p1, b["b4"], b["b1"], state=AlertState.fixed)
        _alert(s, p2, b["b5"], b["b3"], state=AlertState.acknowledged)
        _alert(s, p2, b["b4"], b["b3"])
        assert retention.protected_builds(s) == {(p1.id, b[n].id) for n in ("b2", "b3", "b4", "b5")} | {
            (p2.id, b[n].id) for n in ("b3", "b4", "b5")}
    report = retention.apply(Session, POLICY, tmp_path, now=utcnow() + FAR)
    assert (report.runs_downsampled, report.runs_protected) == (3, 7)
    with Session() as s:
        for device, downsampled in ((p1, {"b1"}), (p2, {"b1", "b2"})):
            for name, build in b.items():
                (run,) = s.scalars(select(Run).where(Run.device_id == device.id, Run.build_id == build.id))
                assert (len(_values(s, run.id)) < 10) == (name in downsampled), (device.serial, name)
                assert (run.downsampled_at is not None) == (name in downsampled)


# ---- the analysis, before and after -------------------------------------------------------------


def _verdicts(report) -> list[tuple]:
    return [(c["device"], c["metric"], c["verdict"], c["baseline_build"], c["drift_source"], c["ratio"],
             c["ci_low"], c["ci_high"], c["p_value"], c["drift"]) for c in report["comparisons"]]


def _change_points(session) -> list[tuple]:
    return [(f.device_id, f.key.canonical(), f.point.index, f.point.p_value, f.point.q, f.point.median_before,
             f.point.median_after, f.point.ratio) for f in changepoints.find_change_points(session)]


def _same(before: list[tuple], after: list[tuple]) -> None:
    assert len(before) == len(after)
    for old, new in zip(before, after, strict=True):
        assert [v for v in old if not isinstance(v, float)] == [v for v in new if not isinstance(v, float)]
        assert [v for v in new if isinstance(v, float)] == pytest.approx(
            [v for v in old if isinstance(v, float)], rel=1e-9, abs=1e-12)


def test_the_analysis_verdicts_are_unchanged_after_downsampling_old_runs(Session, tmp_path):  # noqa: N803
    """Twelve nightly builds on two devices whose runs drift 2% from night to night (the series
    assume so until their history estimates it: about 2% on both); from b7 on p-slower is 30%
    slower. Each night's batch is analysed as beat would (p-slower's b7..b12 are open
    regressions against b6). Then, with a clock ten years ahead, retention downsamples
    every run it may (p-same b1..b10, p-slower b1..b5: most of b12's drift history on both, and
    the segment before p-slower's change point), and b12's batch analysed again and the
    change-point scan give the same verdicts, baselines, drift sources, ratios, intervals,
    p-values and drifts (to 1e-9), and the same change points."""
    rng = np.random.default_rng(7)
    levels = np.exp(rng.normal(0.0, 0.02, 12))
    with Session() as s, s.begin():
        same, slower = _device(s, "p-same"), _device(s, "p-slower")
        for device in (same, slower):
            regressions.set_drift(s, regressions.series_key(device, regressions.SpecKey.of(SPEC), "unet_step_ms"), 0.02)

        def slower_too(build, batch):
            i = int(build.name[1:])
            record_job(s, "latency", SPEC, slower.id, build.id,
                       latency_result(rng, levels[i - 1] * (1.3 if i >= 7 else 1.0)), batch_id=batch.id)

        batches = seed_nightlies(s, [same], SPEC, lambda slow: latency_result(rng, slow), slows=tuple(levels),
                                 on_build=slower_too)
        for batch_id in batches.values():
            regressions.analyze_batch(s, batch_id)
    with Session() as s, s.begin():
        before = _verdicts(regressions.analyze_batch(s, batches["b12"]))
        points = _change_points(s)
    by_device = {v[0]: v for v in before}
    assert by_device["p-slower"][2:4] == ("regression", "b6") and by_device["p-same"][2:4] == ("inconclusive", "b11")
    assert all(v[4].startswith("estimated from") and v[-1] > 0.01 for v in before), before
    assert [(p[0], p[2]) for p in points] == [(slower.id, 6)], points  # b7

    report = retention.apply(Session, POLICY, tmp_path, now=utcnow() + FAR)
    assert (report.runs_downsampled, report.summaries) == (10 + 5, 10 + 5)
    with Session() as s, s.begin():
        assert s.scalar(select(func.count()).select_from(Run).where(Run.downsampled_at.is_not(None))) == 15
        _same(before, _verdicts(regressions.analyze_batch(s, batches["b12"])))
        _same(points, _change_points(s))


# ---- images and logs ----------------------------------------------------------------------------


def _generate(session, device, build, seed: int, image_dir, data_dir, body: bytes):
    """A generate job that made one image (in `image_dir`) and a log (in its run's folder)."""
    image_dir.mkdir(parents=True, exist_ok=True)
    (image_dir / "image.png").write_bytes(body)
    result = JobResult(job_id="j", kind="generate", status="succeeded",
                       artifacts=[Artifact("image.png", "a" * 64, len(body), "image"),
                                  Artifact("job.log", "b" * 64, 7, "log")])
    run = record_job(session, "generate", SPEC | {"seed": seed}, device.id, build.id, result, artifacts_dir=image_dir)
    folder = retention.run_folder(data_dir, run.job_id, run.attempt)
    folder.mkdir(parents=True)
    (folder / "job.log").write_text("step 1\n")
    (folder / "result.json").write_text("{}")
    return run


def test_old_images_and_logs_go_but_the_newest_image_of_each_kind_stays(Session, tmp_path):  # noqa: N803
    """Generate runs of b1..b4 with seed 0 and of b1 with seed 1, each with an image and a job
    log. At 20 days nothing goes; at 40 every log file (result.json stays); at 200 days the
    images of b1 and b2 with seed 0, not b1's with seed 1 (the newest of its seed), b3's (the
    newest build's baseline) nor b4's; b2's image lies outside the data dir: its row goes, its
    file stays. A dry run first says the same and deletes nothing; a second pass finds nothing."""
    data = tmp_path / "data"
    with Session() as s, s.begin():
        device = _device(s, "p1")
        builds = [store.create_build(s, tiny_manifest(f"b{i}", 1_700_000_000.0 + 86400 * i)) for i in range(1, 5)]
        runs = {}
        for i, build in enumerate(builds, start=1):
            for seed in (0, 1) if i == 1 else (0,):
                folder = (tmp_path / "elsewhere" if i == 2 else data / "images") / f"b{i}-s{seed}"
                runs[(i, seed)] = _generate(s, device, build, seed, folder, data, b"x" * (100 * i + seed))
        paths = {key: s.scalar(select(Image.path).where(Image.run_id == run.id)) for key, run in runs.items()}
        logs = {key: retention.run_folder(data, run.job_id, run.attempt) / "job.log" for key, run in runs.items()}

    soon = retention.apply(Session, POLICY, data, now=utcnow() + dt.timedelta(days=20))
    assert (soon.log_files_deleted, soon.images_deleted) == (0, 0)
    dry = retention.apply(Session, POLICY, data, now=utcnow() + dt.timedelta(days=40), dry_run=True)
    assert all(p.exists() for p in logs.values())
    month = retention.apply(Session, POLICY, data, now=utcnow() + dt.timedelta(days=40))
    assert _counts(dry) == _counts(month)
    assert (month.log_files_deleted, month.log_bytes, month.images_deleted) == (5, 5 * 7, 0)
    assert not any(p.exists() for p in logs.values()) and all((p.parent / "result.json").exists() for p in logs.values())
    with Session() as s:
        assert s.scalar(select(func.count()).select_from(Run).where(Run.logs_deleted_at.is_(None))) == 0

    dry = retention.apply(Session, POLICY, data, now=utcnow() + dt.timedelta(days=200), dry_run=True)
    assert all(Path(p).exists() for p in paths.values())
    later = retention.apply(Session, POLICY, data, now=utcnow() + dt.timedelta(days=200))
    assert _counts(dry) == _counts(later)
    assert (later.images_deleted, later.images_kept, later.image_bytes, later.image_files_left) == (2, 3, 100, 1)
    gone = {(1, 0), (2, 0)}
    with Session() as s:
        left = set(s.scalars(select(Image.path)))
    assert left == {p for key, p in paths.items() if key not in gone}
    for key, path in paths.items():
        assert Path(path).exists() == (key not in gone or key == (2, 0)), key  # b2's file is outside the data dir
    again = retention.apply(Session, POLICY, data, now=utcnow() + dt.timedelta(days=200))
    assert (again.images_deleted, again.log_files_deleted) == (0, 0)


# ---- farm retention -----------------------------------------------------------------------------


def _one_error(result, *fragments: str, code: int) -> None:
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for fragment in fragments:
        assert fragment in lines[0], result.output


def test_farm_retention_shows_dry_runs_and_applies_the_policy(cli):
    """Three nightly builds 100 days old: `show` lists the policies and would downsample b1's
    run (b3 is the newest, b2 its baseline); `apply --dry-run` says so and changes nothing;
    `apply` does it, with --json the report, and again finds nothing; --raw-days 0 keeps raw
    samples for ever; bad days on the command line or in FARM_RETENTION_* end in one line."""
    rng = np.random.default_rng(42)
    with cli.Session() as s, s.begin():
        device = _device(s, "p1")
        seed_nightlies(s, [device], SPEC, lambda slow: latency_result(rng, slow))
        old = utcnow() - dt.timedelta(days=100)
        s.execute(update(Job).values(created_at=old, finished_at=old))
    samples = lambda: cli.Session().scalar(select(func.count()).select_from(SampleRow))  # noqa: E731

    shown = cli("retention", "show").output
    for fragment in ("raw samples", "kernel timings", "images", "job log files", "90 days", "180 days",
                     "30 days", "FARM_RETENTION_RAW_DAYS", "downsample 1 runs", "1 sample sets summarized"):
        assert fragment in shown, shown
    data = json.loads(cli("retention", "show", "--json").output)
    assert [p["days"] for p in data["policy"]] == [90, 90, 180, 30]
    assert data["would"]["runs_downsampled"] == 1 and data["would"]["dry_run"] is True
    assert "would downsample 1 runs" in cli("retention", "apply", "--dry-run").output
    assert samples() == 30
    assert json.loads(cli("retention", "apply", "--raw-days", "0", "--kernel-days", "0", "--json").output)[
        "runs_downsampled"] == 0
    done = json.loads(cli("retention", "apply", "--json").output)
    assert (done["runs_downsampled"], done["sample_rows_removed"], done["dry_run"]) == (1, 6, False)
    assert samples() == 24
    assert "downsampled 0 runs" in cli("retention", "apply").output

    _one_error(cli("retention", "apply", "--raw-days", "-1", ok=False), "--raw-days", code=3)
    _one_error(cli("retention", "show", "--log-days", "soon", ok=False), "--log-days", code=3)
    _one_error(cli("retention", "apply", "--bogus", ok=False), "--bogus", code=3)


def test_a_bad_retention_setting_is_one_line(cli, monkeypatch):
    monkeypatch.setenv("FARM_RETENTION_IMAGE_DAYS", "half a year")
    _one_error(cli("retention", "show", ok=False), "FARM_RETENTION_IMAGE_DAYS", "half a year", code=3)
    monkeypatch.setenv("FARM_RETENTION_IMAGE_DAYS", "-5")
    _one_error(cli("retention", "apply", ok=False), "FARM_RETENTION_IMAGE_DAYS", code=3)


def test_beat_applies_retention_daily(cli):
    """Beat's schedule has the daily pass, and the task's work applies the settings' policy
    to the farm's store."""
    from orchestrator.infra.settings import load_settings
    from orchestrator.jobs import retention as retention_job
    from orchestrator.jobs.celery_app import make_celery

    app = make_celery(load_settings())
    assert app.conf.beat_schedule["retention"] == {"task": "orchestrator.tasks.apply_retention",
                                                   "schedule": 86400.0, "options": {"queue": "farm"}}
    assert retention_job.apply(app)["runs_downsampled"] == 0


def test_migration_0023_adds_the_retention_columns_and_takes_them_back(db_url):
    """0023 gives runs downsampled_at, retained and logs_deleted_at; down to 0022 they go, and
    up again they are back."""
    from alembic import command
    from sqlalchemy import inspect

    from orchestrator.store import make_engine, migrate

    def columns() -> set[str]:
        engine = make_engine(db_url)
        try:
            return {c["name"] for c in inspect(engine).get_columns("runs")}
        finally:
            engine.dispose()

    added = {"downsampled_at", "retained", "logs_deleted_at"}
    migrate.upgrade(db_url, "0023")
    assert added <= columns()
    command.downgrade(migrate.alembic_config(db_url), "0022")
    assert not added & columns()
    migrate.upgrade(db_url, "0023")
    assert added <= columns()
