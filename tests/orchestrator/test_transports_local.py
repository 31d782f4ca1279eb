"""The local transport: `farm-agent` as a subprocess on this host with its own root: deploys
(a second one sends nothing, a bundle signed with another key is refused naming the file), a
generate job with artifacts copied out, and a busy device."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time

import pytest

from agent.bundle import build_bundle, generate_keypair, provision_public_key
from agent.protocol import JobSpec
from orchestrator.transports import BundleRefused, DeviceBusy
from orchestrator.transports.local import LocalTransport


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("farm")
    sources = {"models/tiny": tiny_model_dir}
    manifest = build_bundle(sources, tmp / "bundle", "b1", "0.1.0", generate_keypair(tmp / "k", tmp / "farm.pub"))
    build_bundle(sources, tmp / "rogue", "b1", "0.1.0", generate_keypair(tmp / "rk", tmp / "rogue.pub"))
    return {"bundle": tmp / "bundle", "rogue": tmp / "rogue", "pub": tmp / "farm.pub", "manifest": manifest}


@pytest.fixture
def local(tmp_path, farm):
    provision_public_key(tmp_path / "root", farm["pub"])
    return LocalTransport(tmp_path / "root")


def job(job_id: str, **kw) -> JobSpec:
    return JobSpec(**({"job_id": job_id, "kind": "generate", "model": "models/tiny", "precision": "fp32",
                       "steps": 2, "scheduler": "euler", "time_limit_s": 120.0} | kw))


def test_send_bundle_refuses_another_key_then_sends_only_once(local, farm):
    with pytest.raises(BundleRefused, match=r"manifest\.json: manifest signature does not verify"):
        local.send_bundle(farm["rogue"])
    # The refused upload left every file staged whole: the right bundle sends none of them again
    # (install verifies each against its own signed manifest), as the http agent does.
    first = local.send_bundle(farm["bundle"])
    assert first.installed and first.bytes_sent == 0 and first.files_skipped == len(farm["manifest"].files)
    second = local.send_bundle(farm["bundle"])
    assert (second.bytes_sent, second.installed) == (0, False)
    assert not (local.root / "incoming/b1").exists()


@pytest.mark.gpu
def test_generate_job_locally(local, farm, tmp_path):
    local.send_bundle(farm["bundle"])
    events = []
    result = local.run(job("l-e2e"), tmp_path / "out", progress=events.append)
    assert result.status == "succeeded", result.error + result.log_tail
    image = next(a for a in result.artifacts if a.kind == "image")
    assert hashlib.sha256((tmp_path / "out" / image.path).read_bytes()).hexdigest() == image.sha256
    assert [e["event"] for e in events][-1] == "finished"


def test_busy_device(local, tmp_path):
    (local.root / "locks").mkdir()
    (local.root / "locks/device.lock").write_text(json.dumps(
        {"job_id": "other", "pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
         "time_limit_s": 60.0}))
    with pytest.raises(DeviceBusy, match="busy with job 'other'") as err:
        local.run(job("b"), tmp_path / "o")
    assert err.value.state == "busy"


def test_stop_job_kills_the_running_job_and_only_that_one(local):
    from stop_support import check_stop_job

    check_stop_job(local, local.root)


def test_a_result_file_larger_than_any_result_is_not_read(local, monkeypatch):
    from orchestrator.transports import InfraFailure
    from orchestrator.transports import local as local_module

    monkeypatch.setattr(local_module, "MAX_REPLY_BYTES", 2**20)
    spec = job("huge-1")
    result = local.root / "jobs" / spec.job_id / "result.json"
    result.parent.mkdir(parents=True)
    with open(result, "wb") as f:
        f.truncate(2**20 + 1)  # sparse: a size, no memory
    with pytest.raises(InfraFailure, match=r"job huge-1's result.json is over"):
        local.read_job_file(spec, "result.json")
