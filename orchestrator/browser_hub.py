"""The farm's hub for browser devices: the HTTP(S) server a phone's browser page talks to, and
through which the farm drives it. One hub serves many devices; each device's page is enrolled
with a token (agent/web/farm.js keeps it) and polls the hub for its next command.

    page side (Authorization: Bearer <device token>; a page naming another device than the
    token's, in ?device=, is refused with 403)
      GET  /, /web/*              the page (agent/web), no token needed
      GET  /api/next?page=ID      long poll: the device's next command, or 204
      POST /api/done              a command's answer {id, ok, result | error}
      POST /api/beat              "still working on command id" (every few seconds)
      POST /api/log               the page's uncaught errors
      GET  /blobs/<sha256>        a file of a build deployed to the device (byte ranges)
      GET  /plans/<name>          a plan the farm put up for the device

    farm side (X-Farm-Hub-Key: <the hub's key>, for `farm-agent run` started by the farm)
      POST /ctl/<device>/call     {op, timeout_s, ...}: one command to the page, its answer back
      PUT  /ctl/<device>/plans/<name>   a plan for the page to fetch

A page is alive while it polls, answers or beats; a command whose page goes quiet for
PAGE_LOST_S, or whose page was replaced by a new one (the tab reloaded), ends with a
BrowserError of kind "page-lost": the caller treats it as an infrastructure failure. A command
taken by a poll whose answer could not be written (the page died in between) goes back to the
queue. The hub counts the blob bytes it serves per device, so a deploy can show it sent nothing.
"""

from __future__ import annotations

import hmac
import itertools
import json
import os
import queue
import secrets
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from engine.browser import (
    HUB_KEY_HEADER,
    WEB_ROOT,
    BrowserError,
    hub_request,
    reply_result,
    send_file,
)

POLL_S = 10.0  # how long a page's GET /api/next waits for a command
PAGE_LOST_S = 15.0  # silence after which a page holding a command counts as gone
MAX_BODY = 64 * 2**20  # answers carry images and arrays as base64


@dataclass
class _Device:
    serial: str
    token: str
    store: Path  # <agent root>/store: the blobs of the builds deployed to the device
    commands: queue.Queue = field(default_factory=queue.Queue)
    replies: dict[int, queue.Queue] = field(default_factory=dict)
    taken: dict[int, str] = field(default_factory=dict)  # command id -> the page that took it
    page: str = ""  # the page instance seen last
    seen: float = 0.0  # monotonic time of the page's last word
    polling: int = 0  # polls held open now
    bytes_served: int = 0
    plans: dict[str, bytes] = field(default_factory=dict)
    console: list[dict[str, Any]] = field(default_factory=list)

    def alive(self, now: float, lost_s: float) -> bool:
        return self.polling > 0 or now - self.seen < lost_s


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: BrowserHub


