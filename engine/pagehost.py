"""The page host: how a WebGPU page is served its commands, whoever hosts it. The engine's own
browser executor (engine/browser.py: one page per session, named in the query) and a hub of
browser devices (one page per device, named by its token) are both a PageHostHandler on a
GuardedServer (engine/httpserver.py) with one PageChannel per page:

    GET  /, /index.html, /web/*   the page and its modules, from the host's web roots
    GET  /api/next?page=ID        long poll: the page's next command, or 204 after POLL_S
    POST /api/done                a command's answer {id, ok, result | error}
    POST /api/beat                "still working on command id" (every 3 s, from the page's
                                  worker: a busy command or a throttled background page holds
                                  no beat back), and at once when the page is hidden or shown:
                                  {"hidden": bool}
    POST /api/log                 the page's uncaught errors

A page is alive while it polls, answers, beats or logs; a command whose page goes quiet for
`lost_s`, or whose page was replaced by a new one (the tab reloaded), ends with BrowserError
"page-lost"; one whose page says it was hidden (a phone's screen off, another app or tab in
front: the browser throttles and may stop it) ends with "page-hidden". A command taken by a
poll whose answer could not be written (the page died in between) goes back to the queue. A
host says who a request's page is (`page_channel`), and refuses the request itself before any
of its body is read when it is nobody's.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from .errors import BrowserError
from .httpserver import GuardedHandler, RequestError

WEB_ROOT = Path(__file__).resolve().parent / "web"  # the engine's page: plan.js, page.js, index.html
POLL_S = 10.0  # how long a page's GET /api/next waits for a command before it asks again
PAGE_LOST_S = 15.0  # silence after which a page holding a command counts as gone
MAX_BODY = 64 * 2**20  # answers carry images and arrays as base64
CONSOLE_KEPT = 200  # a page's last log entries kept
CONTENT_TYPES = {".js": "text/javascript", ".html": "text/html; charset=utf-8", ".wgsl": "text/plain; charset=utf-8",
                 ".json": "application/json"}


def reply_result(reply: dict[str, Any]) -> dict[str, Any]:
    """A page's answer ({id, ok, result | error}): its result, or the BrowserError it reports."""
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise BrowserError(err.get("kind", "internal"), err.get("message", "no message"))
    return reply["result"]


