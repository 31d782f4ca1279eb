"""A suite's job entries may be meant for the devices of one runtime: an entry with "runtime"
becomes a job on those devices only (the demo gives its browser devices, whose pages run on a
software adapter, a lighter suite); an entry without one runs everywhere; an unknown runtime is
refused before anything is written."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from agent.protocol import Manifest, ManifestFile
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.dispatch import Sends
from orchestrator.jobs.jobservice import _create_suite
from orchestrator.store.models import Job


def test_entries_for_one_runtime_run_on_its_devices_only(Session, tmp_path):  # noqa: N803
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h")
    manifest = Manifest(build="b1", version="1", created=0.0,
                        files=[ManifestFile("models/tiny/model_index.json", "0" * 64, 2)])
    with Session() as session, session.begin():
        store.create_build(session, manifest)
        store.upsert_device(session, "agent-phone", "adb", "127.0.0.1:5990", host="h")
        store.upsert_device(session, "chrome-phone", "adb", "127.0.0.1:5991", host="h", runtime="browser")
        jobs = [{"kind": "latency", "spec": {"steps": 4}, "runtime": "python"},
                {"kind": "latency", "spec": {"steps": 2}, "runtime": "browser"},
                {"kind": "generate", "spec": {"steps": 3}}]
        batch_id = _create_suite(session, settings, Sends(), "mixed", jobs, build="b1",
                                 devices=["agent-phone", "chrome-phone"], schedule_id=None, idempotency_key=None,
                                 max_extra_rounds=None, round_metrics=None)
    with Session() as session:
        made = sorted((j.device.serial, str(j.kind), j.spec["steps"])
                      for j in session.scalars(select(Job).where(Job.batch_id == batch_id)))
    assert made == [("agent-phone", "generate", 3), ("agent-phone", "latency", 4),
                    ("chrome-phone", "generate", 3), ("chrome-phone", "latency", 2)]
    with Session() as session, session.begin(), pytest.raises(store.StoreError, match="python or browser"):
        _create_suite(session, settings, Sends(), "bad", [{"kind": "generate", "spec": {}, "runtime": "wasm"}],
                      build="b1", devices=["agent-phone"], schedule_id=None, idempotency_key=None,
                      max_extra_rounds=None, round_metrics=None)