class BrowserHub:
    """The hub, serving plain HTTP on `host`:`port` (0: a free port; workers, and phones
    through reverse forwards) and, with `https` = (host, port, ssl.SSLContext), HTTPS for
    devices on the network (orchestrator.ca.server_ssl_context), each in a background thread.
    `key` guards the farm side. With `tokens_dir`, a page whose token is unknown is looked up
    there (one file per device, named by its serial) and served with blobs from
    `stores`/<serial>/store: devices enrolled with `farm devices add` need no other word."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, https: tuple[str, int, ssl.SSLContext] | None = None,
                 key: str | None = None, poll_s: float = POLL_S, page_lost_s: float = PAGE_LOST_S,
                 tokens_dir: Path | None = None, stores: Path | None = None):
        self.key = key or secrets.token_urlsafe(24)
        self.poll_s, self.page_lost_s = poll_s, page_lost_s
        self.tokens_dir, self.stores = tokens_dir, stores
        self.devices: dict[str, _Device] = {}
        self._by_token: dict[str, _Device] = {}
        self._ids = itertools.count(1)
        self.lock = threading.Lock()
        self.servers = [self._serve(host, port, None)]
        self.port = self.servers[0].server_address[1]
        self.https_port = None
        if https is not None:
            self.servers.append(self._serve(*https))
            self.https_port = self.servers[1].server_address[1]

    def _serve(self, host: str, port: int, context: ssl.SSLContext | None) -> _Server:
        server = _Server((host, port), _Handler)
        server.hub = self
        if context is not None:
            server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, name=f"browser-hub-{port}", daemon=True).start()
        return server

    @property
    def local_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def register(self, serial: str, token: str, store: Path) -> None:
        """Serve device `serial`, whose page holds `token`, with blobs from `store`."""
        with self.lock:
            old = self.devices.get(serial)
            if old is not None and old.token != token:
                self._by_token.pop(old.token, None)
            if old is None or old.token != token:
                device = _Device(serial, token, Path(store))
                self.devices[serial] = device
                self._by_token[token] = device
            else:
                old.store = Path(store)

    def device(self, serial: str) -> _Device:
        try:
            return self.devices[serial]
        except KeyError:
            raise BrowserError("unknown-device", f"the hub serves no device {serial!r}") from None

    def by_token(self, token: str) -> _Device | None:
        for attempt in range(2):
            for known, device in list(self._by_token.items()):
                if hmac.compare_digest(known, token):
                    return device
            if attempt == 0 and not self._enrol_from_files():
                break
        return None

    def _enrol_from_files(self) -> bool:
        """Register the devices of tokens_dir not registered yet; whether any was."""
        if self.tokens_dir is None or self.stores is None or not self.tokens_dir.is_dir():
            return False
        added = False
        for path in sorted(self.tokens_dir.iterdir()):
            token = path.read_text().strip() if path.is_file() else ""
            if token and (path.name not in self.devices or self.devices[path.name].token != token):
                self.register(path.name, token, self.stores / path.name / "store")
                added = True
        return added

    def status(self, serial: str) -> dict[str, Any]:
        device = self.devices.get(serial)
        if device is None:
            return {"serial": serial, "registered": False, "online": False}
        now = time.monotonic()
        return {"serial": serial, "registered": True, "online": device.alive(now, self.page_lost_s),
                "seen_s_ago": round(now - device.seen, 3) if device.seen else None,
                "bytes_served": device.bytes_served, "console": device.console[-20:]}

    def control_url(self, serial: str) -> str:
        """Where `farm-agent run` reaches the device's page (engine.browser.RemotePage)."""
        return f"{self.local_url}/ctl/{urllib.parse.quote(serial)}?key={self.key}"

    def online(self, serial: str) -> bool:
        return serial in self.devices and self.devices[serial].alive(time.monotonic(), self.page_lost_s)

    def wait_online(self, serial: str, timeout_s: float, gone: Callable[[], str | None] | None = None) -> None:
        """Until the device's page polls; BrowserError "timeout" after `timeout_s`. `gone()`
        may name a reason to stop waiting early (the browser process exited)."""
        device = self.device(serial)
        _wait_for(lambda: device.polling > 0 or time.monotonic() - device.seen < 2.0, serial, timeout_s, gone, 0.2)

    def put_plan(self, serial: str, name: str, body: bytes) -> str:
        self.device(serial).plans[name] = body
        return f"/plans/{urllib.parse.quote(name)}"

    def call(self, serial: str, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        """Send the device's page one command and return its answer; BrowserError for the page's
        own errors, for a page that goes quiet or is replaced, and past `timeout_s`."""
        device = self.device(serial)
        command_id = next(self._ids)
        box: queue.Queue = queue.Queue()
        device.replies[command_id] = box
        device.commands.put({"id": command_id, "op": op, **fields})
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    reply = box.get(timeout=0.5)
                    break
                except queue.Empty:
                    pass
                now = time.monotonic()
                taker = device.taken.get(command_id)
                if taker is not None and device.page and device.page != taker:
                    raise BrowserError("page-lost", f"{op}: the page was replaced (reloaded) while it ran the command")
                if not device.alive(now, self.page_lost_s):
                    raise BrowserError("page-lost", f"{op}: no word from {serial}'s page for "
                                       f"{now - device.seen:.0f} s (tab closed, screen off or device lost)")
                if now > deadline:
                    raise BrowserError("timeout", f"{op}: the page did not answer within {timeout_s:.0f} s")
        finally:
            device.replies.pop(command_id, None)
            device.taken.pop(command_id, None)
            _drop(device.commands, command_id)
        return reply_result(reply)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def _wait_for(online: Callable[[], bool], serial: str, timeout_s: float, gone: Callable[[], str | None] | None,
              poll_s: float) -> None:
    """Until `online()`: BrowserError "page-lost" as soon as `gone()` names a reason, "timeout"
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not online():
        why = gone() if gone is not None else None
        if why:
            raise BrowserError("page-lost", why)
        if time.monotonic() > deadline:
            raise BrowserError("timeout", f"{serial}: the page did not reach the hub within {timeout_s:.0f} s")
        time.sleep(poll_s)


def _drop(commands: queue.Queue, command_id: int) -> None:
    """Take an abandoned command out of the queue, so no later page runs it."""
    with commands.mutex:
        kept = [c for c in commands.queue if c.get("id") != command_id]
        commands.queue.clear()
        commands.queue.extend(kept)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    @property
    def hub(self) -> BrowserHub:
        return self.server.hub

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode())

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ValueError(f"a body of {n} bytes is over the hub's {MAX_BODY}")
        return self.rfile.read(n)

    def _page_device(self) -> _Device | None:
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        return self.hub.by_token(token) if token else None

    def _farm_side(self) -> bool:
        return hmac.compare_digest(self.headers.get(HUB_KEY_HEADER, ""), self.hub.key)

    # ---- requests ------------------------------------------------------------------------------

    def do_GET(self):  # noqa: N802  (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        if path in ("/", "/index.html"):
            return send_file(self, WEB_ROOT / "index.html")
        if path.startswith("/web/"):
            return send_file(self, WEB_ROOT, path[len("/web/"):])
        device = self._page_device()
        if device is None:
            return self._error(401, "no device has this token: open the device's enrolment URL again")
        claimed = urllib.parse.parse_qs(url.query).get("device", [""])[0]
        if claimed and claimed != device.serial:
            return self._error(403, f"this token is {device.serial}'s, not {claimed}'s")
        if path == "/api/next":
            return self._next(device, urllib.parse.parse_qs(url.query).get("page", [""])[0])
        if path.startswith("/blobs/"):
            sha = path[len("/blobs/"):]
            if len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
                return self._error(404, "not a blob name")
            served = send_file(self, device.store / sha[:2], sha)
            with self.hub.lock:
                device.bytes_served += served
            return None
        if path.startswith("/plans/"):
            body = device.plans.get(urllib.parse.unquote(path[len("/plans/"):]))
            return self._send(200, body) if body is not None else self._error(404, "no such plan")
        return self._error(404, "not found")

    def do_HEAD(self):  # noqa: N802
        return self.do_GET()

    def _next(self, device: _Device, page: str) -> None:
        now = time.monotonic()
        device.seen, device.page = now, page or device.page
        with self.hub.lock:
            device.polling += 1
        try:
            try:
                command = device.commands.get(timeout=self.hub.poll_s)
            except queue.Empty:
                return self._send(204)
            device.taken[command["id"]] = page
            try:
                self._send(200, json.dumps(command).encode())
            except OSError:  # the page went away between its poll and our answer: someone else's now
                device.taken.pop(command["id"], None)
                device.commands.put(command)
        finally:
            with self.hub.lock:
                device.polling -= 1
            device.seen = time.monotonic()

    def do_PUT(self):  # noqa: N802
        parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
        if not self._farm_side():
            return self._error(403, "the farm side needs the hub's key")
        if len(parts) == 4 and parts[0] == "ctl" and parts[2] == "plans":
            try:
                name = self.hub.put_plan(urllib.parse.unquote(parts[1]), urllib.parse.unquote(parts[3]), self._body())
            except (BrowserError, ValueError) as exc:
                return self._error(404, str(exc))
            return self._send(200, json.dumps({"url": name}).encode())
        return self._error(404, "not found")

    def do_POST(self):  # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        try:
            body = self._body()
        except ValueError as exc:
            return self._error(413, str(exc))
        if path.startswith("/ctl/"):
            return self._control(path, body)
        device = self._page_device()
        if device is None:
            return self._error(401, "no device has this token")
        claimed = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get("device", [""])[0]
        if claimed and claimed != device.serial:
            return self._error(403, f"this token is {device.serial}'s, not {claimed}'s")
        device.seen = time.monotonic()
        if path == "/api/done":
            try:
                reply = json.loads(body)
            except ValueError:
                return self._error(400, "the answer is not JSON")
            box = device.replies.get(reply.get("id"))
            if box is not None:
                box.put(reply)
            return self._send(204)
        if path == "/api/beat":
            return self._send(204)
        if path == "/api/log":
            try:
                device.console.append(json.loads(body))
            except ValueError:
                device.console.append({"level": "error", "message": body[:500].decode("utf-8", "replace")})
            del device.console[:-200]
            return self._send(204)
        return self._error(404, "not found")

    def _control(self, path: str, body: bytes) -> None:
        if not self._farm_side():
            return self._error(403, "the farm side needs the hub's key")
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[2] not in ("call", "register", "status"):
            return self._error(404, "not found")
        serial = urllib.parse.unquote(parts[1])
        if parts[2] == "status":
            return self._send(200, json.dumps(self.hub.status(serial)).encode())
        if parts[2] == "register":
            try:
                doc = json.loads(body)
                self.hub.register(serial, str(doc["token"]), Path(doc["store"]))
            except (ValueError, KeyError, TypeError):
                return self._error(400, "a registration is {token, store}")
            return self._send(200, json.dumps(self.hub.status(serial)).encode())
        try:
            command = json.loads(body)
            op, timeout_s = command.pop("op"), float(command.pop("timeout_s", 600.0))
        except (ValueError, KeyError, TypeError, AttributeError):
            return self._error(400, "a call is {op, timeout_s, ...}")
        try:
            result = self.hub.call(serial, op, timeout_s=timeout_s, **command)
            answer = {"ok": True, "result": result}
        except BrowserError as exc:
            answer = {"ok": False, "error": {"kind": exc.kind, "message": str(exc).removeprefix(f"browser: {exc.kind}: ")}}
        return self._send(200, json.dumps(answer).encode())


class HubClient:
    """A hub in another process (`farm hub`), reached on its farm side at `url` (its plain
    listener, http://127.0.0.1:PORT) with `key`: what BrowserTransport needs of a hub."""

    def __init__(self, url: str, key: str, timeout_s: float = 10.0):
        self.url, self.key, self.timeout_s = url.rstrip("/"), key, timeout_s
        self.port = urllib.parse.urlsplit(self.url).port

    def _post(self, serial: str, what: str, doc: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        return hub_request(f"{self.url}/ctl/{urllib.parse.quote(serial)}/{what}", self.key, "POST",
                           json.dumps(doc).encode(), timeout_s)

    def register(self, serial: str, token: str, store: Path) -> None:
        self._post(serial, "register", {"token": token, "store": str(store)}, self.timeout_s)

    def status(self, serial: str) -> dict[str, Any]:
        return self._post(serial, "status", {}, self.timeout_s)

    def online(self, serial: str) -> bool:
        return bool(self.status(serial)["online"])

    def wait_online(self, serial: str, timeout_s: float, gone: Callable[[], str | None] | None = None) -> None:
        _wait_for(lambda: self.online(serial), serial, timeout_s, gone, 0.5)

    def call(self, serial: str, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        return reply_result(self._post(serial, "call", {"op": op, "timeout_s": timeout_s, **fields}, timeout_s + 30.0))

    def control_url(self, serial: str) -> str:
        return f"{self.url}/ctl/{urllib.parse.quote(serial)}?key={self.key}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_or_make_token(path: Path) -> str:
    """A device's page token, kept 0600 at `path` (made on first use)."""
    path = Path(path)
    if path.is_file():
        token = path.read_text().strip()
        if token:
            return token
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
