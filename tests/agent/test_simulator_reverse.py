"""The virtual phone's side of `adb reverse` and its app commands: Google's adb (a real protocol
peer) registers, lists and removes forwards, and a connection to the host port standing for
the phone's port reaches a host HTTP server byte for byte; adbd's replies on the wire (adb-shell
as the client); the phone-URL rewriting; `am`, `pm`, `svc` and `input` where they need no
browser. Google's adb runs with its own HOME and server port and is killed at the end; device
ports stay off 5555-5585."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from adb_shell.adb_device import AdbDevice
from adb_shell.transport.tcp_transport import TcpTransport
from support import free_port, wait_until

from agent.simulator import VirtualPhone

BODY = os.urandom(5 * 1024 * 1024 + 123)  # several ADB payloads (1 MiB max) per response
PHONE_PORT = 8080


class _Farm(BaseHTTPRequestHandler):
    """GET: BODY; POST: the sha256 and length of what arrived."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        self._send(BODY)

    def do_POST(self):  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        self._send(f"{hashlib.sha256(data).hexdigest()} {len(data)}".encode())

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def farm():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Farm)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def phone(tmp_path):
    with VirtualPhone(serial="sim-reverse", root=tmp_path / "phone", auth=False) as p:
        yield p


@pytest.fixture
def google_adb(tmp_path):
    exe = shutil.which("adb")
    if exe is None:
        pytest.fail("Google's adb is not installed (Debian/Ubuntu: apt-get install adb)")
    env = {**os.environ, "HOME": str(tmp_path / "adb-home"), "ANDROID_ADB_SERVER_PORT": str(free_port())}
    env.pop("ADB_VENDOR_KEYS", None)
    (tmp_path / "adb-home").mkdir()

    def adb(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=20,
                              stdin=subprocess.DEVNULL)
        if check and done.returncode != 0:
            raise AssertionError(f"adb {' '.join(args)} -> {done.returncode}: {done.stdout}{done.stderr}")
        return done

    adb("start-server")
    try:
        yield adb
    finally:
        adb("kill-server", check=False)


def _connect_google_adb(adb, port: int) -> str:
    serial = f"127.0.0.1:{port}"
    assert "connected" in adb("connect", serial).stdout
    deadline = time.monotonic() + 10
    while f"{serial}\tdevice" not in adb("devices").stdout:
        assert time.monotonic() < deadline, adb("devices").stdout
        time.sleep(0.1)
    return serial


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


# ---- Google's adb --------------------------------------------------------------------------------


def test_google_adb_reverse_relays_bodies_and_lists_and_removes(google_adb, phone, farm):
    serial = _connect_google_adb(google_adb, phone.port)
    adb = lambda *a, **kw: google_adb("-s", serial, *a, **kw)  # noqa: E731
    q = phone.host_port(PHONE_PORT)
    assert _refused(q)  # nothing forwarded yet: refused, as on a phone

    adb("reverse", f"tcp:{PHONE_PORT}", f"tcp:{farm}")
    [line] = [x for x in adb("reverse", "--list").stdout.splitlines() if x]
    assert line.split()[1:] == [f"tcp:{PHONE_PORT}", f"tcp:{farm}"] and line.startswith("host-")  # adbd's format over TCP
    assert phone.forwards() == {PHONE_PORT: f"tcp:{farm}"}

    # phone -> host: a download of several ADB payloads, byte for byte; then an upload
    assert urllib.request.urlopen(f"http://127.0.0.1:{q}/blob", timeout=20).read() == BODY
    upload = os.urandom(3 * 1024 * 1024 + 7)
    answer = urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{q}/up", data=upload), timeout=20)
    assert answer.read().decode() == f"{hashlib.sha256(upload).hexdigest()} {len(upload)}"

    adb("reverse", "--remove", f"tcp:{PHONE_PORT}")
    assert phone.forwards() == {} and _refused(q)
    missing = adb("reverse", "--remove", f"tcp:{PHONE_PORT}", check=False)
    assert missing.returncode != 0 and f"listener 'tcp:{PHONE_PORT}' not found" in missing.stderr

    adb("reverse", "--no-rebind", f"tcp:{PHONE_PORT}", f"tcp:{farm}")
    again = adb("reverse", "--no-rebind", f"tcp:{PHONE_PORT}", f"tcp:{farm}", check=False)
    assert again.returncode != 0 and "cannot rebind existing socket" in again.stderr
    assert phone.host_port(PHONE_PORT) == q  # the same origin for the phone's lifetime
    assert urllib.request.urlopen(f"http://localhost:{q}/blob", timeout=20).read() == BODY

    chosen = int(adb("reverse", "tcp:0", f"tcp:{farm}").stdout.strip())  # adbd prints the port it chose
    assert phone.host_port(chosen) == chosen and set(phone.forwards()) == {PHONE_PORT, chosen}

    google_adb("disconnect", serial)  # forwards end with the connection that made them
    assert wait_until(lambda: phone.forwards() == {}) and _refused(q)


