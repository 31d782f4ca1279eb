"""The series state (orchestrator/analysis/series_state.py) on both stores: what it keeps equals
what the raw samples say (numpy reference: every point's count, median, minimum and maximum,
every series' drift), on fresh random histories with two workloads, a driver update, a build
measured twice and a thermally flagged run; a catch-up adds each run once, and finds a run
committed out of id order; and the cost of one nightly batch's analysis does not grow with the
history: the same SQL statements, and the same rows read, after 8 nights and after 24."""

from __future__ import annotations

import numpy as np
import pytest
from support import record_job, tiny_manifest

from agent.protocol import JobResult, RunEnvironment, Sample, ThermalReading
from orchestrator import store
from orchestrator.analysis import regressions, series_state
from orchestrator.analysis import series as farm_series
from orchestrator.analysis import stats as rg

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2}


def _result(rng, level: float, driver: str, *, hot: bool = False) -> JobResult:
    reps = int(rng.integers(3, 12))
    steps = level * rng.lognormal(0.0, 0.03, reps)
    gen = level * 20 * rng.lognormal(0.0, 0.03, 3)
    return JobResult(job_id="j", kind="latency", status="succeeded", cooldown_timed_out=hot,
                     samples=[Sample("unet_step_ms", float(v), "ms", r) for r, v in enumerate(steps)]
                     + [Sample("e2e_ms", float(v), "ms", r) for r, v in enumerate(gen)],
                     thermal=[ThermalReading("before", "gpu", 35.0)],
                     environment=RunEnvironment(os="android", os_version="14", driver=driver))


def _history(s, rng, nights: int, devices=("p1", "p2"), first: int = 1) -> dict[str, int]:
    """Nightly builds, each a batch of two workloads per device; p2's driver changes halfway,
    build 3 is measured twice on p1 and one of p1's runs is thermally flagged."""
    batches = {}
    for serial in devices:
        store.upsert_device(s, serial, "local", f"/tmp/{serial}", host="h")
    for night in range(first, nights + 1):
        build = store.create_build(s, tiny_manifest(f"n{night:03d}", 1_700_000_000.0 + 86400 * night))
        batch = store.create_batch(s, f"nightly {build.name}", build_id=build.id)
        for serial in devices:
            device = store.get_device(s, serial)
            driver = "v2" if serial == "p2" and night > nights // 2 else "v1"
            for profile, level in (("auto", 100.0), ("tuned", 90.0)):
                drift = float(np.exp(rng.normal(0.0, 0.02)))
                spec = SPEC | {"profile": profile}
                hot = serial == "p1" and night == 2 and profile == "auto"
                record_job(s, "latency", spec, device.id, build.id, _result(rng, level * drift, driver, hot=hot),
                           batch_id=batch.id)
                if serial == "p1" and night == 3:
                    record_job(s, "latency", spec, device.id, build.id, _result(rng, level, driver), batch_id=batch.id)
        batches[build.name] = batch.id
    return batches


def test_the_state_equals_the_raw_samples(Session):  # noqa: N803
    rng = np.random.default_rng()
    with Session() as s, s.begin():
        _history(s, rng, 9)
        assert series_state.catch_up(s) > 0
        assert series_state.catch_up(s, thorough=True) == 0  # each run once
        found = farm_series.list_series(s)
        # 2 devices x 2 workloads x 2 metrics, and p2's second driver: 4 more
        assert len(found) == 12 and len({x.id for x in found}) == 12
        for series in found:
            device = store.get_device(s, series.device_id)
            reference = regressions.series_history(s, device, series.spec, series.key.metric,
                                                   environment=series.key.environment)
            points = farm_series.points(s, series)
            assert [p["build"] for p in points] == [h["build"] for h in reference]
            for point, ref in zip(points, reference, strict=True):
                assert point["values"] == ref["values"]
                assert point["n"] == len(ref["values"])
                assert point["median"] == pytest.approx(float(np.median(ref["values"])), rel=1e-12)
                assert (point["min"], point["max"]) == (min(ref["values"]), max(ref["values"]))
            assert series.builds == len(reference) and series.latest["build"] == reference[-1]["build"]
            assert series.latest["median"] == pytest.approx(float(np.median(reference[-1]["values"])), rel=1e-12)
            assert farm_series.get_series(s, series.id) == series
            # The drift before the newest build, from the state, against the estimator on raw samples
            # of the same runs (the flagged run left out).
            newest = store.get_build(s, reference[-1]["build_id"])
            drift, used = regressions.series_drift(s, device, series.spec, series.key.metric, newest,
                                                   environment=series.key.environment)
            runs = [r for h in reference[:-1] for r in regressions.runs_of(s, device.id, h["build_id"], "latency",
                                                                             series.spec)
                    if regressions.env_key_of(r, device) == series.key.environment]
            runs = [r for r in runs if not r.cooldown_timed_out][-regressions.DRIFT_HISTORY_RUNS:]
            raw = [[x.value for x in r.samples if x.metric == series.key.metric] for r in sorted(runs, key=lambda r: r.id)]
            expected = rg.estimate_drift(raw)
            if expected is None:
                assert used == 0
            else:
                assert used == len(raw) and drift == pytest.approx(expected, rel=1e-12)


