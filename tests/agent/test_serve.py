"""The network agent over real HTTP on localhost: the token guards every route (401, and nothing
happens), protocol mismatches get 409, bundles upload resumably and install, jobs run (sync
and async), are never run twice, and report busy devices with 503. Locked down: HTTPS with a
certificate from a test CA, loopback unless told otherwise, idle connections dropped (a crowd
of silent clients cannot keep a real one out), a token file others can read refused."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tls_support import make_pki

from agent import jobs
from agent.protocol import DeviceInfo, JobResult, from_json, to_json
from agent.serve import AgentServer, ServeError, load_token, make_server, tls_context

TOKEN = "s3cret-token-for-tests"


def fake_info() -> DeviceInfo:
    return DeviceInfo(serial="host-1", model="Test Box", manufacturer="ACME", os="linux", os_version="6.1",
                      adapter={"device": "fake GPU"})


class Client:
    def __init__(self, server: AgentServer, context: ssl.SSLContext | None = None):
        self.url = server.url
        self.context = context

    def __call__(self, method: str, path: str, body=None, token: str | None = TOKEN, headers=None):
        data = body if isinstance(body, bytes | type(None)) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120, context=self.context) as resp:
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
    os.chmod(tmp_path / "t", 0o600)
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
    from agent.bundle import generate_keypair, provision_public_key
    from agent.packing import build_bundle

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


def test_a_file_put_from_an_offset_is_kept_a_verified_chunk_at_a_time(served, tmp_path):
    """/v1/store/missing says how much of a cut upload is held; a PUT ?offset= from there sends
    the rest; an offset past what is held, a chunk not the manifest's, and a signature by
    another key are refused."""
    from agent.bundle import generate_keypair, provision_public_key
    from agent.packing import build_bundle

    key = generate_keypair(tmp_path / "farm.key", tmp_path / "farm.pub")
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(200_000)  # 4 chunks of 64 KiB
    (src / "w.bin").write_bytes(data)
    bundle = tmp_path / "bundle"
    manifest = build_bundle({"m": src}, bundle, "b1", "0.1", key, chunk_size=64 << 10)
    call, server = served()
    provision_public_key(server.root, tmp_path / "farm.pub")
    rogue = generate_keypair(tmp_path / "rogue.key", tmp_path / "rogue.pub")
    assert call("PUT", "/v1/bundles/b1/manifest.json", (bundle / "manifest.json").read_bytes())[0] == 201
    status, raw = call("PUT", "/v1/bundles/b1/manifest.sig", rogue.sign(manifest.canonical_bytes()))
    assert status == 400 and "manifest signature does not verify" in json.loads(raw)["error"]
    assert call("PUT", "/v1/bundles/b1/manifest.sig", (bundle / "manifest.sig").read_bytes())[0] == 201
    # what a cut left: two whole chunks and part of the third
    partial = server.root / "incoming/.resume" / manifest.files[0].sha256
    partial.parent.mkdir(parents=True)
    partial.write_bytes(data[:(2 << 16) + 500])
    status, raw = call("POST", "/v1/store/missing", json.loads((bundle / "manifest.json").read_text()))
    answer = json.loads(raw)
    assert answer["arrived"] == {manifest.files[0].sha256: 2 << 16}
    assert answer["missing_bytes"] == len(data) - (2 << 16)
    assert call("PUT", "/v1/bundles/b1/files/m/w.bin?offset=196608", data[3 << 16:])[0] == 416
    wrong = bytearray(data[2 << 16:])
    wrong[9] ^= 1
    status, raw = call("PUT", "/v1/bundles/b1/files/m/w.bin?offset=131072", bytes(wrong))
    assert status == 400 and "chunk 2" in json.loads(raw)["error"]
    assert partial.stat().st_size == 2 << 16
    assert call("PUT", "/v1/bundles/b1/files/m/w.bin?offset=131072", data[2 << 16:])[0] == 201
    assert (server.root / "incoming/b1/files/m/w.bin").read_bytes() == data and not partial.exists()
    status, raw = call("POST", "/v1/bundles/b1/install", b"")
    assert status == 200, raw


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


# ---- locked down ----------------------------------------------------------------------------


def token_file(folder: Path, mode: int = 0o600) -> Path:
    path = folder / "token"
    path.write_text(TOKEN + "\n")
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620], ids=oct)
def test_a_token_file_open_to_others_is_refused(tmp_path, mode):
    path = token_file(tmp_path, mode)
    with pytest.raises(ServeError) as exc:
        load_token(path)
    assert str(path) in str(exc.value) and f"chmod 600 {path}" in str(exc.value)
    os.chmod(path, 0o600)
    assert load_token(path) == TOKEN


def test_https_with_a_certificate_from_the_farms_ca(served, tmp_path):
    pki = make_pki(tmp_path / "pki")
    _, server = served(tls=tls_context(pki.cert, pki.key))
    assert server.url.startswith("https://127.0.0.1:")
    call = Client(server, ssl.create_default_context(cafile=pki.ca))
    status, raw = call("GET", "/v1/info")
    assert status == 200 and from_json(DeviceInfo, raw) == fake_info()
    # Another CA's client refuses the agent; a plain-HTTP client gets no answer.
    other = make_pki(tmp_path / "other", ca_name="someone else's CA")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        Client(server, ssl.create_default_context(cafile=other.ca))("GET", "/v1/info")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(server.url.replace("https://", "http://") + "/v1/info", timeout=5)


def test_a_bad_certificate_or_key_is_a_clear_error(tmp_path):
    pki = make_pki(tmp_path / "pki")
    with pytest.raises(ServeError, match="no such file"):
        tls_context(tmp_path / "missing.pem", pki.key)
    with pytest.raises(ServeError, match=f"cannot use the certificate {pki.ca}"):
        tls_context(pki.ca, pki.key)  # the CA's certificate is not the one this key belongs to


def test_an_idle_connection_is_closed(served):
    _, server = served(idle_timeout_s=1.0)
    host, port = server.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as idle:
        started = time.monotonic()
        assert idle.recv(1) == b""  # the agent hung up
        assert time.monotonic() - started < 5


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_idle_clients_cannot_keep_a_real_one_out(served, tmp_path, tls):
    pki = make_pki(tmp_path / "pki")
    _, server = served(idle_timeout_s=1.0, max_connections=4, tls=tls_context(pki.cert, pki.key) if tls else None)
    host, port = server.server_address[:2]
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(12)]  # 3x the slots, silent
    try:
        time.sleep(0.2)
        started = time.monotonic()
        status, _ = Client(server, ssl.create_default_context(cafile=pki.ca) if tls else None)("GET", "/v1/info")
        assert status == 200
        assert time.monotonic() - started < 5
    finally:
        for s in idle:
            s.close()


def run_agent_cli(*args: str, timeout: float = 30) -> tuple[subprocess.Popen, str]:
    """`farm-agent serve ARGS` as a real process: (process, its 'serving on' line)."""
    proc = subprocess.Popen([sys.executable, "-c", "from agent.cli import main; main()", "serve", *args],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline and "serving on" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
    return proc, line


def test_the_cli_serves_https_on_loopback_by_default(tmp_path):
    pki = make_pki(tmp_path / "pki")
    proc, line = run_agent_cli("--port", "0", "--token-file", str(token_file(tmp_path)), "--root", str(tmp_path / "root"),
                               "--tls-cert", str(pki.cert), "--tls-key", str(pki.key))
    try:
        assert "serving on https://127.0.0.1:" in line, line
        port = int(line.split("https://127.0.0.1:")[1].split()[0])
        # Another loopback address reaches a 0.0.0.0 listener, not a 127.0.0.1 one.
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
        req = urllib.request.Request(f"https://localhost:{port}/v1/builds", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=10, context=ssl.create_default_context(cafile=pki.ca)) as resp:
            assert json.loads(resp.read()) == {"builds": [], "current": None, "current_damaged": []}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("args, message", [
    (["--tls-cert", "CERT"], "give both --tls-cert and --tls-key"),
    (["--tls-cert", "CERT", "--tls-key", "MISSING"], "cannot read MISSING: no such file"),
])
def test_the_cli_refuses_a_half_tls_setup(tmp_path, args, message):
    pki = make_pki(tmp_path / "pki")
    names = {"CERT": str(pki.cert), "MISSING": str(tmp_path / "missing.key")}
    proc = subprocess.run([sys.executable, "-c", "from agent.cli import main; main()", "serve", "--port", "0",
                           "--token-file", str(token_file(tmp_path)), "--root", str(tmp_path / "root"),
                           *[names.get(a, a) for a in args]], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert message.replace("MISSING", names["MISSING"]) in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_the_cli_refuses_a_token_file_others_can_read(tmp_path):
    path = token_file(tmp_path, 0o644)
    proc = subprocess.run([sys.executable, "-c", "from agent.cli import main; main()", "serve", "--port", "0",
                           "--token-file", str(path), "--root", str(tmp_path / "root")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == f"error: the token file {path} is open to other users (mode 644); fix with `chmod 600 {path}`\n"
