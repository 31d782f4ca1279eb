"""The device side of `adb reverse` on the virtual phone: adbd's list of reverse listeners
(the services reverse:forward:[norebind:]LOCAL;REMOTE, reverse:killforward:LOCAL,
reverse:killforward-all and reverse:list-forward, with adbd's replies) and the relay from a
listener to the host.

All virtual phones share this machine, so a phone's port P cannot be the host's port P: each
phone port gets a host port Q of its own, the same for the phone's lifetime (so a page opened
at http://localhost:Q keeps its origin, and its Cache Storage, between page opens). While P is
forwarded, Q listens, and each connection accepted there becomes a device-initiated
OPEN "tcp:H" on the ADB connection that registered the forward, as adbd's listener does.
While it is not, Q is bound but not listening, so a connection is refused, as on a phone with
nothing on P. A forward ends with its ADB connection; the relays on it end reset (RST), so a
client never takes a cut response for a whole one."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import struct
import threading
import urllib.parse
from dataclasses import dataclass

from agent.simulator import wire
from agent.simulator.device import Connection, Stream, StreamClosed

log = logging.getLogger("agent.simulator")

OPEN_TIMEOUT_S = 10.0  # how long an accepted connection waits for the host to answer its OPEN
CLOSE_TIMEOUT_S = 10.0  # how long a relay waits for its last WRTE's OKAY before it closes anyway
WEB_PORTS = {"http": 80, "https": 443}
LOOPBACK_NAMES = ("localhost", "127.0.0.1")


def protocol_string(text: str) -> bytes:
    """adb's length-prefixed string: four hex digits, then the bytes."""
    data = text.encode()
    return b"%04x" % len(data) + data


def fail(message: str) -> bytes:
    return b"FAIL" + protocol_string(message)


def tcp_port(spec: str) -> int | None:
    """The port of a "tcp:N" socket spec, None for anything else."""
    kind, _, port = spec.partition(":")
    if kind != "tcp" or not port.isdigit() or int(port) > 65535:
        return None
    return int(port)


@dataclass
class Forward:
    phone_port: int
    connect_to: str  # what the host is asked to open ("tcp:H")
    connection: Connection
    server: asyncio.AbstractServer


