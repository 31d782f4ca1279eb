"""The farm's hub for browser devices: the HTTP(S) server a phone's browser page talks to, and
through which the farm drives it. One hub serves many devices; each device's page is enrolled
with a token (agent/web/farm.js keeps it) and polls the hub for its next command.

    page side (Authorization: Bearer <device token>; a page naming another device than the
    token's, in ?device=, is refused with 403)
      GET  /, /web/*              the page (agent/web, on the engine's modules in engine/web),
                                  no token needed
      GET  /api/next?page=ID      long poll: the device's next command, or 204
      POST /api/done              a command's answer {id, ok, result | error}
      POST /api/beat              "still working on command id" (every few seconds)
      POST /api/log               the page's uncaught errors
      GET  /blobs/<sha256>        a file of a build deployed to the device (byte ranges)
      GET  /plans/<name>          a plan the farm put up for the device

    farm side (X-Farm-Hub-Key: <the hub's key>, for `farm-agent run` started by the farm)
      POST /ctl/<device>/call     {op, timeout_s, ...}: one command to the page, its answer back
      PUT  /ctl/<device>/plans/<name>   a plan for the page to fetch

The page side is the engine's page host (engine/pagehost.py), the one the engine's own browser
executor is served by too: each device's commands go through a PageChannel; a command whose
page goes quiet for PAGE_LOST_S, or whose page was replaced by a new one (the tab reloaded),
ends with a BrowserError of kind "page-lost": the caller treats it as an infrastructure
failure. The hub counts the blob bytes it serves per device, so a deploy can show it sent nothing.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.link import HUB_KEY_HEADER, hub_request
from engine.errors import BrowserError
from engine.httpserver import GuardedServer, RequestError
from engine.pagehost import (
    MAX_BODY,
    PAGE_LOST_S,
    POLL_S,
    WEB_ROOT,
    PageChannel,
    PageHostHandler,
    json_object,
    reply_result,
    send_file,
)

AGENT_WEB_ROOT = Path(__file__).resolve().parents[2] / "agent" / "web"  # the farm's page
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
FRESH_S = 2.0  # a page heard this recently (or holding a poll) is there now, not merely not lost yet


def fresh_status(status: dict[str, Any]) -> bool:
    """Whether a device's status (BrowserHub.status, HubClient.status) says its page is there
    now: a poll held open, or a word within FRESH_S. `online` says only that it is not lost yet
    (a word within PAGE_LOST_S), which a page cut off from the hub still is for a while."""
    seen = status.get("seen_s_ago")
    return bool(status.get("polling")) or (seen is not None and seen < FRESH_S)


def _host_name(host: str) -> str:
    """The name part of a Host header ("127.0.0.1:8780" -> "127.0.0.1", "[::1]:80" -> "::1")."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@dataclass
class _Device:
    serial: str
    token: str
    store: Path  # <agent root>/store: the blobs of the builds deployed to the device
    channel: PageChannel  # its page's commands (engine/pagehost.py: one rule for every page host)
    bytes_served: int = 0
    plans: dict[str, bytes] = field(default_factory=dict)


class _Server(GuardedServer):
    """One listener of the hub (engine/httpserver.py: bounded connections, TLS handshakes in
    their own threads, a deadline on each request)."""

    def __init__(self, address, hub: BrowserHub, tls: ssl.SSLContext | None, loopback: bool):
        self.hub, self.loopback = hub, loopback
        super().__init__(address, _Handler, tls=tls, quiet=True)


