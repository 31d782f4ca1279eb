"""The local transport: `farm-agent` as a subprocess on this host with its own root: deploys
(a second one sends nothing, a bundle signed with another key is refused naming the file, one
stopped inside a file resumed from its last whole chunk), a
generate job with artifacts copied out, and a busy device."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import time

import pytest

from agent.bundle import generate_keypair, provision_public_key
from agent.packing import build_bundle
from agent.protocol import JobSpec
from orchestrator.transports import BundleRefused, DeviceBusy
from orchestrator.transports.local import LocalTransport

CHUNK = 64 << 10  # the chunked build's chunks: the tiny model's weights have 3, 69 and 16 of them


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("farm")
    sources = {"models/tiny": tiny_model_dir}
    key = generate_keypair(tmp / "k", tmp / "farm.pub")
    manifest = build_bundle(sources, tmp / "bundle", "b1", "0.1.0", key)
    build_bundle(sources, tmp / "rogue", "b1", "0.1.0", generate_keypair(tmp / "rk", tmp / "rogue.pub"))
    chunked = build_bundle(sources, tmp / "chunked", "b2", "0.1.0", key, chunk_size=CHUNK)
    return {"bundle": tmp / "bundle", "rogue": tmp / "rogue", "pub": tmp / "farm.pub", "manifest": manifest,
            "chunked": tmp / "chunked", "chunked_manifest": chunked}


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
    # Refused as its signature was staged, before any file was sent, as the http agent does
    assert not [p for p in (local.root / "incoming/b1/files").rglob("*") if p.is_file()]
    first = local.send_bundle(farm["bundle"])
    distinct = sum({f.sha256: f.size for f in farm["manifest"].files}.values())
    assert first.installed and first.bytes_sent == distinct and first.files_skipped == 0
    second = local.send_bundle(farm["bundle"])
    assert (second.bytes_sent, second.installed) == (0, False)
    assert not (local.root / "incoming/b1").exists()


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.95])
def test_a_deploy_killed_inside_a_file_resumes_from_its_last_whole_chunk(local, farm, fraction):
    """A deploy of a build with 64 KiB chunks in a process stopped mid-write (RLIMIT_FSIZE: no
    file it writes may pass `fraction` of the largest file's size, so it fails inside that
    file with part of a chunk written): the next deploy sends at most one chunk more than had
    arrived, drops what is torn, never puts a partial file at a final path, and installs intact."""
    from net_support import PartialWatcher

    manifest, bundle = farm["chunked_manifest"], farm["chunked"]
    total = sum({f.sha256: f.size for f in manifest.files}.values())
    limit = int(max(f.size for f in manifest.files) * fraction)
    code = ("import sys; from pathlib import Path; from orchestrator.transports.local import LocalTransport; "
            "LocalTransport(Path(sys.argv[1])).send_bundle(Path(sys.argv[2]))")
    with PartialWatcher(local.root, manifest) as seen_partial:
        killed = subprocess.run([sys.executable, "-c", code, str(local.root), str(bundle)], capture_output=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
        assert killed.returncode and b"File too large" in killed.stderr, killed.stderr.decode()[-2000:]
        arrived = sum(p.stat().st_size for p in (local.root / "incoming").rglob("*")
                      if p.is_file() and p.name not in ("manifest.json", "manifest.sig"))
        report = local.send_bundle(bundle)
    assert report.installed and not seen_partial, (report, seen_partial[:3])
    assert 0 < arrived < total and arrived + report.bytes_sent - total <= CHUNK, (arrived, report)
    assert local.installed_manifest_is((bundle / "manifest.json").read_bytes(), manifest)
    assert not list((local.root / "incoming/.resume").iterdir())


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
