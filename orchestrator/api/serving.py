"""Serving the farm API (`farm api serve`, `farm dashboard serve`) under uvicorn with bounds on
what a client can hold: uvicorn alone keeps a connection that never sends a request, or sends
its headers a byte at a time, open for ever (100 silent and 100 trickling connections were all
still open after 90 s). Here a connection must send a whole request head within
`api_request_deadline_s` of opening (or of its last answer), idle keep-alive connections close
after 5 s, and at most `api_max_connections` connections and requests are served at once (503
above it). Before uvicorn starts, `check_listen` tries the address: a port in use is one
line naming the fix (CannotListen), not uvicorn's bind error and shutdown logs."""

from __future__ import annotations

import asyncio
import errno
import socket

from uvicorn.protocols.http.h11_impl import H11Protocol

KEEP_ALIVE_S = 5.0


class _BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head."""

    deadline_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:  # a whole head arrived
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head has its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.deadline_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def bounded_protocol(deadline_s: float) -> type[H11Protocol]:
    return type("BoundedH11", (_BoundedH11,), {"deadline_s": deadline_s})


class CannotListen(Exception):
    """The address cannot be listened on; the message names it, why, and the fix."""


def check_listen(host: str, port: int) -> None:
    """Bind `host`:`port` as uvicorn will (SO_REUSEADDR) and let it go; CannotListen when it
    cannot be bound (a port in use, an address this host does not have, a port below 1024)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise CannotListen(f"cannot listen on {host!r}: {exc.strerror}: pick another with --host") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CannotListen(f"port {port} is in use on {host} (another farm api serve?): "
                                   "pick another with --port") from None
            raise CannotListen(f"cannot listen on {host}:{port}: {exc.strerror or exc}: "
                               "pick another with --host or --port") from None


def serve(app, host: str, port: int, settings) -> None:
    """Run `app` until interrupted, with the bounds above."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False,
                http=bounded_protocol(settings.api_request_deadline_s), timeout_keep_alive=KEEP_ALIVE_S,
                limit_concurrency=settings.api_max_connections)
