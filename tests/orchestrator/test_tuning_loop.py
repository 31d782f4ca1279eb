"""The tuning loop end to end on the embedded stack (real worker processes, the filesystem
broker, SQLite, the local transport on lavapipe): a suite tunes the device's GPU, times its
family's profile and the profile just tuned (which waits for the tune), and the analysis
records the gain on the registered profile; the gain is recomputed here from the stored
samples. Then the same loop with a tune that fails ends the tuned latency job without
running it."""

from __future__ import annotations

import time

import numpy as np
import pytest
from sqlalchemy import select
from test_tasks import HOST, farm  # noqa: F401  (the module's own real worker and store)

from orchestrator.analysis.profiles import profile_sha256
from orchestrator.jobs.jobservice import launch_suite
from orchestrator.store.models import Batch, Job, JobKind, JobState, Profile, Run, Sample

pytestmark = pytest.mark.gpu
COMMON = {"precision": "fp32", "steps": 1, "height": 32, "width": 32, "time_limit_s": 300.0}
LOOP = [{"kind": "tune", "spec": COMMON | {"warmup": 0, "tune_repeats": 1, "tune_time_budget_s": 3.0}},
        {"kind": "latency", "spec": COMMON | {"profile": "family", "warmup": 1, "repetitions": 1,
                                              "unet_repetitions": 8}},
        {"kind": "latency", "spec": COMMON | {"profile": "tuned", "warmup": 1, "repetitions": 1,
                                              "unet_repetitions": 8}}]


def _wait_for_batch(farm, batch_id: int, timeout: float = 420.0) -> Batch:  # noqa: F811
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with farm["Session"]() as session:
            batch = session.get(Batch, batch_id)
            if batch.summary is not None:
                session.expunge(batch)
                return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} not analysed in {timeout} s:\n{farm['log'].read_text()[-4000:]}")


def _unet_steps(session, job_id: int) -> np.ndarray:
    run = session.scalar(select(Run).where(Run.job_id == job_id))
    return np.array(session.scalars(select(Sample.value).where(Sample.run_id == run.id,
                                                               Sample.metric == "unet_step_ms")).all())


def test_tune_then_time_family_and_tuned_records_the_measured_gain(farm):  # noqa: F811
    batch_id = launch_suite(farm["app"], "tuning loop", LOOP, build="b1", devices=["local-1"], max_extra_rounds=0)
    batch = _wait_for_batch(farm, batch_id)
    with farm["Session"]() as session:
        tune, family, tuned = session.scalars(select(Job).where(Job.batch_id == batch_id).order_by(Job.id)).all()
        assert [j.state for j in (tune, family, tuned)] == [JobState.succeeded] * 3, \
            [j.error for j in (tune, family, tuned)]
        assert tuned.after_job_id == tune.id and tuned.started_at >= tune.finished_at  # it waited for the tune

        profile = session.scalar(select(Profile))
        tune_run = session.scalar(select(Run).where(Run.job_id == tune.id))
        assert profile.tune_run_id == tune_run.id and profile.tuned_on_device_id == farm["device_id"]
        assert profile.sha256 == profile_sha256(profile.data) and profile.name.startswith("tuned-")
        assert profile.family == "software" and profile.estimated_gain is not None  # llvmpipe's family
        assert profile.engine_version.startswith("b1") and profile.gpu_device.startswith("llvmpipe")
        # The tuned latency job ran exactly the registered document, and says so.
        assert tuned.spec["profile_document"] == profile.data
        assert session.scalar(select(Run).where(Run.job_id == tuned.id)).engine["profile"] == profile.name
        assert session.scalar(select(Run).where(Run.job_id == family.id)).engine["profile"] == "software"

        fam, tun = _unet_steps(session, family.id), _unet_steps(session, tuned.id)
        assert fam.size == tun.size == 8
        assert profile.measured_gain == pytest.approx(np.median(fam) / np.median(tun), rel=1e-12)
        low, high = profile.measured_gain_ci
        assert low <= profile.measured_gain <= high and profile.measured_in_batch_id == batch_id
    (gain,) = batch.summary["analysis"]["profile_gains"]
    assert gain["device"] == "local-1" and gain["profile_id"] == profile.id
    assert gain["gain"] == pytest.approx(profile.measured_gain) and gain["n_tuned"] == 8
    assert gain["verdict"] in ("faster", "slower", "no clear difference")


def test_a_failed_tune_ends_the_latency_job_that_waited_for_it(farm):  # noqa: F811
    broken = [dict(LOOP[0], spec=LOOP[0]["spec"] | {"model": "models/missing"}), LOOP[2]]
    batch_id = launch_suite(farm["app"], "broken tuning", broken, build="b1", devices=["local-1"], max_extra_rounds=0)
    _wait_for_batch(farm, batch_id)
    with farm["Session"]() as session:
        tune, tuned = session.scalars(select(Job).where(Job.batch_id == batch_id).order_by(Job.id)).all()
        assert tune.kind == JobKind.tune and tune.state == JobState.failed and "models/missing" in tune.error
        assert tuned.state == JobState.infra_failed and tuned.attempts == 0
        assert f"job {tune.id}, which it runs after, ended failed" in tuned.error