class PageChannel:
    """The commands of one page: `call` queues a command and waits for its answer, the page
    takes commands with `next_command` (a long poll) and answers with `done`; every word from
    the page (`heard`: a poll, an answer, a heartbeat, a log line) keeps it alive. A page that
    holds no poll and has been silent for `lost_s`, or that was replaced (reloaded) while it
    ran a command, is lost: the call raises BrowserError "page-lost"."""

    _ids = itertools.count(1)  # command ids unique across channels, as a page may move between them

    def __init__(self, name: str, *, poll_s: float = POLL_S, lost_s: float = PAGE_LOST_S):
        self.name, self.poll_s, self.lost_s = name, poll_s, lost_s
        self.commands: queue.Queue = queue.Queue()
        self.replies: dict[int, queue.Queue] = {}
        self.taken: dict[int, str] = {}  # command id -> the page instance that took it
        self.page = ""  # the page instance heard last
        self.seen = 0.0  # monotonic time of the page's last word
        self.polling = 0  # polls held open now
        self.polled = threading.Event()  # the page asked for a command at least once
        self.console: list[dict[str, Any]] = []  # the page's last log entries
        self.hidden = False  # the page said it is hidden (and has not said it is visible since)
        self.beat_seen = 0.0  # monotonic time of the page's last heartbeat
        self.beat_state = ""  # what the page's running command said it was doing, in that beat
        self._lock = threading.Lock()

    def heard(self) -> None:
        self.seen = time.monotonic()

    def alive(self, now: float | None = None) -> bool:
        return self.polling > 0 or (now or time.monotonic()) - self.seen < self.lost_s

    def log(self, entry: dict[str, Any]) -> None:
        self.heard()
        self.console.append(entry)
        del self.console[:-CONSOLE_KEPT]

    def beat(self, doc: dict[str, Any] | None) -> None:
        """A heartbeat; its {"hidden": bool} says whether the page is hidden now, its {"state":
        text} what the running command is doing."""
        self.heard()
        self.beat_seen = self.seen
        if isinstance(doc, dict) and isinstance(doc.get("hidden"), bool):
            self.hidden = doc["hidden"]
        if isinstance(doc, dict) and isinstance(doc.get("state"), str):
            self.beat_state = doc["state"][:300]

    def _where(self, taken_at: float | None, now: float) -> str:
        """What a command that ran out of time was doing, for its timeout error."""
        if taken_at is None:
            return (f"the page never took it (its last poll or word {now - self.seen:.0f} s ago, "
                    f"{self.polling} poll(s) open now)")
        where = f"the page took it {now - taken_at:.0f} s ago"
        if self.beat_seen >= taken_at:
            where += f"; its last heartbeat came {now - self.beat_seen:.0f} s ago"
            if self.beat_state:
                where += f" and said: {self.beat_state}"
        else:
            where += " and has sent no heartbeat since"
        return where

    def next_command(self, page: str = "") -> dict[str, Any] | None:
        """The page's long poll: the next command (marked as taken by `page`), or None after
        poll_s. A command the page could not be sent goes back with `give_back`."""
        self.heard()
        self.polled.set()
        self.page = page or self.page
        with self._lock:
            self.polling += 1
        try:
            command = self.commands.get(timeout=self.poll_s)
        except queue.Empty:
            return None
        finally:
            with self._lock:
                self.polling -= 1
            self.heard()
        self.taken[command["id"]] = page
        return command

    def give_back(self, command: dict[str, Any]) -> None:
        self.taken.pop(command["id"], None)
        self.commands.put(command)

    def done(self, reply: dict[str, Any]) -> None:
        """The page's answer {id, ok, result | error} to the call that waits for it (if any)."""
        self.heard()
        box = self.replies.get(reply.get("id"))
        if box is not None:
            box.put(reply)

    def call(self, op: str, *, timeout_s: float = 600.0, gone=None, **fields) -> dict[str, Any]:
        """Send the page one command and return its answer; BrowserError for the page's own
        errors, for a page that goes quiet or is replaced, past `timeout_s`, and as soon as
        `gone()` names a reason (the browser process exited)."""
        command_id = next(self._ids)
        box: queue.Queue = queue.Queue()
        self.replies[command_id] = box
        self.commands.put({"id": command_id, "op": op, **fields})
        deadline = time.monotonic() + timeout_s
        taken_at = None
        try:
            while True:
                try:
                    reply = box.get(timeout=0.5)
                    break
                except queue.Empty:
                    pass
                why = gone() if gone is not None else None
                if why:
                    raise BrowserError("browser-exited", f"{op}: {why}")
                now = time.monotonic()
                taker = self.taken.get(command_id)
                if taker is not None and taken_at is None:
                    taken_at = now
                if taker is not None and self.page and self.page != taker:
                    raise BrowserError("page-lost", f"{op}: the page was replaced (reloaded) while it ran the command")
                if taker is not None and self.hidden:
                    raise BrowserError("page-hidden", f"{op}: {self.name} was hidden while it ran the command "
                                       "(screen off, or another tab or app in front): the browser throttles it")
                if not self.alive(now):
                    raise BrowserError("page-lost", f"{op}: no word from {self.name} for {now - self.seen:.0f} s "
                                       "(tab closed or crashed, screen off or device lost)")
                if now > deadline:
                    raise BrowserError("timeout", f"{op}: the page did not answer within {timeout_s:.0f} s: "
                                       + self._where(taken_at, now))
        finally:
            self.replies.pop(command_id, None)
            self.taken.pop(command_id, None)
            self._drop(command_id)
        return reply_result(reply)

    def _drop(self, command_id: int) -> None:
        """Take an abandoned command out of the queue, so no later page runs it."""
        with self.commands.mutex:
            kept = [c for c in self.commands.queue if c.get("id") != command_id]
            self.commands.queue.clear()
            self.commands.queue.extend(kept)


SEND_PIECE = 1 << 20


