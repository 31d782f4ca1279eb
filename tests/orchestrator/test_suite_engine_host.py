"""A suite's job entries may be meant for the devices of one engine host: an entry with an
"engine_host" becomes a job on those devices only (the demo gives its browser devices, whose
pages run on a software adapter, a lighter suite); an entry without one runs everywhere; an
unknown engine host is refused before anything is written. A browser device's jobs are stored
on the browser executor, the others' on the native one."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from agent.protocol import Manifest, ManifestFile
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs.dispatch import Sends
from orchestrator.jobs.jobservice import _create_suite
from orchestrator.store.models import Job


def test_entries_for_one_engine_host_run_on_its_devices_only(Session, tmp_path):  # noqa: N803
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="h")
    manifest = Manifest(build="b1", version="1", created=0.0,
                        files=[ManifestFile("models/tiny/model_index.json", "0" * 64, 2)])
    with Session() as session, session.begin():
        store.create_build(session, manifest)
        store.upsert_device(session, "agent-phone", "adb", "127.0.0.1:5990", host="h")
        store.upsert_device(session, "chrome-phone", "adb", "127.0.0.1:5991", host="h", engine_host="browser")
        jobs = [{"kind": "latency", "spec": {"steps": 4}, "engine_host": "python"},
                {"kind": "latency", "spec": {"steps": 2}, "engine_host": "browser"},
                {"kind": "generate", "spec": {"steps": 3}}]
        batch_id = _create_suite(session, settings, Sends(), "mixed", jobs, build="b1",
                                 devices=["agent-phone", "chrome-phone"], schedule_id=None, idempotency_key=None,
                                 max_extra_rounds=None, round_metrics=None)
    with Session() as session:
        made = sorted((j.device.serial, str(j.kind), j.spec["steps"], store.job_spec(j).executor)
                      for j in session.scalars(select(Job).where(Job.batch_id == batch_id)))
    assert made == [("agent-phone", "generate", 3, "native"), ("agent-phone", "latency", 4, "native"),
                    ("chrome-phone", "generate", 3, "browser"), ("chrome-phone", "latency", 2, "browser")]
    with Session() as session, session.begin(), pytest.raises(store.StoreError, match="python or browser"):
        _create_suite(session, settings, Sends(), "bad", [{"kind": "generate", "spec": {}, "engine_host": "wasm"}],
                      build="b1", devices=["agent-phone"], schedule_id=None, idempotency_key=None,
                      max_extra_rounds=None, round_metrics=None)