# ---- adbd's replies, on the wire --------------------------------------------------------------------


def _service(device: AdbDevice, service: str) -> bytes:
    info = device._open(service.encode(), None, 5.0, None)
    return b"".join(device._read_until_close(info))


def _fail(message: str) -> bytes:
    return b"FAIL%04x" % len(message) + message.encode()


def test_reverse_services_answer_in_adbds_words(phone, farm):
    device = AdbDevice(TcpTransport("127.0.0.1", phone.port), default_transport_timeout_s=5.0)
    device.connect(read_timeout_s=5.0)
    try:
        assert _service(device, "reverse:list-forward") == b"0000"
        assert _service(device, f"reverse:forward:tcp:{PHONE_PORT};tcp:{farm}") == b"OKAY"
        reply = _service(device, f"reverse:forward:tcp:0;tcp:{farm}")
        port = int(reply[8:])
        assert reply[:4] == b"OKAY" and int(reply[4:8], 16) == len(str(port))
        listing = _service(device, "reverse:list-forward")
        text = listing[4:].decode()
        assert int(listing[:4], 16) == len(text) and [x.split()[1:] for x in text.splitlines()] == [
            [f"tcp:{PHONE_PORT}", f"tcp:{farm}"], [f"tcp:{port}", f"tcp:{farm}"]]
        assert _service(device, f"reverse:forward:norebind:tcp:{PHONE_PORT};tcp:1") == _fail("cannot rebind existing socket")
        assert _service(device, "reverse:forward:tcp:1") == _fail("bad forward: tcp:1")
        assert _service(device, "reverse:killforward:tcp:9") == _fail("listener 'tcp:9' not found")
        assert _service(device, "reverse:garbage") == _fail("not a reverse forwarding command")
        assert _service(device, f"reverse:killforward:tcp:{port}") == b"OKAY"
        assert _service(device, "reverse:killforward-all") == b"OKAY"
        assert _service(device, "reverse:list-forward") == b"0000"
    finally:
        device.close()


def test_a_lost_connection_resets_the_apps_connections(phone):
    """A device-initiated stream over a raw socket: the host accepts the phone's OPEN, then
    the ADB connection dies mid-response; the app's socket is reset, not ended cleanly."""
    with socket.create_connection(("127.0.0.1", phone.port), timeout=5) as adb:
        def send(command: bytes, arg0: int, arg1: int, data: bytes = b"") -> None:
            cmd = struct.unpack("<I", command)[0]
            adb.sendall(struct.pack("<6I", cmd, arg0, arg1, len(data), 0, cmd ^ 0xFFFFFFFF) + data)

        def receive() -> tuple[bytes, int, int, bytes]:
            header = _recv_exact(adb, 24)
            _, arg0, arg1, length = struct.unpack_from("<4I", header)
            return header[:4], arg0, arg1, _recv_exact(adb, length)

        send(b"CNXN", 0x01000001, 1 << 20, b"host::\0")
        assert receive()[0] == b"CNXN"
        send(b"OPEN", 1, 0, f"reverse:forward:tcp:{PHONE_PORT};tcp:7\0".encode())
        assert receive()[0] == b"OKAY"
        command, device_id, _, data = receive()
        assert (command, data) == (b"WRTE", b"OKAY")
        send(b"OKAY", 1, device_id)
        assert receive()[0] == b"CLSE"

        app = socket.create_connection(("127.0.0.1", phone.host_port(PHONE_PORT)), timeout=5)
        command, phone_id, zero, data = receive()
        assert (command, zero, data) == (b"OPEN", 0, b"tcp:7\0")
        send(b"OKAY", 2, phone_id)
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf"
        send(b"WRTE", 2, phone_id, head)
        assert receive()[:2] == (b"OKAY", phone_id)  # acknowledged once the app's socket took it
        assert _recv_exact(app, len(head)) == head
        adb.shutdown(socket.SHUT_RDWR)  # the cable is pulled
    with pytest.raises(ConnectionResetError):
        while app.recv(1024):
            pass
    app.close()
    assert wait_until(lambda: phone.forwards() == {})


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


