"""The hub and `farm-agent serve` under hostile clients (issue 27, items 1-3), on real sockets:

- a client that connects to the hub's HTTPS port and sends nothing blocked every other client
  (the TLS handshake ran in the accept thread with no deadline): others are served at once;
- a body with `Content-Length: -1` was read until the client closed, before any token was
  checked (300 MiB with no token: the hub grew 336 MiB): refused with 400; an unauthenticated
  POST announcing 64 MiB is refused before a byte of it is read; JSON bodies of the wrong
  shape ([1], null) and a NUL in a path are 400s, not tracebacks; a Host that is not this
  machine (DNS rebinding) and another site's Origin are refused on the local listener;
- clients trickling a byte at a time held every one of `farm-agent serve`'s slots (its
  timeout was per read): each request now has a deadline, and a fresh client is served.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from agent.serve import AgentServer
from orchestrator.infra import ca
from orchestrator.transports.hub import BrowserHub


@pytest.fixture
def hub(tmp_path):
    folder = tmp_path / "ca"
    ca.init_ca(folder, "devicefarm attack-test CA")
    context = ca.server_ssl_context(folder, ["localhost", "127.0.0.1"])
    hub = BrowserHub("127.0.0.1", 0, https=("127.0.0.1", 0, context), poll_s=1.0)
    client_context = ssl.create_default_context(cafile=str(folder / ca.CA_CERT))
    hub.register("tab-1", "t" * 32, tmp_path / "store")
    try:
        yield hub, client_context
    finally:
        hub.close()


def _raw(port: int, data: bytes, *, read: bool = True, timeout: float = 10.0) -> bytes:
    """Send `data` on a fresh connection; what the server answers (until it closes, or 1 s of
    silence after the first bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if not read:
            return b""
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                sock.settimeout(1.0)
        except TimeoutError:
            pass
        return answer


def test_a_silent_tls_client_does_not_block_the_hubs_https_port(hub):
    hub, client_context = hub
    silent = [socket.create_connection(("127.0.0.1", hub.https_port)) for _ in range(3)]  # no ClientHello
    try:
        time.sleep(0.3)
        for _ in range(3):
            t0 = time.monotonic()
            conn = http.client.HTTPSConnection("localhost", hub.https_port, context=client_context, timeout=5)
            conn.request("GET", "/")
            status = conn.getresponse().status
            conn.close()
            assert status == 200 and time.monotonic() - t0 < 2.0, time.monotonic() - t0
    finally:
        for sock in silent:
            sock.close()


def test_a_negative_or_bad_content_length_is_400_and_no_token_reads_no_body(hub):
    hub, _ = hub
    port = hub.port
    for length in ("-1", "12abc", "1e9", " "):
        answer = _raw(port, f"POST /api/done HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {'t' * 32}\r\n"
                            f"Content-Length: {length}\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 400") and b"not a byte count" in answer, (length, answer[:200])
    # 64 MiB announced, no token: refused at once, the body never read (the connection closes
    # while the client has sent only its headers).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /api/done HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 67108864\r\n\r\n")
        t0 = time.monotonic()
        answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 2.0, answer[:200]
        with pytest.raises(OSError):  # the hub closed the connection: the body goes nowhere
            for _ in range(64):
                sock.sendall(b"\0" * 2**20)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # a key for the farm side, neither
        sock.sendall(b"POST /ctl/tab-1/call HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 67108864\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 403")


@pytest.mark.parametrize("path", ["/api/done", "/ctl/tab-1/call", "/ctl/tab-1/status"])
def test_a_web_page_posting_64_mib_to_the_local_hub_is_refused_before_its_body(hub, path):
    """What any page open in a browser on the farm host can send to 127.0.0.1:8780 without a
    CORS preflight: a "simple" POST (text/plain, no custom header), which carries its Origin.
    Refused on its headers; the 64 MiB never reach the hub."""
    hub, _ = hub
    with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{hub.port}\r\nOrigin: https://evil.example\r\n"
                     "Content-Type: text/plain\r\nContent-Length: 67108864\r\n\r\n".encode())
        t0 = time.monotonic()
        answer = sock.recv(65536)
        assert answer.startswith((b"HTTP/1.1 401", b"HTTP/1.1 403")) and time.monotonic() - t0 < 2.0, answer[:200]
        with pytest.raises(OSError):  # closed: the body goes nowhere
            for _ in range(64):
                sock.sendall(b"\0" * 2**20)