def send_file(handler, root: Path, rel: str | None = None) -> int:
    """Answer `handler`'s GET with the file `rel` under `root` (or the file `root`), honouring a
    single byte range; 404 for anything outside `root` or missing. Returns the body bytes sent."""
    root = Path(root).resolve()
    name = urllib.parse.unquote(rel) if rel is not None else None
    if name is not None and "\x00" in name:  # no file has one; the OS call would raise
        answer(handler, 404, b"not found", "text/plain")
        return 0
    path = (root / name).resolve() if name is not None else root
    if (name is not None and not path.is_relative_to(root)) or not path.is_file():
        answer(handler, 404, b"not found", "text/plain")
        return 0
    size = path.stat().st_size
    start, end = 0, size - 1
    rng = handler.headers.get("Range")
    status, headers = 200, {"Accept-Ranges": "bytes"}
    if rng:
        try:
            unit, spec = rng.split("=", 1)
            a, b = spec.split("-", 1)
            start, end = int(a), min(int(b) if b else size - 1, size - 1)
            if unit.strip() != "bytes" or start > end or start >= size:
                raise ValueError
        except ValueError:
            answer(handler, 416, b"bad range", "text/plain", {"Content-Range": f"bytes */{size}"})
            return 0
        status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
    # Streamed a piece at a time: a 1.7 GB weight file asked for whole is never held in memory.
    length = end - start + 1
    handler.send_response(status)
    handler.send_header("Content-Type", CONTENT_TYPES.get(path.suffix, "application/octet-stream"))
    handler.send_header("Content-Length", str(length))
    handler.send_header("Cache-Control", "no-store")
    for k, v in headers.items():
        handler.send_header(k, v)
    handler.end_headers()
    if handler.command == "HEAD":
        return 0
    sent = 0
    with open(path, "rb") as f:
        f.seek(start)
        while sent < length and (piece := f.read(min(SEND_PIECE, length - sent))):
            handler.wfile.write(piece)
            sent += len(piece)
    return sent


def answer(handler, status: int, body: bytes = b"", ctype: str = "application/json", headers=None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Cache-Control", "no-store")
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


class PageHostHandler(GuardedHandler):
    """The page protocol on a GuardedServer. A host names its web roots (the first holding a
    file serves it: a host's own page over the engine's) and says, in `page_channel`, whose
    page a request comes from: its PageChannel, or None once it has answered the refusal."""

    web_roots: tuple[Path, ...] = (WEB_ROOT,)

    def log_message(self, *args):  # the caller's output stays clean
        pass

    def page_channel(self, query: dict[str, list[str]]) -> PageChannel | None:
        raise NotImplementedError

    def send(self, status: int, body: bytes = b"", ctype: str = "application/json", headers=None) -> None:
        answer(self, status, body, ctype, headers)

    def error(self, status: int, message: str) -> None:
        self.send(status, json.dumps({"error": message}).encode())

    def refuse(self, status: int, message: str) -> None:
        self.close_connection = True  # the body, unread, must not be taken for a request
        self.error(status, message)

    def send_web_file(self, path: str) -> bool:
        """GET of the page or one of its modules; whether `path` was one."""
        if path in ("/", "/index.html"):
            rel = "index.html"
        elif path.startswith("/web/"):
            rel = path[len("/web/"):]
        else:
            return False
        name = urllib.parse.unquote(rel)  # send_file keeps it inside the root it is served from
        send_file(self, next((r for r in self.web_roots if (r / name).is_file()), self.web_roots[0]), rel)
        return True

    def serve_next(self, channel: PageChannel, query: dict[str, list[str]]) -> None:
        """GET /api/next: the page's long poll."""
        command = channel.next_command(query.get("page", [""])[0])
        if command is None:
            return self.send(204)
        try:
            self.send(200, json.dumps(command).encode())
        except OSError:  # the page went away between its poll and this answer: another poll's now
            channel.give_back(command)

    def serve_page_post(self, path: str, channel: PageChannel) -> bool:
        """POST /api/done|beat|log from `channel`'s page (known before its body is read);
        whether `path` was one."""
        if path not in ("/api/done", "/api/beat", "/api/log"):
            return False
        try:
            body = self.read_body(MAX_BODY, required=False)
        except RequestError as exc:
            self.refuse(exc.status, str(exc))
            return True
        channel.heard()
        if path == "/api/done":
            reply = json_object(body)
            if reply is None:
                self.error(400, "an answer is a JSON object {id, ok, result | error}")
                return True
            channel.done(reply)
        elif path == "/api/beat":
            channel.beat(json_object(body))
        elif path == "/api/log":
            entry = json_object(body)
            channel.log(entry if entry is not None else
                        {"level": "error", "message": body[:500].decode("utf-8", "replace")})
        self.send(204)
        return True


def json_object(body: bytes) -> dict[str, Any] | None:
    """`body` as a JSON object; None when it is not one."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
