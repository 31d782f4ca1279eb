"""`farm bisect` launching runs, end to end on the embedded stack (a real worker, the
filesystem broker, SQLite, the local transport on lavapipe): of four builds, b1 and b2 run
the kernels chosen for this GPU and b3 and b4 every reference kernel (2-3x slower here). Only
the bad end has runs when bisect starts; it deploys and measures the builds it needs, one
batch each, and names b3 as the first bad build."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select
from test_tasks import HOST, farm  # noqa: F401  (the module's own real worker and store)
from test_tuning_loop import _wait_for_batch
from typer.testing import CliRunner

from agent.packing import build_bundle
from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.cli import app as farm_cli
from orchestrator.jobs.jobservice import launch_suite
from orchestrator.store.models import Batch, Build, Job, JobKind, JobState

# `alone`: scripts/test.sh runs this file with no other test beside it: it times builds against each other on this machine's CPU.
pytestmark = [pytest.mark.gpu, pytest.mark.alone]
SPEC = {"precision": "fp32", "steps": 1, "warmup": 1, "repetitions": 1,
        "unet_repetitions": 8, "kernel_timings": False, "time_limit_s": 300.0}


def _build(farm, tmp_path, tiny_model_dir, name: str, created: float, reference: bool) -> None:  # noqa: F811
    sources = {"models/tiny": tiny_model_dir}
    if reference:  # every job of the build runs the reference kernels unless it names a profile
        (tmp_path / name).mkdir()
        (tmp_path / name / "DEFAULT").write_text("reference\n")
        sources["profiles"] = tmp_path / name
    settings = farm["app"].farm_settings
    key = settings.config_dir.parent / "farm.key"
    manifest = build_bundle(sources, settings.data_dir / "builds" / name, name, "0.1.0", key)
    manifest.created = created
    with farm["Session"]() as session, session.begin():
        store.create_build(session, manifest)


def test_bisect_measures_the_builds_it_needs_and_finds_the_first_bad_one(farm, tmp_path, tiny_model_dir,  # noqa: F811
                                                                         monkeypatch):
    with farm["Session"]() as session, session.begin():
        b1 = session.scalar(select(Build).where(Build.name == "b1"))
        b1_created = b1.created.timestamp()
        # Noisy-series settings as test_check_live.py's: this lavapipe shares 2 cores, and one
        # run of b2 (b1's kernels) came out 1.17x b1's (95% CI from 1.05) under the default 1%
        # drift and 3% minimum effect, which made b2 the first bad build. b3 and b4 are 2-3x slower.
        spec = regressions.SpecKey.of({"model": store.default_model(b1)} | SPEC)
        device = store.get_device(session, "local-1")
        for metric in regressions.HEADLINE_METRICS:
            key = regressions.series_key(device, spec, metric)
            regressions.set_min_effect(session, key, 0.25)
            regressions.set_drift(session, key, 0.10)
    for i, (name, reference) in enumerate([("b2", False), ("b3", True), ("b4", True)], start=1):
        _build(farm, tmp_path, tiny_model_dir, name, b1_created + 3600 * i, reference)
    # The regression as a nightly run found it: b4 measured once on the device.
    _wait_for_batch(farm, launch_suite(farm["app"], "nightly b4", [{"kind": "latency", "spec": SPEC}], build="b4",
                                       devices=["local-1"], max_extra_rounds=0))

    settings = farm["app"].farm_settings
    for key, value in {"FARM_DATA_DIR": settings.data_dir, "FARM_CONFIG_DIR": settings.config_dir,
                       "FARM_DATABASE_URL": settings.database_url, "FARM_HOST_NAME": HOST}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("FARM_BROKER_URL", raising=False)
    result = CliRunner().invoke(farm_cli, ["bisect", "--good", "b1", "--bad", "b4", "--device", "local-1",
                                           "--repetitions", "8", "--timeout", "300", "--json"])
    assert result.exit_code == 0, result.output + farm["log"].read_text()[-3000:]
    found = json.loads(result.output)
    assert (found["first_bad"], found["last_good"]) == ("b3", "b2"), found
    verdicts = {s["build"]: s["verdict"] for s in found["steps"]}
    assert verdicts["b4"] == "regression" and verdicts["b3"] == "regression" and verdicts["b2"] != "regression"

    with farm["Session"]() as session:
        launched = session.scalars(select(Batch).where(Batch.name.like("bisect b1..b4 %")).order_by(Batch.id)).all()
        # b4 already had its run; bisect ran b1 (the baseline of every step), then b2 and b3.
        assert sorted(b.build.name for b in launched) == ["b1", "b2", "b3"]
        for batch in launched:
            (job,) = session.scalars(select(Job).where(Job.batch_id == batch.id)).all()
            assert job.kind == JobKind.latency and job.state == JobState.succeeded, job.error
            assert job.spec["unet_repetitions"] == 8 and job.spec["steps"] == 1  # the bad run's spec
