"""The farm API under hostile clients (issue 38), on a real uvicorn socket:

- a POST announcing 256 MiB with no token, or an unknown one, got its 401 only after the server
  had read and parsed the whole body (its peak RSS 185 -> 954 MiB for one): it is answered 401
  before a byte of the body is sent;
- nothing capped a body: one above api_max_body_bytes is 413, at once when its Content-Length
  says so, and after no more than the cap when it comes chunked;
- `farm api serve` kept silent and trickling connections open for ever: each must send its
  request head within api_request_deadline_s;
- the dashboard could be framed by another page (on another port of the same host): every
  answer forbids framing (Content-Security-Policy frame-ancestors 'none', X-Frame-Options DENY)
  and allows scripts only from the farm.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from asgi_server import serving

from orchestrator.api import tokens
from orchestrator.api.app import create_app
from orchestrator.infra.settings import Settings
from orchestrator.store import make_engine, make_session_factory, upgrade

MIB = 1 << 20


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-attack")
    settings = Settings(data_dir=tmp / "data", config_dir=tmp / "config", host_name="h")
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    with make_session_factory(engine)() as s, s.begin():
        _, run = tokens.create_token(s, "run", "ci")
    engine.dispose()
    with serving(create_app(settings)) as base:
        yield {"port": int(base.rsplit(":", 1)[1]), "base": base, "token": run, "settings": settings}


def _head(port: int, lines: list[str]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    return sock


def _answer(sock: socket.socket, within_s: float) -> tuple[int, bytes]:
    """The status and the raw answer the server sends within `within_s` (ConnectionError on none)."""
    sock.settimeout(within_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + 10:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        pass
    if not data:
        raise ConnectionError(f"no answer within {within_s} s")
    return int(data.split(b" ", 2)[1]), data


@pytest.mark.parametrize("authorization", [None, "Bearer not-a-token-of-this-farm"])
def test_a_huge_body_without_a_valid_token_is_refused_before_it_is_sent(api, authorization):
    started = time.monotonic()
    with _head(api["port"], ["POST /v1/checks HTTP/1.1", "Host: 127.0.0.1", "Content-Type: text/plain",
                             f"Content-Length: {256 * MIB}",
                             *([f"Authorization: {authorization}"] if authorization else [])]) as sock:
        status, raw = _answer(sock, 5.0)  # not a byte of the body sent
    assert status == 401, raw[:400]
    assert b"www-authenticate: bearer" in raw.lower()
    assert time.monotonic() - started < 5.0


def test_a_body_over_the_cap_is_413_without_being_read(api):
    with _head(api["port"], ["POST /v1/checks HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
                             f"Content-Length: {256 * MIB}", f"Authorization: Bearer {api['token']}"]) as sock:
        status, raw = _answer(sock, 5.0)
    assert status == 413, raw[:400]
    assert b"api_max_body_bytes" in raw


def test_a_chunked_body_is_read_no_further_than_the_cap(api):
    sent = 0
    with _head(api["port"], ["POST /v1/checks HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
                             "Transfer-Encoding: chunked", f"Authorization: Bearer {api['token']}"]) as sock:
        piece = b"x" * (64 << 10)
        try:
            while sent < 8 * MIB:  # far past the 1 MiB cap; the server answers and closes first
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, raw = _answer(sock, 5.0)
    assert status == 413, raw[:400]
    assert sent < 8 * MIB, "the server read 8 MiB of a body capped at 1 MiB"


def test_a_small_body_with_a_token_still_reaches_its_route(api):
    answer = httpx.post(f"{api['base']}/v1/checks", headers={"Authorization": f"Bearer {api['token']}"},
                        json={"candidate": "no-such-build", "devices": ["d1"]}, timeout=10)
    assert answer.status_code in (400, 404, 422), answer.text  # the route's own answer about the body
    assert "detail" in answer.json()


@pytest.mark.parametrize("path", ["/", "/alerts/1", "/static/farm.js", "/v1/me", "/v1/no-such-route", "/docs"])
def test_no_answer_can_be_framed(api, path):
    answer = httpx.get(f"{api['base']}{path}", headers={"Authorization": f"Bearer {api['token']}"}, timeout=10)
    policy = answer.headers.get("content-security-policy", "")
    assert "frame-ancestors 'none'" in policy and answer.headers.get("x-frame-options") == "DENY", answer.headers
    if path != "/docs":
        assert "script-src 'self';" in policy and "unsafe-inline" not in policy, policy


def test_silent_and_trickling_connections_are_closed_by_farm_api_serve(api, tmp_path):
    """`farm api serve` (uvicorn) kept 100 silent and 100 trickling connections open for ever:
    each must now send its request head within api_request_deadline_s (2 s here), and a fresh
    client is served meanwhile."""
    import os
    import subprocess
    import sys
    import threading

    from support import free_port

    port = free_port()
    env = os.environ | {"FARM_DATA_DIR": str(api["settings"].data_dir), "FARM_CONFIG_DIR": str(api["settings"].config_dir),
                        "FARM_API_REQUEST_DEADLINE_S": "2"}
    server = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "api", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {api['token']}"}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{base}/v1/me", headers=auth, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "farm api serve did not start"
            time.sleep(0.2)
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        trickling = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        stop = threading.Event()

        def trickle():
            head = b"GET /v1/me HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
            for byte in head:
                for sock in trickling:
                    try:
                        sock.send(bytes([byte]))
                    except OSError:
                        pass
                if stop.wait(0.25):
                    return

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(1.0)
        assert httpx.get(f"{base}/v1/me", headers=auth, timeout=5).status_code == 200  # others are served
        time.sleep(3.0)
        stop.set()
        for sock in silent + trickling:
            sock.settimeout(2.0)
            try:
                assert sock.recv(1024) == b"", "the server answered a request that never came"
            except ConnectionResetError:
                pass
            except TimeoutError:
                pytest.fail("a connection that sent no whole request head in 4 s is still open")
            finally:
                sock.close()
    finally:
        server.terminate()
        server.wait(10)
