"""The network agent over real HTTP on localhost: the token guards every route (401, and nothing
happens), protocol mismatches get 409, bundles upload resumably and install, jobs run (sync
and async), are never run twice, and report busy devices with 503."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from agent import jobs
from agent.protocol import DeviceInfo, JobResult, from_json, to_json
from agent.serve import AgentServer, ServeError, load_token, make_server

TOKEN = "s3cret-token-for-tests"


def fake_info() -> DeviceInfo:
    return DeviceInfo(serial="host-1", model="Test Box", manufacturer="ACME", os="linux", os_version="6.1",
                      adapter={"device": "fake GPU"})


class Client:
    def __init__(self, server: AgentServer):
        self.url = server.url

    def __call__(self, method: str, path: str, body=None, token: str | None = TOKEN, headers=None):
        data = body if isinstance(body, bytes | type(None)) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.fixture
def served(tmp_path):
    """(client, server) of an agent with a fake DeviceInfo source, on a free port."""
    servers = []

    def start(**kw):
        server = make_server(tmp_path / "root", TOKEN, host="127.0.0.1", port=0, quiet=True,
                             info=kw.pop("info", fake_info), **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return Client(server), server

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def job_doc(**kw) -> dict:
    return {"job_id": "h1", "kind": "generate", "model": "models/tiny", "steps": 1, "precision": "fp32",
            "scheduler": "euler"} | kw


def test_refuses_to_start_without_a_token(tmp_path):
    with pytest.raises(ServeError, match="cannot read the token file"):
        load_token(tmp_path / "missing")
    (tmp_path / "t").write_text("\n")
    with pytest.raises(ServeError, match="empty"):
        load_token(tmp_path / "t")
    with pytest.raises(ServeError, match="without a token"):
        make_server(tmp_path, "", host="127.0.0.1", port=0)
    (tmp_path / "t").write_text(f" {TOKEN}\n")
    assert load_token(tmp_path / "t") == TOKEN


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_every_route_needs_the_token(served, tmp_path, token):
    call, server = served()
    root = server.root
    for method, path, body in [
        ("GET", "/v1/info", None),
        ("GET", "/v1/builds", None),
        ("POST", "/v1/jobs", job_doc()),
        ("GET", "/v1/jobs/h1", None),
        ("PUT", "/v1/bundles/b1/files/models/x.bin", b"payload"),
        ("POST", "/v1/bundles/b1/install", b""),
        ("GET", "/v1/nowhere", None),
    ]:
        status, raw = call(method, path, body, token=token)
        assert status == 401, (method, path, raw)
        assert json.loads(raw)["error"] == "missing or wrong bearer token"
    assert not (root / "jobs").exists() and not (root / "incoming").exists()


def test_info_with_the_token(served):
    call, _ = served()
    status, raw = call("GET", "/v1/info")
    assert status == 200
    assert from_json(DeviceInfo, raw) == fake_info()
    assert call("GET", "/v1/nowhere")[0] == 404
    assert call("PUT", "/v1/info", b"x")[0] == 405


def test_protocol_mismatch_is_409(served):
    call, server = served()
    status, raw = call("POST", "/v1/jobs", job_doc(protocol=99))
    assert status == 409 and "speaks protocol 99" in json.loads(raw)["error"]
    status, raw = call("GET", "/v1/info", headers={"X-Farm-Protocol": "2"})
    assert status == 409 and "client speaks protocol 2" in json.loads(raw)["error"]
    status, raw = call("POST", "/v1/jobs", job_doc(kind="train"))
    assert status == 400 and "'train' is not one of" in json.loads(raw)["error"]
    status, raw = call("POST", "/v1/jobs", job_doc(job_id="../escape"))
    assert status == 400 and not (server.root / "escape").exists()


def test_bundle_upload_is_resumable_and_installs(served, tmp_path):
    from agent.bundle import build_bundle, generate_keypair, provision_public_key

    key = generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3000))
    (src / "b.txt").write_text("hello")
    bundle = tmp_path / "bundle"
    manifest = build_bundle({"models/m": src}, bundle, "b1", "0.1", key)
    call, server = served()
    provision_public_key(server.root, tmp_path / "farm.pub")
    manifest_json = json.loads((bundle / "manifest.json").read_text())

    status, raw = call("POST", "/v1/store/missing", manifest_json)
    assert status == 200 and {f["path"] for f in json.loads(raw)["missing"]} == {"models/m/a.bin", "models/m/b.txt"}
    assert call("PUT", "/v1/bundles/b1/manifest.json", (bundle / "manifest.json").read_bytes())[0] == 201
    assert call("PUT", "/v1/bundles/b1/manifest.sig", (bundle / "manifest.sig").read_bytes())[0] == 201
    # an interrupted upload: one file only, then install is refused and nothing is current
    assert call("PUT", "/v1/bundles/b1/files/models/m/a.bin", (bundle / "files/models/m/a.bin").read_bytes())[0] == 201
    status, raw = call("POST", "/v1/bundles/b1/install", b"")
    assert status == 400 and "not in the bundle and not in the device's store" in json.loads(raw)["error"]
    # resume: send the rest, install
    assert call("PUT", "/v1/bundles/b1/files/models/m/b.txt", b"hello")[0] == 201
    status, raw = call("POST", "/v1/bundles/b1/install", b"")
    assert status == 200, raw
    assert json.loads(raw)["build_id"] == "b1" and json.loads(raw)["files"] == len(manifest.files)
    status, raw = call("POST", "/v1/store/missing", manifest_json)
    assert json.loads(raw)["missing"] == []
    assert json.loads(call("GET", "/v1/builds")[1])["current"] == "b1"
    status, raw = call("PUT", "/v1/bundles/b2/files/../../evil", b"x")
    assert status in (400, 404) and not (server.root.parent / "evil").exists()


def test_async_job_and_idempotent_repost(served, tmp_path):
    started = threading.Event()
    release = threading.Event()

    def runner(spec, out_dir, root, progress=None):
        started.set()
        progress({"event": "step", "done": 1, "total": 2})
        release.wait(10)
        out_dir.mkdir(parents=True, exist_ok=True)
        result = JobResult(job_id=spec.job_id, kind=spec.kind, status="succeeded")
        jobs.atomic_write_text(out_dir / "result.json", to_json(result))
        return result

    call, server = served(job_runner=runner)
    status, raw = call("POST", "/v1/jobs", job_doc(job_id="a1"))
    assert status == 202 and json.loads(raw)["location"] == "/v1/jobs/a1"
    assert started.wait(10)
    status, raw = call("GET", "/v1/jobs/a1")
    assert status == 202 and json.loads(raw)["status"] == "running"
    events = json.loads(call("GET", "/v1/jobs/a1/events?since=0")[1])
    assert events["events"] == [{"event": "step", "done": 1, "total": 2}] and events["next"] == 1
    assert call("POST", "/v1/jobs", job_doc(job_id="a1"))[0] == 202  # the same job, not a second one
    release.set()
    for _ in range(100):
        status, raw = call("GET", "/v1/jobs/a1")
        if status == 200:
            break
        time.sleep(0.05)
    assert from_json(JobResult, raw).status == "succeeded"
    started.clear()
    status, raw = call("POST", "/v1/jobs?wait=1", job_doc(job_id="a1"))
    assert status == 200 and from_json(JobResult, raw).job_id == "a1" and not started.is_set()


def test_busy_device_is_503(served):
    call, server = served()
    (server.root / "locks").mkdir(parents=True)
    (server.root / "locks" / jobs.LOCK_NAME).write_text(json.dumps(
        {"job_id": "other", "pid": os.getpid(), "started_at": time.time(), "time_limit_s": 60}))
    status, raw = call("POST", "/v1/jobs?wait=1", job_doc())
    assert status == 503 and "device busy with job 'other'" in json.loads(raw)["error"]


@pytest.mark.gpu
def test_generate_job_round_trip(served, tiny_model_dir):
    call, server = served()
    status, raw = call("POST", "/v1/jobs?wait=1", job_doc(model=str(tiny_model_dir)))
    assert status == 200, raw
    result = from_json(JobResult, raw)
    assert result.status == "succeeded", result.error
    image = next(a for a in result.artifacts if a.kind == "image")
    status, png = call("GET", f"/v1/jobs/h1/artifacts/{image.path}")
    assert status == 200 and hashlib.sha256(png).hexdigest() == image.sha256 and len(png) == image.size
    status, log = call("GET", "/v1/jobs/h1/artifacts/job.log")
    assert status == 200 and b"job h1 (generate)" in log
    assert call("GET", "/v1/jobs/h1/artifacts/../../farm.pub")[0] in (400, 404)
    assert from_json(JobResult, call("GET", "/v1/jobs/h1")[1]) == result
    assert Path(server.root / "jobs" / "h1" / "result.json").is_file()


@pytest.mark.gpu
def test_real_device_info_reads_the_adapter_in_a_child(served):
    call, _ = served(info=None)
    status, raw = call("GET", "/v1/info")
    assert status == 200
    info = from_json(DeviceInfo, raw)
    assert info.adapter.get("device") and "error" not in info.adapter
