"""The host side of `adb reverse` (orchestrator/transports/adb_reverse.py) against the virtual
phone: large bodies both ways, several connections at once, a target that refuses, the ADB
connection cut mid-response (the client sees an error, never a short body; ensure() brings
the forward back), close(); the same on the transport's own connection (ReverseTunnel.on: the
code path of USB, which cannot be tested here), with the transport's shell, push and pull
running on that connection at the same time, the forward registered again when the transport
reconnects after a cut, and close() leaving the transport connected; and the phone's Chrome:
`am start` through the adb transport's shell opens a page of a host server in a real headless
Chromium, where it runs in a secure context with WebGPU and keeps its Cache Storage between
opens."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ci_support import missing
from net_support import Proxy
from support import wait_until

from agent.simulator import VirtualPhone
from agent.simulator.apps import BrowserSettings
from engine.browser import find_chromium
from orchestrator.transports import DeviceOffline, DeviceUnauthorized, TransportError
from orchestrator.transports.adb import AdbTransport, load_or_create_adb_key
from orchestrator.transports.adb_reverse import ReverseTunnel

BODY = os.urandom(7 * 1024 * 1024 + 11)  # seven ADB payloads and a bit
PHONE_PORT = 8080
CONCURRENT = 6  # what a browser opens to one origin
PAGE = b"""<!doctype html><meta charset="utf-8"><script>
(async () => {
  const r = {gpu: !!navigator.gpu, secure: isSecureContext, origin: location.origin};
  try {
    const cache = await caches.open("farm");
    if (location.search.includes("put")) { await cache.put("/kept", new Response("kept")); r.cached = "put"; }
    else { const hit = await cache.match("/kept"); r.cached = hit ? await hit.text() : null; }
  } catch (e) { r.cached = "error: " + e; }
  await fetch("/result", {method: "POST", body: JSON.stringify(r)});
})();
</script>"""


class _Farm(BaseHTTPRequestHandler):
    """GET /blob: BODY. GET /held: half of BODY, then the rest once `release` is set.
    GET /together: answers once CONCURRENT requests wait at once. GET /page.html: PAGE.
    POST /upload: "sha256 length" of the body. POST /result: the page's report, queued."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        path = self.path.split("?")[0]
        if path == "/held":
            self._head(len(BODY))
            half = len(BODY) // 2
            self.wfile.write(BODY[:half])
            self.wfile.flush()
            self.server.release.wait(10)
            try:
                self.wfile.write(BODY[half:])
            except OSError:
                pass  # the tunnel reset this side when the phone went away
            return
        if path == "/together":
            self.server.together.wait()
            return self._send(b"together")
        return self._send(PAGE if path == "/page.html" else BODY, "text/html" if path == "/page.html" else None)

    def do_POST(self):  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/result":
            self.server.results.put(json.loads(data))
            return self._send(b"")
        self._send(f"{hashlib.sha256(data).hexdigest()} {len(data)}".encode())

    def _head(self, length: int, ctype: str | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.send_header("Content-Type", ctype or "application/octet-stream")
        self.end_headers()

    def _send(self, body: bytes, ctype: str | None = None) -> None:
        self._head(len(body), ctype)
        self.wfile.write(body)


@pytest.fixture
def farm():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Farm)
    server.daemon_threads = True
    server.release = threading.Event()
    server.together = threading.Barrier(CONCURRENT, timeout=15)
    server.results = queue.Queue()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.port = server.server_address[1]
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def key(tmp_path):
    return load_or_create_adb_key(tmp_path / "keys" / "adbkey")


@pytest.fixture
def phone(tmp_path, key):
    browser = BrowserSettings(webgpu_adapter=os.environ.get("FARM_BROWSER_WEBGPU_ADAPTER") or "swiftshader")
    with VirtualPhone(serial="sim-reverse", root=tmp_path / "phone", adb_keys=key.with_name("adbkey.pub"),
                      browser=browser) as p:
        yield p


@pytest.fixture
def adb(phone, key):
    t = AdbTransport("127.0.0.1", phone.port, key_path=key)
    yield t
    t.close()


@pytest.fixture
def tunnel(adb, farm):
    t = ReverseTunnel.over(adb, PHONE_PORT, farm.port).open()
    yield t
    t.close()


@pytest.fixture
def shared(adb, farm):
    """A tunnel on the transport's own connection (what a USB phone gets)."""
    t = ReverseTunnel.on(adb, PHONE_PORT, farm.port).open()
    yield t
    t.close()