class BrowserHub:
    """The hub, serving plain HTTP on `host`:`port` (0: a free port; workers, and phones
    through reverse forwards) and, with `https` = (host, port, ssl.SSLContext), HTTPS for
    devices on the network (orchestrator.infra.ca.server_ssl_context), each in a background thread.
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
        # page requests refused for a token no device has: a page whose browser deleted its
        # enrolment says nothing else (it cannot say whose it was)
        self.refused_tokens = 0
        self.lock = threading.Lock()
        self.servers = [self._serve(host, port, None)]
        self.port = self.servers[0].server_address[1]
        self.https_port = None
        if https is not None:
            self.servers.append(self._serve(*https))
            self.https_port = self.servers[1].server_address[1]

    def _serve(self, host: str, port: int, context: ssl.SSLContext | None) -> _Server:
        server = _Server((host, port), self, context, loopback=host in LOOPBACK_NAMES)
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
                device = _Device(serial, token, Path(store), PageChannel(f"{serial}'s page", poll_s=self.poll_s,
                                                                          lost_s=self.page_lost_s))
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
        """The device whose page holds `token`. With tokens_dir, a token is good while its file
        says so: `farm devices remove|quarantine|revoke-token` delete the file, and the next
        request with the token is refused, whichever process enrolled it."""
        for attempt in range(2):
            for known, device in list(self._by_token.items()):
                if hmac.compare_digest(known, token):
                    return device if self._still_valid(device) else None
            if attempt == 0 and not self._enrol_from_files():
                break
        return None

    def _still_valid(self, device: _Device) -> bool:
        if self.tokens_dir is None:
            return True  # a hub without token files: its registrations are the truth
        try:
            valid = hmac.compare_digest((self.tokens_dir / device.serial).read_text().strip(), device.token)
        except (OSError, ValueError):
            valid = False
        if not valid:
            self.revoke(device.serial)
        return valid

    def revoke(self, serial: str) -> None:
        """Stop serving `serial`'s token; commands waiting for its page end as page-lost."""
        with self.lock:
            device = self.devices.pop(serial, None)
            if device is not None:
                self._by_token.pop(device.token, None)

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
        return {"serial": serial, "registered": True, "online": device.channel.alive(now),
                "polling": device.channel.polling,
                "seen_s_ago": round(now - device.channel.seen, 3) if device.channel.seen else None,
                "bytes_served": device.bytes_served, "console": device.channel.console[-20:]}

    def control_url(self, serial: str) -> str:
        """Where `farm-agent run` reaches the device's page (agent.hubpage.HubPage)."""
        return f"{self.local_url}/ctl/{urllib.parse.quote(serial)}?key={self.key}"

    def online(self, serial: str) -> bool:
        return serial in self.devices and self.devices[serial].channel.alive()

    def wait_online(self, serial: str, timeout_s: float, gone: Callable[[], str | None] | None = None) -> None:
        """Until the device's page polls; BrowserError "timeout" after `timeout_s`. `gone()`
        may name a reason to stop waiting early (the browser process exited)."""
        device = self.device(serial)
        channel = device.channel
        _wait_for(lambda: channel.polling > 0 or time.monotonic() - channel.seen < FRESH_S, serial, timeout_s, gone, 0.2)

    def put_plan(self, serial: str, name: str, body: bytes) -> str:
        self.device(serial).plans[name] = body
        return f"/plans/{urllib.parse.quote(name)}"

    def call(self, serial: str, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        """Send the device's page one command and return its answer; BrowserError for the page's
        own errors, for a page that goes quiet or is replaced, and past `timeout_s`."""
        return self.device(serial).channel.call(op, timeout_s=timeout_s, **fields)

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


class _Handler(PageHostHandler):
    server: _Server
    # the farm's page (agent/web: main.js, farm.js) over the engine's (index.html, page.js, plan.js)
    web_roots = (AGENT_WEB_ROOT, WEB_ROOT)

    def parse_request(self) -> bool:
        """The request line and headers, then what no route takes: on the loopback listener a
        Host that is not this machine (a web page's DNS rebinding: evil.example resolving to
        127.0.0.1), and anywhere an Origin that is not the hub's own (another site's page
        posting to it; the hub's page fetches from its own origin)."""
        if not super().parse_request():
            return False
        host = (self.headers.get("Host") or "").strip().lower()
        if self.server.loopback and _host_name(host) not in LOOPBACK_NAMES:
            self.refuse(421, f"Host {host[:100]!r} is not this machine: the hub's local listener answers "
                             "127.0.0.1 and localhost only")
            return False
        origin = self.headers.get("Origin")
        if origin is not None and urllib.parse.urlsplit(origin.strip().lower()).netloc != host:
            self.refuse(403, f"a page of {origin[:100]!r} may not use the hub")
            return False
        return True

    @property
    def hub(self) -> BrowserHub:
        return self.server.hub

    def _page_device(self, query: dict[str, list[str]]) -> _Device | None:
        """The device whose token the request carries; None once the refusal is sent (401 for no
        known token, 403 for a page naming another device than the token's)."""
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        device = self.hub.by_token(token) if token else None
        if device is None:
            with self.hub.lock:
                self.hub.refused_tokens += 1
            self.refuse(401, "no device has this token: open the device's enrolment URL again")
            return None
        claimed = query.get("device", [""])[0]
        if claimed and claimed != device.serial:
            self.refuse(403, f"this token is {device.serial}'s, not {claimed}'s")
            return None
        return device

    def page_channel(self, query: dict[str, list[str]]) -> PageChannel | None:
        device = self._page_device(query)
        return device.channel if device is not None else None

    def _farm_side(self) -> bool:
        return hmac.compare_digest(self.headers.get(HUB_KEY_HEADER, ""), self.hub.key)

    # ---- requests ------------------------------------------------------------------------------

    def do_GET(self):  # noqa: N802  (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        path, query = url.path, urllib.parse.parse_qs(url.query)
        if self.send_web_file(path):
            return None
        device = self._page_device(query)
        if device is None:
            return None
        if path == "/api/next":
            return self.serve_next(device.channel, query)
        if path.startswith("/blobs/"):
            sha = path[len("/blobs/"):]
            if len(sha) != 64 or not all(c in "0123456789abcdef" for c in sha):
                return self.error(404, "not a blob name")
            served = send_file(self, device.store / sha[:2], sha)
            with self.hub.lock:
                device.bytes_served += served
            return None
        if path.startswith("/plans/"):
            body = device.plans.get(urllib.parse.unquote(path[len("/plans/"):]))
            return self.send(200, body) if body is not None else self.error(404, "no such plan")
        return self.error(404, "not found")

    def do_HEAD(self):  # noqa: N802
        return self.do_GET()

    def do_PUT(self):  # noqa: N802
        parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
        if not self._farm_side():
            return self.error(403, "the farm side needs the hub's key")
        if len(parts) == 4 and parts[0] == "ctl" and parts[2] == "plans":
            try:
                body = self.read_body(MAX_BODY, required=False)
            except RequestError as exc:
                return self.refuse(exc.status, str(exc))
            try:
                name = self.hub.put_plan(urllib.parse.unquote(parts[1]), urllib.parse.unquote(parts[3]), body)
            except (BrowserError, ValueError) as exc:
                return self.error(404, str(exc))
            return self.send(200, json.dumps({"url": name}).encode())
        return self.refuse(404, "not found")

    def do_POST(self):  # noqa: N802
        # Who is asking comes first: no byte of a body is read for a client without a key or
        # a token (a 300 MiB POST with none was read whole before).
        url = urllib.parse.urlsplit(self.path)
        if url.path.startswith("/ctl/"):
            if not self._farm_side():
                return self.refuse(403, "the farm side needs the hub's key")
            try:
                body = self.read_body(MAX_BODY, required=False)
            except RequestError as exc:
                return self.refuse(exc.status, str(exc))
            return self._control(url.path, body)
        channel = self.page_channel(urllib.parse.parse_qs(url.query))
        if channel is not None and not self.serve_page_post(url.path, channel):
            self.refuse(404, "not found")
        return None

    def _control(self, path: str, body: bytes) -> None:
        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[2] not in ("call", "register", "status"):
            return self.error(404, "not found")
        serial = urllib.parse.unquote(parts[1])
        if parts[2] == "status":
            return self.send(200, json.dumps(self.hub.status(serial)).encode())
        if parts[2] == "register":
            doc = json_object(body)
            try:
                self.hub.register(serial, str(doc["token"]), Path(doc["store"]))
            except (ValueError, KeyError, TypeError):
                return self.error(400, "a registration is {token, store}")
            return self.send(200, json.dumps(self.hub.status(serial)).encode())
        command = json_object(body)
        try:
            op, timeout_s = str(command.pop("op")), float(command.pop("timeout_s", 600.0))
            if not 0 < timeout_s <= 86400:
                raise ValueError(timeout_s)
        except (ValueError, KeyError, TypeError, AttributeError):
            return self.error(400, "a call is {op, timeout_s (seconds, at most a day), ...}")
        try:
            result = self.hub.call(serial, op, timeout_s=timeout_s, **command)
            answer = {"ok": True, "result": result}
        except BrowserError as exc:
            answer = {"ok": False, "error": {"kind": exc.kind, "message": str(exc).removeprefix(f"browser: {exc.kind}: ")}}
        return self.send(200, json.dumps(answer).encode())


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
        """Until the device's page is there now (as BrowserHub.wait_online: a poll held or a word
        within FRESH_S; `online` would count a page last heard up to PAGE_LOST_S ago)."""
        _wait_for(lambda: fresh_status(self.status(serial)), serial, timeout_s, gone, 0.5)

    def call(self, serial: str, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        return reply_result(self._post(serial, "call", {"op": op, "timeout_s": timeout_s, **fields}, timeout_s + 30.0))

    def control_url(self, serial: str) -> str:
        return f"{self.url}/ctl/{urllib.parse.quote(serial)}?key={self.key}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def revoke_token(path: Path) -> bool:
    """Revoke the device token kept at `path` (every hub reading the tokens folder refuses it
    from its next request on); whether there was one."""
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return False
    return True


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
