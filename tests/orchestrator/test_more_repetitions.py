"""The more-repetitions round of the nightly analysis: an inconclusive comparison asks for a
new run of the candidate and of its baseline (run-to-run drift averages only over runs), and
launch_suite turns those entries into one batch with jobs for both builds and a deployment of
each build to the device, sent through the embedded broker (no worker: the messages are read
back from the broker's folder)."""

from __future__ import annotations

import base64
import json

from agent.protocol import Manifest, ManifestFile
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.batch_analysis import more_repetitions_jobs
from orchestrator.jobs.celery_app import make_celery
from orchestrator.jobs.jobservice import launch_suite
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import Job

SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 2, "job_id": 7}


def _manifest(name: str, created: float) -> Manifest:
    return Manifest(build=name, version="0.1.0", created=created,
                    files=[ManifestFile("models/tiny/model_index.json", "b" * 64, 20)])


def test_more_repetitions_rerun_the_candidate_and_its_baseline(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h")
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    Session = make_session_factory(engine)  # noqa: N806
    with Session() as s, s.begin():
        store.upsert_device(s, "p1", "local", str(tmp_path / "p1"), host="h")
        base = store.create_build(s, _manifest("b1", 1_700_000_000.0)).id
        cand = store.create_build(s, _manifest("b2", 1_700_086_400.0)).id
    entries = [{"device": "p1", "spec": SPEC, "repetitions": 10, "baseline_build": base}]
    jobs = more_repetitions_jobs(entries)
    assert list(jobs) == ["p1"]
    assert [j.get("build") for j in jobs["p1"]] == [None, base]
    assert all(j["spec"]["repetitions"] == 10 and "job_id" not in j["spec"] for j in jobs["p1"])

    app = make_celery(settings)
    batch_id = launch_suite(app, "night (more repetitions, round 1)", jobs["p1"], build=cand, devices=["p1"],
                            idempotency_key="more:1:1:p1", max_extra_rounds=3)
    with Session() as s:
        rows = s.query(Job).filter(Job.batch_id == batch_id).order_by(Job.id).all()
        assert sorted(j.build_id for j in rows) == sorted([cand, base])
        assert {j.kind.value for j in rows} == {"latency"} and {j.spec["repetitions"] for j in rows} == {10}
        assert store.get_batch(s, batch_id).build_id == cand  # the batch analyses the candidate
        # One pending deployment per build, each owning the jobs of its build.
        waits = {j.build_id: (j.id, store.get_deployment(s, j.deployment_id)) for j in rows}
        assert {b: d.status.value for b, (_, d) in waits.items()} == {cand: "pending", base: "pending"}
        assert {b: d.build_id for b, (_, d) in waits.items()} == {cand: cand, base: base}
    deploys = []
    for path in (settings.broker_dir / "queue").iterdir():
        message = json.loads(path.read_text())
        if message["headers"]["task"] == "orchestrator.tasks.deploy":
            args, _, _ = json.loads(base64.b64decode(message["body"]))
            deploys.append((args[0], args[1], message["properties"]["delivery_info"]["routing_key"]))
    assert sorted(deploys) == sorted([(waits[cand][1].id, 0, "host.h"), (waits[base][1].id, 0, "host.h")])
    engine.dispose()


def test_the_demo_follows_a_batch_until_every_round_it_asked_for_is_analysed(tmp_path):
    from orchestrator.cli.demo import batch_family, final_verdicts

    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h")
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    Session = make_session_factory(engine)  # noqa: N806

    def comparison(device, verdict):
        return {"device": device, "metric": "unet_step_ms", "verdict": verdict}

    with Session() as s, s.begin():
        root = store.create_batch(s, "night", max_extra_rounds=2)
        root.summary = {"analysis": {"comparisons": [comparison("p1", "inconclusive"), comparison("p2", "same")],
                                     "more_repetitions": [{"device": "p1"}]}}
        root_id = root.id
    with Session() as s:
        family, done = batch_family(s, root_id)
        assert [b.id for b in family] == [root_id] and done is False  # round 1 not launched yet
    with Session() as s, s.begin():
        first = store.create_batch(s, "round 1", idempotency_key=f"more:{root_id}:1:p1", max_extra_rounds=2)
    with Session() as s:
        assert batch_family(s, root_id)[1] is False  # launched, not analysed
    with Session() as s, s.begin():
        s.get(type(first), first.id).summary = {"analysis": {"comparisons": [comparison("p1", "inconclusive")],
                                                             "more_repetitions": [{"device": "p1"}]}}
        store.create_batch(s, "round 2", idempotency_key=f"more:{root_id}:2:p1", max_extra_rounds=2).summary = {
            "analysis": {"comparisons": [comparison("p1", "same")], "more_repetitions": [{"device": "p1"}]}}
    with Session() as s:
        family, done = batch_family(s, root_id)
        assert len(family) == 3 and done is True  # round 2 is the last: its own request is not followed
        assert [(c["device"], c["verdict"], c["rounds"]) for c in final_verdicts(family)] == [
            ("p1", "same", 3), ("p2", "same", 1)]
    engine.dispose()


def test_a_batch_rounds_only_on_its_round_metrics_unless_the_sample_count_decides(Session):  # noqa: N803
    """B is 30% slower in its UNet step (decided). Its end-to-end time, equal but noisy over 10
    samples (3%), is inconclusive for want of evidence, which the batch's rounds could give:
    every-metric batches ask for a round, a batch rounding on the UNet step does not. With 3
    end-to-end samples the sample count alone keeps it undecided, so every batch asks for a
    round, whatever metrics it rounds on."""
    import numpy as np
    from test_analysis import _latency, _manifest, _record

    from agent.protocol import Sample
    from orchestrator.analysis import regressions

    rng = np.random.default_rng(26)
    asked, causes = {}, {}
    cases = (("all", None, 10), ("unet", ["unet_step_ms"], 10), ("few", ["unet_step_ms"], 3))
    for label, metrics, e2e_reps in cases:
        with Session() as s, s.begin():
            device = store.upsert_device(s, f"p-{label}", "local", f"/tmp/p-{label}", host="h")
            base = store.create_build(s, _manifest(f"a-{label}", 1_700_000_000.0))
            cand = store.create_build(s, _manifest(f"b-{label}", 1_700_086_400.0))
            for build, slow in ((base, 1.0), (cand, 1.3)):
                result = _latency(rng, slow)
                result.samples += [Sample("e2e_ms", 500.0 * float(np.exp(rng.normal(0, 0.03))), "ms", r)
                                   for r in range(e2e_reps)]
                batch = store.create_batch(s, f"nightly {build.name}", build_id=build.id, round_metrics=metrics)
                _record(s, device.id, build.id, "latency", result, batch.id)
            report = regressions.analyze_batch(s, batch.id)
            verdicts = {c["metric"]: c["verdict"] for c in report["comparisons"]}
            assert verdicts["unet_step_ms"] == "regression" and verdicts["e2e_ms"] == "inconclusive", verdicts
            causes[label] = next(c["cause"] for c in report["comparisons"] if c["metric"] == "e2e_ms")
            asked[label] = [e["device"] for e in report["more_repetitions"]]
    assert causes == {"all": "not_significant", "unet": "not_significant", "few": "too_few"}
    assert asked == {"all": ["p-all"], "unet": [], "few": ["p-few"]}


def test_a_unet_step_round_times_unet_steps_only():
    entry = {"device": "p1", "spec": SPEC | {"repetitions": 5, "unet_repetitions": 10}, "repetitions": 20,
             "baseline_build": 1, "metrics": ["unet_step_ms"]}
    (candidate, baseline) = more_repetitions_jobs([entry])["p1"]
    assert candidate["spec"] == baseline["spec"]
    assert (candidate["spec"]["unet_repetitions"], candidate["spec"]["repetitions"]) == (20, 1)
    assert candidate["spec"]["kernel_timings"] is False
    both = more_repetitions_jobs([entry | {"metrics": ["unet_step_ms", "e2e_ms"]}])["p1"][0]["spec"]
    assert (both["unet_repetitions"], both["repetitions"]) == (20, 20)


def test_no_round_is_asked_for_where_the_rounds_left_could_not_decide(Session):  # noqa: N803
    """The same builds with end-to-end noise of 30% a sample: the batch's 3 rounds (10 more
    samples and one more run of each build a round) could not tell an equal time from a 3%
    change either way, so none is asked for, and the reason says why."""
    import numpy as np
    from test_analysis import _latency, _manifest, _record

    from agent.protocol import Sample
    from orchestrator.analysis import regressions

    rng = np.random.default_rng(27)
    with Session() as s, s.begin():
        device = store.upsert_device(s, "p-noisy", "local", "/tmp/p-noisy", host="h")
        for name, slow, day in (("a-noisy", 1.0, 0), ("b-noisy", 1.3, 1)):
            build = store.create_build(s, _manifest(name, 1_700_000_000.0 + 86400 * day))
            result = _latency(rng, slow)
            result.samples += [Sample("e2e_ms", 500.0 * float(np.exp(rng.normal(0, 0.3))), "ms", r) for r in range(10)]
            batch = store.create_batch(s, f"nightly {name}", build_id=build.id)
            _record(s, device.id, build.id, "latency", result, batch.id)
        report = regressions.analyze_batch(s, batch.id)
    (e2e,) = [c for c in report["comparisons"] if c["metric"] == "e2e_ms"]
    assert e2e["verdict"] == "inconclusive" and e2e["more_repetitions_suggested"] == 0, e2e
    assert "3 more runs of each build could not decide it either" in e2e["reason"]
    assert report["more_repetitions"] == []