@pytest.fixture(params=["own", "shared"])
def either(request, adb, farm):
    make = ReverseTunnel.over if request.param == "own" else ReverseTunnel.on
    t = make(adb, PHONE_PORT, farm.port).open()
    yield t
    t.close()


def get(port: int, path: str = "/blob", timeout: float = 20) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return r.read()


def post(port: int, body: bytes, timeout: float = 20) -> str:
    """What /upload says of `body`: "sha256 length"."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/upload", data=body)
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return r.read().decode()


def held_half(port: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A GET of /held with its first half read: a relayed connection with the rest to come."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    conn.request("GET", "/held")
    response = conn.getresponse()
    assert response.length == len(BODY)
    assert response.read(len(BODY) // 2) == BODY[:len(BODY) // 2]
    return conn, response


def sha_line(data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}"


def page_report(farm, phone, timeout_s: float = 25.0) -> dict:
    """What the page posted back; on a timeout, the failure shows the end of Chromium's log."""
    try:
        return farm.results.get(timeout=timeout_s)
    except queue.Empty:
        log = phone.root / "apps/com.android.chrome/chromium.log"
        tail = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
        pytest.fail(f"the page reported nothing within {timeout_s:g} s; chromium.log ends:\n{tail}")


# ---- the tunnel -----------------------------------------------------------------------------------


def test_large_bodies_cross_both_ways_byte_for_byte(tunnel, phone, farm):
    assert [x.split()[1:] for x in tunnel.forwards()] == [[f"tcp:{PHONE_PORT}", f"tcp:{farm.port}"]]
    q = phone.host_port(PHONE_PORT)
    t0 = time.monotonic()
    assert get(q) == BODY  # the phone's app downloads from the farm
    upload = os.urandom(6 * 1024 * 1024 + 5)
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{q}/upload", data=upload), timeout=20) as r:
        assert r.read().decode() == f"{hashlib.sha256(upload).hexdigest()} {len(upload)}"
    print(f"{len(BODY) + len(upload)} bytes through the tunnel in {time.monotonic() - t0:.2f} s")
    assert tunnel.connections_relayed == 2 and wait_until(lambda: tunnel.open_streams == 0)


def test_six_connections_at_once(either, phone):
    tunnel = either  # on a connection of its own, and on the transport's
    q = phone.host_port(PHONE_PORT)
    with ThreadPoolExecutor(CONCURRENT) as pool:
        together = list(pool.map(lambda _: get(q, "/together"), range(CONCURRENT)))  # all in flight at once
        bodies = list(pool.map(lambda i: get(q, f"/blob?{i}"), range(CONCURRENT)))
    assert together == [b"together"] * CONCURRENT and all(b == BODY for b in bodies)
    assert tunnel.connections_relayed == 2 * CONCURRENT and wait_until(lambda: tunnel.open_streams == 0)


def test_a_refused_target_closes_the_phones_connection(adb, phone):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: refused
        with ReverseTunnel.over(adb, PHONE_PORT, dead) as t:
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                get(phone.host_port(PHONE_PORT))
            assert t.alive and t.open_streams == 0
            t.ensure()  # still registered on the same connection
            assert t.drops == 0