@pytest.mark.parametrize("body", [b"[1]", b"null", b"\"x\"", b"{not json"])
def test_json_of_the_wrong_shape_is_400(hub, body):
    hub, _ = hub
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=5)
    conn.request("POST", "/api/done", body=body, headers={"Authorization": f"Bearer {'t' * 32}"})
    response = conn.getresponse()
    assert response.status == 400 and "JSON object" in json.loads(response.read())["error"]
    conn.request("POST", "/ctl/tab-1/call", body=body, headers={"X-Farm-Hub-Key": hub.key})
    response = conn.getresponse()
    assert response.status == 400 and "a call is" in json.loads(response.read())["error"]
    conn.close()


def test_a_nul_in_a_path_is_an_answer_not_a_traceback(hub, capfd):
    hub, _ = hub
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=5)
    for method, path in (("PUT", "/ctl/tab%00/plans/p%00.json"), ("GET", "/plans/%00"), ("GET", "/blobs/%00"),
                         ("GET", "/web/%00"), ("GET", "/web/farm%00.js"), ("GET", "/%00"),
                         ("POST", "/ctl/%00/status")):
        conn.request(method, path, body=b"{}" if method != "GET" else None,
                     headers={"X-Farm-Hub-Key": hub.key, "Authorization": f"Bearer {'t' * 32}"})
        response = conn.getresponse()
        response.read()
        assert 200 <= response.status < 500, (method, path, response.status)
    conn.close()
    assert "Traceback" not in capfd.readouterr().err


def test_the_local_listener_refuses_other_hosts_and_other_sites(hub):
    hub, _ = hub
    for host, expected in (("evil.example:8780", 421), ("127.0.0.1.evil.example", 421), ("localhost:1", 200),
                           ("127.0.0.1", 200), ("[::1]:8780", 200)):
        answer = _raw(hub.port, f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        assert answer.startswith(f"HTTP/1.1 {expected}".encode()), (host, answer[:120])
    answer = _raw(hub.port, b"POST /ctl/tab-1/status HTTP/1.1\r\nHost: 127.0.0.1:8780\r\nOrigin: https://evil.example"
                            b"\r\nX-Farm-Hub-Key: " + hub.key.encode() + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 403"), answer[:120]
    answer = _raw(hub.port, b"POST /ctl/tab-1/status HTTP/1.1\r\nHost: 127.0.0.1:8780\r\nOrigin: http://127.0.0.1:8780"
                            b"\r\nX-Farm-Hub-Key: " + hub.key.encode() + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:120]


def test_trickling_clients_cannot_hold_every_slot_of_farm_agent_serve(tmp_path: Path):
    (tmp_path / "root").mkdir()
    server = AgentServer(("127.0.0.1", 0), tmp_path / "root", "s" * 32, quiet=True, max_connections=4,
                         idle_timeout_s=5.0, request_deadline_s=1.5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    stop = threading.Event()

    def trickle():  # one byte every 0.5 s: every read well inside the 5 s idle timeout
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                for byte in b"GET /v1/info HTTP/1.1\r\nHost: x\r\n" * 10:
                    if stop.is_set():
                        return
                    sock.sendall(bytes([byte]))
                    time.sleep(0.5)
        except OSError:
            return  # cut off by the request deadline

    trickers = [threading.Thread(target=trickle, daemon=True) for _ in range(8)]
    try:
        for t in trickers:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/v1/builds", headers={"Authorization": f"Bearer {'s' * 32}"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        assert time.monotonic() - t0 < 4.0, f"served after {time.monotonic() - t0:.1f} s"
        conn.close()
    finally:
        stop.set()
        server.shutdown()
        server.server_close()
