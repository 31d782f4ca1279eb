"""The http transport against the real network agent (agent.serve on a free localhost port, in
a thread): info, the token, deploys (a second one sends nothing; a bundle signed with another
key is refused naming the file before any file is sent; a cut inside a file resumed from its
last whole chunk), a generate job with its artifact fetched byte-identical,
busy devices, protocol mismatches, and agents that are gone or silent. HTTPS agents are
verified against the given CA (or the one beside the token), and a redirect to another origin
(a real server on 127.0.0.2 that records what it receives) never gets the token."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from net_support import PartialWatcher, Proxy, without_chunks
from tls_support import make_pki

from agent.bundle import generate_keypair, provision_public_key
from agent.packing import build_bundle
from agent.protocol import DeviceInfo, JobSpec, Manifest, from_json
from agent.serve import make_server, tls_context
from orchestrator.transports import (
    BundleRefused,
    DeviceBusy,
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    InfraFailure,
    ProtocolMismatch,
    TransportError,
)
from orchestrator.transports.http import HttpTransport

TOKEN = "transport-test-token"
CHUNK = 64 << 10  # the chunked build's chunks: the tiny model's weights have 3, 69 and 16 of them


@pytest.fixture(scope="module")
def farm(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("farm")
    (tmp / "VERSION").write_text("0.1.0\n")
    sources = {"models/tiny": tiny_model_dir, "VERSION": tmp / "VERSION"}
    key = generate_keypair(tmp / "k", tmp / "farm.pub")
    manifest = build_bundle(sources, tmp / "bundle", "b1", "0.1.0", key)
    build_bundle(sources, tmp / "rogue", "b1", "0.1.0", generate_keypair(tmp / "rk", tmp / "rogue.pub"))
    chunked = build_bundle(sources, tmp / "chunked", "b2", "0.1.0", key, chunk_size=CHUNK)
    return {"bundle": tmp / "bundle", "rogue": tmp / "rogue", "pub": tmp / "farm.pub", "manifest": manifest,
            "chunked": tmp / "chunked", "chunked_manifest": chunked,
            "unchunked": without_chunks(tmp / "bundle", tmp / "unchunked", tmp / "k")}


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
    # Refused as its signature was staged, before any file was sent (files are checked against it)
    refused = agent.root / "incoming/b1/files"
    assert not [p for p in refused.rglob("*") if p.is_file()] and not (agent.root / "incoming/b1/manifest.sig").exists()
    distinct = sum({f.sha256: f.size for f in farm["manifest"].files}.values())
    first = http.send_bundle(farm["bundle"])
    assert first.installed and first.bytes_sent == distinct and first.files_skipped == 0
    second = http.send_bundle(farm["bundle"])
    assert (second.bytes_sent, second.files_sent, second.installed) == (0, 0, False)
    assert (agent.root / "builds/current/manifest.json").read_bytes() == (farm["bundle"] / "manifest.json").read_bytes()


def test_a_blob_damaged_on_the_agent_is_sent_again_and_the_build_repaired(http, agent, farm):
    manifest = from_json(Manifest, (farm["bundle"] / "manifest.json").read_text())
    http.send_bundle(farm["bundle"])
    biggest = max(manifest.files, key=lambda f: f.size)
    blob = agent.root / "store" / biggest.sha256[:2] / biggest.sha256
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(blob, "r+b") as f:  # in place, the size kept
        f.write(bytes(data))
    again = http.send_bundle(farm["bundle"])  # by size, nothing was sent and the build stayed damaged
    assert (again.installed, again.files_sent, again.bytes_sent) == (True, 1, biggest.size)
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == biggest.sha256
    assert http.send_bundle(farm["bundle"]).files_sent == 0


def test_a_build_without_chunk_hashes_cut_resumes_a_whole_file_at_a_time(agent, farm):
    """A connection cut halfway through a deploy of a build signed before manifests listed chunk
    hashes: no half-sent file lies at a final path, and the next deploy sends exactly the files
    that had not arrived whole."""
    manifest = farm["manifest"]
    total = sum({f.sha256: f.size for f in manifest.files}.values())
    proxy = Proxy(int(agent.url.rsplit(":", 1)[1]), cut_after=total // 2)
    try:
        with PartialWatcher(agent.root, manifest) as seen_partial:
            with pytest.raises(DeviceOffline):
                HttpTransport(f"http://127.0.0.1:{proxy.port}", TOKEN).send_bundle(farm["unchunked"])
            staged = sum(p.stat().st_size for p in (agent.root / "incoming/b1/files").rglob("*") if p.is_file())
            assert 0 < staged < total, (staged, total)
            assert not (agent.root / "builds").exists()
            report = HttpTransport(agent.url, TOKEN).send_bundle(farm["unchunked"])
    finally:
        proxy.close()
    assert report.installed and report.bytes_sent == total - staged, (report, staged, total)
    assert not seen_partial, seen_partial[:3]
    assert not list((agent.root / "incoming").glob(".tmp-*")), "a half-received upload was left behind"
    assert (agent.root / "builds/current/manifest.json").read_bytes() == (farm["unchunked"] / "manifest.json").read_bytes()


def wire_bytes(bundle, port: int, cut_after: int | None = None) -> tuple[int, object]:
    """Bytes sent towards the agent for one deploy of `bundle` (through a proxy that cuts after
    `cut_after` of them), and its SendReport or the error it ended with."""
    proxy = Proxy(port, cut_after=cut_after)
    try:
        try:
            outcome = HttpTransport(f"http://127.0.0.1:{proxy.port}", TOKEN).send_bundle(bundle)
        except DeviceOffline as exc:
            outcome = exc
    finally:
        proxy.close()
    return proxy.forwarded, outcome


def serving(root, pub):
    provision_public_key(root, pub)
    server = make_server(root, TOKEN, host="127.0.0.1", port=0, quiet=True, info=fake_info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.95])
def test_a_deploy_cut_inside_a_file_resumes_from_its_last_whole_chunk(tmp_path, farm, fraction):
    """A build whose manifest lists 64 KiB chunks, cut at 2 %, 50 % and 95 % of its bytes: on
    the wire, the cut deploy and the resumed one together send at most one chunk more than one
    uncut deploy does (plus one more deploy's start: the signed manifest again, the question
    of what is there); the resumed deploy's bytes_sent is what it sent; nothing half-written is
    ever at a final path; the build installs and verifies."""
    manifest, bundle = farm["chunked_manifest"], farm["chunked"]
    total = sum({f.sha256: f.size for f in manifest.files}.values())
    start = 2 * len((bundle / "manifest.json").read_bytes()) + (4 << 10)  # PUT, then POSTed to /missing
    servers = [serving(tmp_path / "clean", farm["pub"]), serving(tmp_path / "root", farm["pub"])]
    try:
        uncut, report = wire_bytes(bundle, servers[0].server_address[1])
        assert report.installed and report.bytes_sent == total
        root, port = servers[1].root, servers[1].server_address[1]
        with PartialWatcher(root, manifest) as seen_partial:
            before, error = wire_bytes(bundle, port, cut_after=int(total * fraction))
            assert isinstance(error, DeviceOffline) and not (root / "builds").exists()
            after, report = wire_bytes(bundle, port)
        intact = HttpTransport(servers[1].url, TOKEN).installed_manifest_is(b"", manifest)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert report.installed and intact and not seen_partial, (report, seen_partial[:3])
    assert before + after - uncut <= CHUNK + start, (before, after, uncut)
    assert after - report.bytes_sent <= uncut - total + start, (after, report)  # bytes_sent is not understated
    assert not list((root / "incoming/.resume").iterdir()), "a partial upload was left behind"
    assert not list((root / "incoming").glob(".tmp-*")), "a half-received upload was left behind"


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


# ---- TLS and redirects ------------------------------------------------------------------------


@pytest.fixture
def tls_agent(tmp_path, farm):
    """The network agent over HTTPS with a certificate from a throwaway CA."""
    pki = make_pki(tmp_path / "pki")
    provision_public_key(tmp_path / "root", farm["pub"])
    server = make_server(tmp_path / "root", TOKEN, host="127.0.0.1", port=0, quiet=True, info=fake_info,
                         tls=tls_context(pki.cert, pki.key))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, pki
    server.shutdown()
    server.server_close()


def test_https_agent_verified_against_the_given_ca(tls_agent, farm, tmp_path):
    agent, pki = tls_agent
    https = HttpTransport(agent.url, TOKEN, ca_file=pki.ca)
    assert https.info() == fake_info()
    assert https.send_bundle(farm["bundle"]).installed
    # The CA is found beside the token, as <config_dir>/tokens/<serial>.ca.pem.
    tokens = tmp_path / "config" / "tokens"
    tokens.mkdir(parents=True)
    (tokens / "mac-1").write_text(TOKEN)
    with pytest.raises(TransportError, match=r"does not verify against the system's trusted CAs .*"
                                             rf"put the PEM certificate .* in {tokens / 'mac-1.ca.pem'}"):
        HttpTransport.from_token_file(agent.url, tokens / "mac-1", name="mac-1").info()
    (tokens / "mac-1.ca.pem").write_bytes(pki.ca.read_bytes())
    assert HttpTransport.from_token_file(agent.url, tokens / "mac-1", name="mac-1").info().serial == "mac-1"


def test_https_agent_with_another_cas_certificate_is_refused(tls_agent, tmp_path):
    agent, _ = tls_agent
    other = make_pki(tmp_path / "other", ca_name="someone else's CA")
    with pytest.raises(TransportError, match=rf"does not verify against the CA in {other.ca}"):
        HttpTransport(agent.url, TOKEN, ca_file=other.ca).info()


def test_a_ca_file_needs_an_https_url_and_a_certificate(tmp_path):
    pki = make_pki(tmp_path / "pki")
    with pytest.raises(TransportError, match="is not https; serve the agent with --tls-cert"):
        HttpTransport("http://127.0.0.1:8765", TOKEN, ca_file=pki.ca)
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(TransportError, match=f"cannot load the CA file {tmp_path / 'junk.pem'}"):
        HttpTransport("https://127.0.0.1:8765", TOKEN, ca_file=tmp_path / "junk.pem")


class _Recorder(BaseHTTPRequestHandler):
    """Any request: its headers are kept on the server, the answer is 200 {}."""

    def do_GET(self):  # noqa: N802  (the base class's naming)
        self.server.seen.append(dict(self.headers))
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"{}\n")

    do_POST = do_PUT = do_GET

    def log_message(self, *args):
        pass


def _serve(handler, host: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, 0), handler)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("method, code", [("GET", 302), ("GET", 301), ("GET", 307), ("GET", 308), ("POST", 303),
                                          ("POST", 302)])
def test_a_redirect_to_another_origin_never_gets_the_token(method, code):
    elsewhere = _serve(_Recorder, "127.0.0.2")  # another origin: Linux answers all of 127/8 on loopback
    target = f"http://127.0.0.2:{elsewhere.server_address[1]}/v1/info"

    class Redirector(_Recorder):
        def do_GET(self):  # noqa: N802
            self.server.seen.append(dict(self.headers))
            if self.headers.get("Content-Length"):
                self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(code)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_PUT = do_GET

    origin = _serve(Redirector, "127.0.0.1")
    try:
        transport = HttpTransport(f"http://127.0.0.1:{origin.server_address[1]}", TOKEN)
        try:
            transport._request(method, "/v1/info", b"{}" if method == "POST" else None)
        except TransportError as exc:
            refused = str(exc)
        else:
            refused = "the redirect was followed"
        assert origin.seen and origin.seen[0]["Authorization"] == f"Bearer {TOKEN}"
        leaked = [h.get("Authorization") for h in elsewhere.seen]
        assert not any(leaked), f"the other origin received Authorization: {leaked}"
        assert elsewhere.seen == [], f"the other origin was asked, with headers {elsewhere.seen}"
        assert f"redirected (HTTP {code}) to another origin, {target}; not followed" in refused, refused
    finally:
        for server in (origin, elsewhere):
            server.shutdown()
            server.server_close()


def test_a_redirect_within_the_agents_origin_is_followed():
    class Moved(_Recorder):
        def do_GET(self):  # noqa: N802
            if self.path == "/v1/info":
                self.send_response(302)
                self.send_header("Location", "/v1/info2")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            super().do_GET()

    server = _serve(Moved, "127.0.0.1")
    try:
        status, raw = HttpTransport(f"http://127.0.0.1:{server.server_address[1]}", TOKEN)._request("GET", "/v1/info")
        assert (status, raw) == (200, b"{}\n")
    finally:
        server.shutdown()
        server.server_close()


def test_stop_job_kills_the_running_job_and_only_that_one(http, agent):
    from stop_support import check_stop_job

    check_stop_job(http, agent.root)


def test_an_answer_larger_than_any_result_is_refused_not_read_whole(monkeypatch):
    """A hostile or broken agent answering without end: the transport stops past the cap (lowered
    here to 1 MiB, 64 MiB in the farm) instead of holding all of it."""
    import orchestrator.transports.http as http_module
    from orchestrator.transports import base

    monkeypatch.setattr(http_module, "MAX_REPLY_BYTES", 2**20)
    monkeypatch.setattr(base, "MAX_REPLY_BYTES", 2**20)
    sent = []

    class Flood(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            try:
                for _ in range(64):  # 64 MiB if read to the end
                    self.wfile.write(b" " * 2**20)
                    sent.append(1)
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = _serve(Flood, "127.0.0.1")
    try:
        with pytest.raises(InfraFailure, match=r"the answer to GET /v1/info is over 1 MiB"):
            HttpTransport(f"http://127.0.0.1:{server.server_address[1]}", TOKEN).info()
    finally:
        server.shutdown()
        server.server_close()
    assert len(sent) < 64