# ---- phone URLs ---------------------------------------------------------------------------------


def test_phone_urls_map_to_stable_host_ports(phone):
    q = phone.host_port(PHONE_PORT)
    assert phone.host_url(f"http://localhost:{PHONE_PORT}/web/index.html?x=1#top") == \
        f"http://localhost:{q}/web/index.html?x=1#top"
    assert phone.host_url(f"https://127.0.0.1:{PHONE_PORT}/") == f"https://127.0.0.1:{q}/"
    assert phone.host_url("http://localhost/a") == f"http://localhost:{phone.host_port(80)}/a"
    assert phone.host_url("http://example.com:8080/a") == "http://example.com:8080/a"
    assert phone.host_port(PHONE_PORT) == q and phone.host_port(PHONE_PORT + 1) != q
    assert _refused(q)


# ---- am, pm, svc and input (no browser needed) -----------------------------------------------------


def _shell(device: AdbDevice, command: str) -> tuple[str, str, int]:
    info = device._open(b"shell,v2,raw:" + command.encode(), 120.0, 120.0, None)  # loaded machines
    buf = b"".join(device._read_until_close(info))
    out, err, code = b"", b"", None
    while buf:
        kind, length = struct.unpack_from("<BI", buf)
        data, buf = buf[5:5 + length], buf[5 + length:]
        if kind == 1:
            out += data
        elif kind == 2:
            err += data
        elif kind == 3:
            code = data[0]
    return out.decode(), err.decode(), code


def test_app_commands_answer_like_android(phone):
    device = AdbDevice(TcpTransport("127.0.0.1", phone.port), default_transport_timeout_s=5.0)
    device.connect(read_timeout_s=5.0)
    try:
        out, _, code = _shell(device, "pm list packages")
        assert code == 0 and "package:com.android.chrome\n" in out
        assert _shell(device, "pm list packages chrome") == ("package:com.android.chrome\n", "", 0)
        assert _shell(device, "svc power stayon usb") == ("", "", 0) and phone.apps.stay_on == 2
        assert _shell(device, "svc power stayon sometimes")[2] == 1 and phone.apps.stay_on == 2
        assert _shell(device, "input keyevent KEYCODE_WAKEUP") == ("", "", 0)
        assert phone.apps.awake and phone.apps.key_events == ["KEYCODE_WAKEUP"]

        url = f"http://localhost:{PHONE_PORT}/web/index.html?session=x"
        out, err, code = _shell(device, f"am start -a android.intent.action.VIEW -d '{url}' com.example.absent")
        assert code == 0  # am start exits 0 and reports on stderr
        assert out == (f"Starting: Intent {{ act=android.intent.action.VIEW dat=http://localhost:{PHONE_PORT}/... "
                       "pkg=com.example.absent }\n")
        assert err == ("Error: Activity not started, unable to resolve Intent { act=android.intent.action.VIEW "
                       f"dat=http://localhost:{PHONE_PORT}/... flg=0x10000000 pkg=com.example.absent }}\n")
        out, err, code = _shell(device, f"am start -n com.example.absent/.Main -d {url}")
        assert out == f"Starting: Intent {{ dat=http://localhost:{PHONE_PORT}/... cmp=com.example.absent/.Main }}\n"
        assert err == "Error type 3\nError: Activity class {com.example.absent/com.example.absent.Main} does not exist.\n"
        assert _shell(device, "am start -Z") == ("", "Error: Unknown option: -Z\n", 255)
        assert _shell(device, "am force-stop com.android.chrome") == ("", "", 0)  # not running: nothing to do
        assert not phone.browser_running()
    finally:
        device.close()