def test_a_run_committed_out_of_id_order_is_found(Session):  # noqa: N803
    rng = np.random.default_rng()
    with Session() as s, s.begin():
        _history(s, rng, 2, devices=("p1",))
        series_state.catch_up(s)
        # Another transaction's run, committed after newer ones were read: its id is below the
        # progress mark (set ahead here to stand for those newer runs).
        store.lock_series_progress(s)
        store.set_series_progress(s, store.newest_run_id(s) + 5)
        build = store.get_build(s, "n002")
        device = store.get_device(s, "p1")
        record_job(s, "latency", SPEC | {"profile": "auto"}, device.id, build.id, _result(rng, 300.0, "v1"))
        assert series_state.catch_up(s) == 0  # the quick check sees nothing newer than the mark
        assert series_state.catch_up(s, thorough=True) == 1  # the thorough one looks back
        key = regressions.series_key(device, regressions.SpecKey.of(SPEC | {"profile": "auto"}), "unet_step_ms",
                                     {"os": "android", "os_version": "14", "driver": "v1"})
        series = farm_series.get_series(s, farm_series.series_id(key))
        reference = regressions.series_history(s, device, series.spec, "unet_step_ms", environment=key.environment)
        assert [p["n"] for p in farm_series.points(s, series)] == [len(h["values"]) for h in reference]


def _verdicts(report: dict) -> list[tuple]:
    return [(c["device"], c["metric"], c["series"]["profile"], c["verdict"], c["ratio"], c["ci_low"], c["ci_high"],
             c["drift"], c["drift_source"]) for c in report["comparisons"]]


def test_one_batch_analysis_reads_no_old_raw_samples(Session):  # noqa: N803
    """What one nightly batch's analysis reads of the past is the series state and the raw
    samples of the baseline build: with every raw sample older than that deleted (once the
    state holds those runs, as the nightly analyses of their batches left it), its
    comparisons (verdicts, ratios, intervals, drifts) and the change points found are the same.
    (Read from raw samples, the drift of the newest 30 runs changed when they went.)"""
    from sqlalchemy import delete, select

    from orchestrator.analysis import changepoints
    from orchestrator.store.models import Build, Run, Sample

    rng = np.random.default_rng(11)
    with Session() as s, s.begin():
        batches = _history(s, rng, 24)
        # a step on p1 from night 13: a change point in its history
        for night in range(13, 25):
            build = store.get_build(s, f"n{night:03d}")
            for run in s.scalars(select(Run).where(Run.build_id == build.id, Run.device_id == store.get_device(s, "p1").id)):
                for sample in run.samples:
                    sample.value *= 1.25
    with Session() as s, s.begin():
        series_state.catch_up(s)  # as the nightly analyses of those nights left it
    with Session() as s, s.begin():
        before = regressions.analyze_batch(s, batches["n024"])
        points = [(f.key.canonical(), f.history[f.point.index]["build"], f.point.ratio)
                  for f in changepoints.find_change_points(s)]
        s.rollback()
    assert any(v[3] != "no baseline" for v in _verdicts(before)) and points
    with Session() as s, s.begin():
        old = select(Build.id).where(Build.name < "n023")  # everything before the baseline build
        s.execute(delete(Sample).where(Sample.run_id.in_(select(Run.id).where(Run.build_id.in_(old)))))
    with Session() as s, s.begin():
        after = regressions.analyze_batch(s, batches["n024"])
        assert _verdicts(after) == _verdicts(before)
        assert [(f.key.canonical(), f.history[f.point.index]["build"], f.point.ratio)
                for f in changepoints.find_change_points(s)] == points