class ReverseForwards:
    """One phone's reverse listeners (global to the phone, like adbd's: any connection may list
    or remove them) and the host port standing for each phone port. host_port and host_url are
    safe from any thread; the rest runs on the phone's event loop."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._lock = threading.Lock()
        self._ports: dict[int, int] = {}  # phone port -> host port, for the phone's lifetime
        self._idle: dict[int, socket.socket] = {}  # phone port -> its host port, bound, not listening
        self._forwards: dict[int, Forward] = {}  # in the order they were made, as adbd lists them
        self._relays: set[asyncio.Task] = set()

    # ---- the host's view -------------------------------------------------------------------------

    def host_port(self, phone_port: int) -> int:
        """The host port that stands for the phone's `phone_port` (reserved on first use)."""
        with self._lock:
            if phone_port not in self._ports:
                sock = self._bind(0)
                self._ports[phone_port] = sock.getsockname()[1]
                self._idle[phone_port] = sock
            return self._ports[phone_port]

    def host_url(self, url: str) -> str:
        """`url` as the host must open it: http(s)://localhost:P/... or 127.0.0.1:P becomes the
        same URL on the host port standing for P; any other URL is returned as it is."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in WEB_PORTS or parts.hostname not in LOOPBACK_NAMES:
            return url
        try:
            port = parts.port or WEB_PORTS[parts.scheme]
        except ValueError:  # a port that is not a number: the browser will say so
            return url
        netloc = f"{parts.hostname}:{self.host_port(port)}"
        if "@" in parts.netloc:
            netloc = parts.netloc.rsplit("@", 1)[0] + "@" + netloc
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def forwarded(self) -> dict[int, str]:
        """Phone port -> what the host is asked to open, for every forward in place."""
        return {port: f.connect_to for port, f in dict(self._forwards).items()}  # a copy: other threads ask

    def listing(self) -> str:
        """`reverse:list-forward`'s text: adbd's "SERIAL LOCAL REMOTE" lines, SERIAL being the
        name adbd gives the connection that made the forward ("host-FD" over TCP)."""
        forwards = dict(self._forwards)
        return "".join(f"{f.connection.serial} tcp:{port} {f.connect_to}\n" for port, f in forwards.items())

    # ---- the services ----------------------------------------------------------------------------

    async def handle(self, command: str, conn: Connection) -> bytes:
        """The reply to `reverse:<command>` on `conn`, in adbd's words: OKAY (and, for tcp:0,
        the port it chose), FAIL and a message, or the listing."""
        if command == "list-forward":
            return protocol_string(self.listing())
        if command == "killforward-all":
            for port in list(self._forwards):
                self._stop(port)
            return b"OKAY"
        if command.startswith("killforward:"):
            local = command[len("killforward:"):]
            if not local or ";" in local:
                return fail(f"bad killforward: {local}")
            port = tcp_port(local)
            if port not in self._forwards:
                return fail(f"listener '{local}' not found")
            self._stop(port)
            return b"OKAY"
        if command.startswith("forward:"):
            return await self._forward(command[len("forward:"):], conn)
        return fail("not a reverse forwarding command")

    async def _forward(self, spec: str, conn: Connection) -> bytes:
        no_rebind = spec.startswith("norebind:")
        spec = spec.removeprefix("norebind:")
        pieces = spec.split(";")
        if len(pieces) != 2 or not all(pieces) or pieces[1].startswith("*"):
            return fail(f"bad forward: {spec}")
        local, remote = pieces
        port = tcp_port(local)
        if port is None:
            return fail(f"cannot bind listener: the virtual phone listens on tcp:PORT only, not {local}")
        existing = self._forwards.get(port)
        if existing is not None:
            if no_rebind:
                return fail("cannot rebind existing socket")
            existing.connect_to, existing.connection = remote, conn  # adbd moves it to this connection
            return b"OKAY"
        chosen = port == 0
        try:
            if chosen:  # tcp:0: the phone picks a port; its host port has the same number
                port = self._spare_port()
            server = await self._listen(port)
        except OSError as exc:
            return fail(f"cannot bind listener: {exc.strerror or exc}")
        self._forwards[port] = Forward(port, remote, conn, server)
        return b"OKAY" + (protocol_string(str(port)) if chosen else b"")

    def connection_closed(self, conn: Connection) -> None:
        for port in [p for p, f in self._forwards.items() if f.connection is conn]:
            self._stop(port)

    async def close(self) -> None:
        for port in list(self._forwards):
            self._stop(port)
        for task in list(self._relays):
            task.cancel()
        if self._relays:
            await asyncio.gather(*self._relays, return_exceptions=True)
        with self._lock:
            for sock in self._idle.values():
                sock.close()
            self._idle.clear()

    # ---- listening -------------------------------------------------------------------------------

    def _bind(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, port))
        except OSError:
            sock.close()
            raise
        return sock

    def _spare_port(self) -> int:
        with self._lock:
            for _ in range(8):
                sock = self._bind(0)
                port = sock.getsockname()[1]
                if port not in self._ports:  # else a phone port someone chose by number: try again
                    self._ports[port] = port
                    self._idle[port] = sock
                    return port
                sock.close()
        raise OSError(errno.EADDRINUSE, "Address already in use")

    async def _listen(self, phone_port: int) -> asyncio.AbstractServer:
        self.host_port(phone_port)
        with self._lock:
            sock = self._idle.pop(phone_port)
        sock.listen(128)
        sock.setblocking(False)
        return await asyncio.start_server(functools.partial(self._accepted, phone_port), sock=sock,
                                          limit=wire.MAX_PAYLOAD * 2)

    def _stop(self, phone_port: int) -> None:
        """End a forward: its listening socket closes (open relays go on, as with adbd) and its
        host port is bound again, not listening, so that it stays the phone's."""
        forward = self._forwards.pop(phone_port)
        forward.server.close()
        with self._lock:
            port = self._ports[phone_port]
            try:
                self._idle[phone_port] = self._bind(port)
            except OSError as exc:  # someone took it in between: the next forward gets another
                log.warning("host port %d of phone port %d could not be kept (%s)", port, phone_port, exc)
                del self._ports[phone_port]

    # ---- relaying --------------------------------------------------------------------------------

    async def _accepted(self, phone_port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._relays.add(task)
        try:
            forward = self._forwards.get(phone_port)
            stream = await forward.connection.open_stream(forward.connect_to, OPEN_TIMEOUT_S) if forward else None
            if stream is None:  # nothing answers on the host: adbd closes the app's socket
                writer.close()
                return
            await relay(stream, reader, writer)
        except asyncio.CancelledError:
            _reset(writer)
        finally:
            self._relays.discard(task)


async def relay(stream: Stream, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes both ways between an app's socket and a stream to the host until one side closes.
    An app's end of input closes the stream (ADB has no half-close); the host's CLSE closes the
    app's socket once what came before it is delivered; a lost ADB connection, or an app that
    resets, resets the other side."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn = stream.conn

    async def uplink() -> None:
        try:
            while data := await reader.read(conn.maxdata):
                await stream.write(data)
        except StreamClosed:
            return  # the host closed first: downlink ends the socket
        except ConnectionError:
            pass  # the app reset: the stream ends as if it had closed
        await _close_stream(stream)
        stream.inbox.put_nowait(None)  # nothing more goes to a socket that is going away

    async def downlink() -> bool:
        """True once the host closed and everything before its CLSE is delivered."""
        while (chunk := await stream.inbox.get()) is not None:
            if stream.lost:
                return False
            writer.write(chunk)
            await writer.drain()
            if not stream.closed:  # acknowledged once the app's socket took it: adbd's backpressure
                await conn.send(wire.Message(wire.OKAY, stream.local_id, stream.remote_id))
        return not stream.lost

    up = asyncio.ensure_future(uplink())
    whole = False
    try:
        whole = await downlink()
    except ConnectionError:
        pass
    finally:
        if whole:
            writer.close()  # FIN after the last byte
            try:
                await asyncio.wait_for(up, CLOSE_TIMEOUT_S)  # ends at the socket's end of input
            except (TimeoutError, ConnectionError):  # an app that never reads what is left
                _reset(writer)
        else:
            up.cancel()
            _reset(writer)
            if not stream.lost:
                await _close_stream(stream)


async def _close_stream(stream: Stream) -> None:
    try:
        await asyncio.wait_for(stream.close(), CLOSE_TIMEOUT_S)
    except TimeoutError:  # the host never acknowledged: close without waiting
        stream.closed = True
        stream.conn.streams.pop(stream.local_id, None)
        with contextlib.suppress(ConnectionError):
            await stream.conn.send(wire.Message(wire.CLSE, stream.local_id, stream.remote_id))


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST, not FIN: a peer that reads to the end of input must see an error."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