def test_a_cut_connection_is_an_error_then_ensure_brings_the_forward_back(phone, farm, key):
    proxy = Proxy(phone.port)  # the cable between host and phone
    try:
        cut = AdbTransport("127.0.0.1", proxy.port, key_path=key)
        with ReverseTunnel.over(cut, PHONE_PORT, farm.port) as t:
            q = phone.host_port(PHONE_PORT)
            conn = http.client.HTTPConnection("127.0.0.1", q, timeout=20)
            conn.request("GET", "/held")
            response = conn.getresponse()
            assert response.length == len(BODY)
            assert response.read(len(BODY) // 2) == BODY[:len(BODY) // 2]
            proxy.close_connections()  # pulled mid-response
            farm.release.set()
            with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                response.read()  # never a short body passed off as whole
            conn.close()
            assert t.wait_lost(5) and not t.alive and t.drops == 1

            t.ensure()  # connects again, registers again: the page's retry goes through
            assert t.alive and phone.forwards() == {PHONE_PORT: f"tcp:{farm.port}"}
            assert phone.host_port(PHONE_PORT) == q and get(q) == BODY
            t.ensure()  # and when all is well, one round trip and nothing else
            assert t.drops == 1
    finally:
        proxy.close()


def test_port_zero_lets_the_phone_choose_and_keeps_its_choice(adb, phone, farm):
    with ReverseTunnel.over(adb, 0, farm.port) as t:
        chosen = t.device_port
        assert chosen and phone.forwards() == {chosen: f"tcp:{farm.port}"}
        assert get(phone.host_port(chosen)) == BODY
        t.ensure()
        assert t.device_port == chosen


def test_connection_errors_name_the_device_state(tmp_path, key, farm):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = AdbTransport("127.0.0.1", s.getsockname()[1], key_path=key, timeout_s=2)
        with pytest.raises(DeviceOffline):
            ReverseTunnel.over(nobody, PHONE_PORT, farm.port).open()
    with VirtualPhone(serial="stranger", root=tmp_path / "stranger") as p:  # our key is not on it
        stranger = AdbTransport("127.0.0.1", p.port, key_path=key, timeout_s=2, auth_timeout_s=1)
        with pytest.raises(DeviceUnauthorized, match="Allow"):
            ReverseTunnel.over(stranger, PHONE_PORT, farm.port).open()


def test_close_removes_the_forward(tunnel, phone):
    q = phone.host_port(PHONE_PORT)
    assert get(q) == BODY
    tunnel.close()
    assert phone.forwards() == {} and not tunnel.alive
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", q), timeout=2)
    with pytest.raises(TransportError, match="closed"):
        tunnel.ensure()


# ---- on the transport's own connection --------------------------------------------------------------


def test_shared_bodies_cross_byte_for_byte_while_the_transport_runs_commands(shared, adb, phone, farm):
    """Downloads (one held half-way throughout), an upload and a job's shell stream on the one
    connection while shell commands, a push, a pull and a failed pull run on it too."""
    device = adb.connection()
    q = phone.host_port(PHONE_PORT)
    blob, upload = os.urandom(3 * 1024 * 1024 + 7), os.urandom(6 * 1024 * 1024 + 5)
    commands_done = threading.Event()
    job_lines: list[str] = []

    def downloads() -> list[bool]:
        whole = []
        while not commands_done.is_set() or not whole:  # bytes flow for as long as the commands run
            whole.append(get(q) == BODY)
        return whole

    def job() -> tuple[str, str, int]:  # a job's `farm-agent run`: stderr lines live, open for a while
        return adb.shell("cat /absent-progress; sleep 1; echo slept", on_stderr_line=job_lines.append)

    t0 = time.monotonic()
    conn, held = held_half(q)
    with ThreadPoolExecutor(3) as pool:
        flowing, uploaded, running = pool.submit(downloads), pool.submit(post, q, upload), pool.submit(job)
        try:
            echoes = [adb.shell(f"echo {i}") for i in range(10)]
            adb.push(blob, "/data/local/tmp/shared.bin")
            pulled = adb.pull("/data/local/tmp/shared.bin")
            digest = adb.shell("sha256sum /data/local/tmp/shared.bin")[0].split()[:1]
            with pytest.raises(FileNotFoundError):
                adb.pull("/data/local/tmp/absent.bin")
            assert not flowing.done()  # the commands ran while bytes were crossing
        finally:
            commands_done.set()
            farm.release.set()
        rest = held.read()
        whole, answer, job_result = flowing.result(30), uploaded.result(30), running.result(30)
    conn.close()
    print(f"{len(whole)} downloads, an upload and a held GET beside the commands in {time.monotonic() - t0:.2f} s")

    assert echoes == [(f"{i}\n", "", 0) for i in range(10)]
    assert pulled == blob and digest == [hashlib.sha256(blob).hexdigest()]
    assert job_result[::2] == ("slept\n", 0) and job_lines and "absent-progress" in job_lines[0]
    assert BODY[:len(BODY) // 2] + rest == BODY and all(whole) and answer == sha_line(upload)
    assert adb.connection() is device and shared.drops == 0  # one connection, never lost
    assert shared.connections_relayed == len(whole) + 2 and wait_until(lambda: shared.open_streams == 0)


def test_a_cut_shared_connection_is_an_error_then_the_next_connection_has_the_forward(phone, farm, key):
    proxy = Proxy(phone.port)  # the cable between host and phone
    cut = AdbTransport("127.0.0.1", proxy.port, key_path=key)
    try:
        with ReverseTunnel.on(cut, PHONE_PORT, farm.port) as t:
            first = cut.connection()
            q = phone.host_port(PHONE_PORT)
            conn, response = held_half(q)
            started = threading.Event()
            with ThreadPoolExecutor(1) as pool:  # a command in flight on the same connection
                job = pool.submit(cut.shell, "cat /absent; sleep 10; echo never",
                                  on_stderr_line=lambda _: started.set())
                assert started.wait(5)
                proxy.close_connections()  # pulled mid-response
                farm.release.set()
                with pytest.raises((http.client.IncompleteRead, ConnectionError)):
                    response.read()  # never a short body passed off as whole
                with pytest.raises(DeviceOffline):
                    job.result(timeout=5)  # nor a partial result for the command
            conn.close()
            assert t.wait_lost(5) and not t.alive and t.drops == 1

            # the transport's next command connects again; the tunnel registers there first
            assert cut.shell("echo back") == ("back\n", "", 0)
            assert cut.connection() is not first and t.alive
            assert phone.forwards() == {PHONE_PORT: f"tcp:{farm.port}"}
            assert phone.host_port(PHONE_PORT) == q and get(q) == BODY
            t.ensure()  # all is well: one round trip and nothing else
            assert t.drops == 1 and cut.connection() is not first
    finally:
        proxy.close()
        cut.close()


def test_close_on_a_shared_connection_removes_the_forward_and_leaves_the_transport(shared, adb, phone):
    device = adb.connection()
    q = phone.host_port(PHONE_PORT)
    assert get(q) == BODY
    conn, response = held_half(q)
    shared.close()  # with a relayed connection half-way
    assert phone.forwards() == {} and not shared.alive and shared.open_streams == 0
    with pytest.raises((http.client.IncompleteRead, ConnectionError)):
        response.read()  # ended, never passed off as whole
    conn.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", q), timeout=2)
    assert adb.shell("echo still here") == ("still here\n", "", 0) and adb.connection() is device
    with pytest.raises(TransportError, match="closed"):
        shared.ensure()
    adb.close()  # a closed tunnel no longer follows the transport to its next connection
    assert adb.shell("true")[2] == 0 and adb.connection() is not device and phone.forwards() == {}


def test_the_default_shares_over_usb_and_keeps_a_connection_of_its_own_over_tcp(key):
    tcp = AdbTransport("127.0.0.1", 5999, key_path=key, timeout_s=3)
    own = ReverseTunnel.for_transport(tcp, PHONE_PORT, 8000)
    assert own.own_connection and own.adb is not tcp and (own.adb.host, own.adb.port) == ("127.0.0.1", 5999)
    assert own.timeout_s == 3
    usb = AdbTransport(None, key_path=key)
    on_usb = ReverseTunnel.for_transport(usb, PHONE_PORT, 8000)
    assert not on_usb.own_connection and on_usb.adb is usb
    with pytest.raises(TransportError, match="ReverseTunnel.on"):
        ReverseTunnel.over(usb, PHONE_PORT, 8000)


# ---- the phone's Chrome ----------------------------------------------------------------------------


def test_am_start_opens_the_farms_page_in_chromium(tunnel, adb, phone, farm):
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    url = f"http://localhost:{PHONE_PORT}/page.html"
    out, err, code = adb.shell(f"am start -a android.intent.action.VIEW -d {url}?put com.android.chrome")
    assert (out, err, code) == (f"Starting: Intent {{ act=android.intent.action.VIEW dat=http://localhost:"
                                f"{PHONE_PORT}/... pkg=com.android.chrome }}\n", "", 0)
    first = page_report(farm, phone)
    q = phone.host_port(PHONE_PORT)
    assert first == {"gpu": True, "secure": True, "origin": f"http://localhost:{q}", "cached": "put"}
    assert phone.browser_running()

    # a second start replaces the page; the profile (and its Cache Storage) stays, as on a phone
    out, err, code = adb.shell(f"am start -n com.android.chrome/com.google.android.apps.chrome.Main -d {url}")
    assert code == 0 and err == ""
    second = page_report(farm, phone)
    assert second["cached"] == "kept" and second["origin"] == first["origin"]
    assert (phone.root / "apps/com.android.chrome/chromium.log").stat().st_size > 0

    phone.kill_browser()  # a killed tab
    assert not phone.browser_running()
    assert adb.shell(f"am start -a android.intent.action.VIEW -d {url} com.android.chrome")[2] == 0
    assert page_report(farm, phone)["cached"] == "kept"
    assert adb.shell("am force-stop com.android.chrome") == ("", "", 0)
    assert not phone.browser_running()

    out, err, code = adb.shell(f"am start -a android.intent.action.VIEW -d {url} com.example.absent")
    assert code == 0 and err.startswith("Error: Activity not started, unable to resolve Intent {")
    assert not phone.browser_running()
