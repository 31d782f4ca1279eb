"""The HTTP server every listener of the project is made of (the engine's page host,
`farm-agent serve` on a device, the hub browser devices talk to), with what holds against
hostile clients, from the standard library alone (the device side stays free of dependencies):

- at most `max_connections` connections at once (the accept loop waits for a free slot);
- the TLS handshake in the connection's own thread, never in accept(): a client that connects
  and sends nothing holds one slot, not the listener;
- a deadline on each request: its handshake, request line, headers and body must all arrive
  within `request_deadline_s` of the first byte asked for, or the connection is shut. A client
  that trickles a byte at a time (every read within the idle timeout) cannot hold a slot past
  it. A handler that has read its request (`read_body`, or answering) is past the deadline's
  reach: a long poll, a long download are not cut;
- `content_length()` refuses a missing, negative, non-numeric or too large Content-Length
  before a byte of the body is read, so a handler checks its token first and reads after;
- a client gone mid-reply is one line on stderr, not a traceback.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

IDLE_TIMEOUT_S = 30.0  # a connection silent this long between two reads is closed
REQUEST_DEADLINE_S = 30.0  # a request (handshake, headers, body) must arrive whole within this
MAX_CONNECTIONS = 64
WATCH_EVERY_S = 0.25


class RequestError(Exception):
    """A request refused before it is read (bad Content-Length, body too large): its status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class GuardedServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, handler, *, tls: ssl.SSLContext | None = None, quiet: bool = False,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 request_deadline_s: float = REQUEST_DEADLINE_S):
        self.tls, self.quiet = tls, quiet
        self.idle_timeout_s, self.request_deadline_s = idle_timeout_s, request_deadline_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._deadlines_lock = threading.Lock()
        self._stopped = threading.Event()
        super().__init__(address, handler)
        threading.Thread(target=self._watch, name=f"deadlines-{self.server_address[1]}", daemon=True).start()

    # ---- deadlines ------------------------------------------------------------------------

    def watch(self, conn: socket.socket) -> None:
        """Start `conn`'s request deadline (it must be read whole by then)."""
        with self._deadlines_lock:
            self._deadlines[conn] = time.monotonic() + self.request_deadline_s

    def unwatch(self, conn: socket.socket) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(conn, None)

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_EVERY_S):
            now = time.monotonic()
            with self._deadlines_lock:
                late = [conn for conn, deadline in self._deadlines.items() if deadline < now]
                for conn in late:
                    del self._deadlines[conn]
            for conn in late:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)  # the blocked read returns; the handler ends

    def server_close(self) -> None:
        self._stopped.set()
        super().server_close()

    # ---- connections: bounded, timed out, TLS in the connection's own thread ----------------

    def process_request(self, request, client_address) -> None:
        # Blocks the accept loop while every slot is busy; deadlines free them.
        self._slots.acquire()
        try:
            request.settimeout(self.idle_timeout_s)
            if request.family in (socket.AF_INET, socket.AF_INET6):
                # A response is two writes (the headers, then the body): with Nagle's algorithm
                # the body waits for the client's delayed ACK of the headers, 40 ms a request on
                # Linux, which made a page's first load of the tiny model's 448 weights 19 s.
                request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.unwatch(request)
            self._slots.release()

    def finish_request(self, request, client_address) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        self.watch(request)  # the handshake is part of the first request's time
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            self.note(client_address, f"TLS handshake failed: {exc}")
            return
        finally:
            self.unwatch(request)
        try:
            super().finish_request(conn, client_address)
        finally:
            self.unwatch(conn)
            self.shutdown_request(conn)

    def note(self, client_address, message: str) -> None:
        if not self.quiet:
            sys.stderr.write(f"{client_address[0]} {time.strftime('%H:%M:%S')} {message}\n")

    def handle_error(self, request, client_address) -> None:
        """A client that went away (a cut connection, a deadline, a client timeout) is one line,
        not a traceback; anything else is reported in full."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError, ssl.SSLError)):
            self.note(client_address, f"connection ended: {type(error).__name__}: {error}")
            return
        super().handle_error(request, client_address)


class GuardedHandler(BaseHTTPRequestHandler):
    server: GuardedServer
    protocol_version = "HTTP/1.1"
    timeout = None  # the server sets each connection's idle timeout before the TLS handshake

    def handle_one_request(self) -> None:
        self.server.watch(self.connection)
        try:
            super().handle_one_request()
        finally:
            self.server.unwatch(self.connection)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.headers.get("Content-Length") is None and self.headers.get("Transfer-Encoding") is None:
            self.request_read()  # no body: the request is read (a long poll may now wait)
        return True

    def request_read(self) -> None:
        """The request is read whole: its deadline no longer applies."""
        self.server.unwatch(self.connection)

    def send_response(self, code, message=None) -> None:
        self.request_read()
        super().send_response(code, message)

    def content_length(self, limit: int, *, required: bool = True) -> int:
        """The request's Content-Length, checked before any of the body is read: RequestError
        411 when missing (0 when not `required`), 400 when not a plain decimal number (a
        negative one was read as "until the client closes"), 413 above `limit`."""
        value = self.headers.get("Content-Length")
        if value is None:
            if required and self.headers.get("Transfer-Encoding"):
                raise RequestError(411, "send the body with a Content-Length (no chunked encoding)")
            if required:
                raise RequestError(411, "a Content-Length header is required")
            return 0
        value = value.strip()
        if not value.isascii() or not value.isdigit() or len(value) > 18:
            raise RequestError(400, f"Content-Length {value[:32]!r} is not a byte count")
        length = int(value)
        if length > limit:
            raise RequestError(413, f"a body of {length} bytes is over the limit of {limit}")
        return length

    def read_body(self, limit: int, *, required: bool = True) -> bytes:
        """The whole body (content_length()'s checks first); RequestError 400 when the client
        sends less than it announced."""
        length = self.content_length(limit, required=required)
        body = self.rfile.read(length)
        if len(body) != length:
            raise RequestError(400, f"the body ended after {len(body)} of {length} bytes")
        self.request_read()
        return body
