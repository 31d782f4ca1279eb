"""The http transport against the real network agent (agent.serve on a free localhost port, in
a thread): info, the token, deploys (a second one sends nothing; a bundle signed with another
key is refused naming the file), a generate job with its artifact fetched byte-identical,
busy devices, protocol mismatches, and agents that are gone or silent."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time

import pytest

from agent.bundle import build_bundle, generate_keypair, provision_public_key
from agent.protocol import DeviceInfo, JobSpec
from agent.serve import make_server
from orchestrator.transports import (
    BundleRefused,
    DeviceBusy,
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    ProtocolMismatch,
)
from orchestrator.transports.http import HttpTransport

TOKEN = "transport-test-token"


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("farm")
    (tmp / "VERSION").write_text("0.1.0\n")
    sources = {"models/tiny": tiny_model_dir, "VERSION": tmp / "VERSION"}
    manifest = build_bundle(sources, tmp / "bundle", "b1", "0.1.0", generate_keypair(tmp / "k", tmp / "farm.pub"))
    build_bundle(sources, tmp / "rogue", "b1", "0.1.0", generate_keypair(tmp / "rk", tmp / "rogue.pub"))
    return {"bundle": tmp / "bundle", "rogue": tmp / "rogue", "pub": tmp / "farm.pub", "manifest": manifest}


def fake_info() -> DeviceInfo:
    return DeviceInfo(serial="mac-1", model="Mac14,6", manufacturer="Apple", os="darwin", os_version="14.5",
                      adapter={"device": "Apple M2 Max"})


@pytest.fixture
def agent(tmp_path, farm):
    """A network agent with the farm key provisioned; GPU work (jobs) is real, info is fake."""
    provision_public_key(tmp_path / "root", farm["pub"])
    server = make_server(tmp_path / "root", TOKEN, host="127.0.0.1", port=0, quiet=True, info=fake_info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def http(agent):
    return HttpTransport(agent.url, TOKEN, poll_s=0.1)


def job(job_id: str, **kw) -> JobSpec:
    return JobSpec(**({"job_id": job_id, "kind": "generate", "model": "models/tiny", "precision": "fp32",
                       "steps": 2, "scheduler": "euler", "time_limit_s": 120.0} | kw))


def test_info_and_the_token(http, agent, tmp_path):
    assert http.info() == fake_info()
    with pytest.raises(DeviceUnauthorized, match="HTTP 401") as err:
        HttpTransport(agent.url, "wrong-token").info()
    assert err.value.state == "unauthorized"
    (tmp_path / "token").write_text(f"{TOKEN}\n")
    assert HttpTransport.from_token_file(agent.url, tmp_path / "token").info().serial == "mac-1"


def test_send_bundle_refuses_another_key_then_sends_only_once(http, agent, farm):
    with pytest.raises(BundleRefused, match=r"manifest\.json: manifest signature does not verify"):
        http.send_bundle(farm["rogue"])
    first = http.send_bundle(farm["bundle"])
    distinct = sum({f.sha256: f.size for f in farm["manifest"].files}.values())
    assert first.installed and first.bytes_sent == distinct
    second = http.send_bundle(farm["bundle"])
    assert (second.bytes_sent, second.files_sent, second.installed) == (0, 0, False)
    assert (agent.root / "builds/current/manifest.json").read_bytes() == (farm["bundle"] / "manifest.json").read_bytes()


@pytest.mark.gpu
def test_generate_job_over_http(http, agent, farm, tmp_path):
    http.send_bundle(farm["bundle"])
    events = []
    t0 = time.monotonic()
    result = http.run(job("h-e2e", seed=5), tmp_path / "out", progress=events.append)
    print(f"generate job over http: {time.monotonic() - t0:.2f} s")
    assert result.status == "succeeded", result.error + result.log_tail
    image = next(a for a in result.artifacts if a.kind == "image")
    local = (tmp_path / "out" / image.path).read_bytes()
    assert hashlib.sha256(local).hexdigest() == image.sha256
    assert local == (agent.root / "jobs/h-e2e" / image.path).read_bytes()
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "finished"


def test_busy_and_protocol_mismatch(http, agent, tmp_path):
    with pytest.raises(ProtocolMismatch, match="HTTP 409.*speaks protocol 99") as err:
        http.run(job("p", protocol=99), tmp_path / "o")
    assert err.value.state == "incompatible"
    (agent.root / "locks").mkdir()
    (agent.root / "locks/device.lock").write_text(json.dumps(
        {"job_id": "other", "pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
         "time_limit_s": 60.0}))
    with pytest.raises(DeviceBusy, match="busy with job 'other'"):
        http.run(job("b"), tmp_path / "o")


def test_agent_gone_or_silent(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DeviceOffline):
        HttpTransport(f"http://127.0.0.1:{port}", TOKEN).info()
    server = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        t0 = time.monotonic()
        with pytest.raises(DeviceTimeout):
            HttpTransport(f"http://127.0.0.1:{server.getsockname()[1]}", TOKEN, timeout_s=1.0).info()
        assert time.monotonic() - t0 < 3
    finally:
        server.close()
