"""`adb reverse` without an adb server: a port of this host appears on the phone as
http://localhost:P, a secure context, so the phone's Chrome offers WebGPU to the farm's page.

A ReverseTunnel owns a second ADB connection to the phone (adb-shell's AdbDevice drops
messages for streams it did not open, so it cannot take the phone's OPENs; the tunnel uses it
for the CNXN/AUTH handshake only, then reads and writes messages itself). Over it the tunnel
registers `reverse:forward:tcp:P;tcp:H` with adbd and runs a message pump:

    an app on the phone connects to localhost:P
      -> adbd sends OPEN(phone id, 0, "tcp:H") on this connection
      -> the tunnel connects to its target (127.0.0.1:H) and answers OKAY(our id, phone id),
         or CLSE(0, phone id) when the target refuses
      -> bytes flow as WRTE/OKAY, one WRTE in flight per direction; either side's CLSE ends it

(an OPEN of anything but tcp:H is refused: the phone reaches only what was forwarded)

adbd forgets a forward when the connection that made it closes. When the connection drops,
every relayed connection is reset on this side too (the target sees an error, and the phone's
app gets no more bytes: a short body is never passed off as whole), and ensure() connects
and registers again, so the page's next request (or its retry of a cut one) goes through.
Every wait has a time limit, except a relay that is idle on both sides."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from adb_shell import constants
from adb_shell import exceptions as adb_errors
from adb_shell.adb_device import AdbDevice
from adb_shell.adb_message import AdbMessage, checksum, unpack

from orchestrator.transports.adb import AdbTransport
from orchestrator.transports.base import (
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    TransportError,
)

log = logging.getLogger("orchestrator.transports.adb_reverse")

POLL_S = 0.5  # how often a waiting thread looks whether its stream or tunnel has ended
OPEN, OKAY, WRTE, CLSE, CNXN, AUTH = (constants.OPEN, constants.OKAY, constants.WRTE, constants.CLSE,
                                      constants.CNXN, constants.AUTH)


class _Link:
    """ADB messages on an adb-shell transport that has done the handshake. Whole messages are
    written under one lock (header and payload in one buffer: streams never interleave inside
    a message); only the pump thread reads. adb-shell negotiates protocol version 0x01000000,
    so payloads carry real checksums both ways."""

    def __init__(self, handle, maxdata: int, timeout_s: float):
        self.handle = handle
        self.maxdata = maxdata
        self.timeout_s = timeout_s
        self.closed = False
        self._write_lock = threading.Lock()

    def send(self, command: bytes, arg0: int, arg1: int, data: bytes = b"") -> None:
        """Raises ConnectionError when the message could not be sent whole."""
        buf = memoryview(AdbMessage(command, arg0, arg1, data).pack() + data)
        with self._write_lock:
            try:
                while buf:
                    if self.closed:
                        raise ConnectionError("the tunnel's connection is closed")
                    sent = self.handle.bulk_write(buf, self.timeout_s)
                    buf = buf[len(buf) if sent is None else sent:]
            except ConnectionError:
                raise
            except Exception as exc:  # a timeout, a reset, a handle closed under us: the link is gone
                raise ConnectionError(f"sending {command.decode()}: {exc or type(exc).__name__}") from exc

    def receive(self) -> tuple[bytes, int, int, bytes] | None:
        """The next message (command, arg0, arg1, payload), or None when none began within
        POLL_S. A message that stops half-way for timeout_s raises TimeoutError."""
        header = self._read(constants.MESSAGE_SIZE, idle_ok=True)
        if header is None:
            return None
        wire, arg0, arg1, length, check = unpack(header)
        command = constants.WIRE_TO_ID.get(wire)
        magic = struct.unpack_from("<I", header, 20)[0]
        if command is None or magic != wire ^ 0xFFFFFFFF:
            raise ValueError(f"garbled ADB header {header.hex()}")
        if length > max(self.maxdata, constants.MAX_ADB_DATA):
            raise ValueError(f"a {command.decode()} of {length} bytes, more than the {self.maxdata} agreed")
        data = self._read(length) if length else b""
        if checksum(data) != check:
            raise ValueError(f"bad checksum on {command.decode()}")
        return command, arg0, arg1, data

    def _read(self, n: int, idle_ok: bool = False) -> bytes | None:
        buf = bytearray()
        started = time.monotonic()
        while len(buf) < n:
            if self.closed:
                raise ConnectionError("the tunnel's connection is closed")
            try:
                chunk = self.handle.bulk_read(n - len(buf), POLL_S)
            except Exception as exc:
                if not _is_timeout(exc):
                    raise
                if idle_ok and not buf:
                    return None
                if time.monotonic() - started > self.timeout_s:
                    raise TimeoutError(f"the phone sent {len(buf)} of {n} bytes and stopped") from None
                continue
            if not chunk:
                raise ConnectionResetError("the phone closed the connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(Exception):
            self.handle.close()


def _is_timeout(exc: Exception) -> bool:
    if isinstance(exc, (adb_errors.TcpTimeoutException, TimeoutError)):
        return True
    usb = getattr(exc, "usb_error", None)  # libusb1's USBErrorTimeout, without importing usb1
    return usb is not None and type(usb).__name__ == "USBErrorTimeout"


class _Call:
    """A short exchange with an adbd service (reverse:...): the reply, read up to the CLSE."""

    def __init__(self, local_id: int):
        self.local_id = local_id
        self.remote_id = 0
        self.reply = bytearray()
        self.done = threading.Event()
        self.refused = False
        self.error: BaseException | None = None

    def on_okay(self, remote_id: int) -> None:
        self.remote_id = self.remote_id or remote_id

    def on_write(self, data: bytes, link: _Link) -> None:
        self.reply += data
        link.send(OKAY, self.local_id, self.remote_id)

    def on_close(self, remote_id: int) -> None:
        self.refused = not self.remote_id and not remote_id
        self.done.set()

    def on_lost(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


class _Relay:
    """One connection an app opened to the phone's port P, carried to the target socket:
    uplink (target -> phone) on the thread that accepted it, downlink (phone -> target) on
    its own thread."""

    def __init__(self, tunnel: ReverseTunnel, link: _Link, local_id: int, remote_id: int, sock: socket.socket):
        self.tunnel, self.link, self.sock = tunnel, link, sock
        self.local_id, self.remote_id = local_id, remote_id
        self.acked = threading.Event()  # our last WRTE was acknowledged
        self.acked.set()
        self.inbox: queue.Queue[bytes | None] = queue.Queue()  # the phone's WRTEs; None: stop
        self.lost = False
        self._done = False  # a CLSE went either way, or the connection was lost
        self._lock = threading.Lock()

    # ---- from the pump ------------------------------------------------------------------------

    def on_okay(self, remote_id: int) -> None:
        self.acked.set()

    def on_write(self, data: bytes, link: _Link) -> None:
        self.inbox.put(data)  # acknowledged by downlink once the target took it

    def on_close(self, remote_id: int) -> None:
        """The app closed: what it sent before goes to the target, then the target's socket closes."""
        with self._lock:
            self._done = True
        self.inbox.put(None)
        self.acked.set()

    def on_lost(self, error: BaseException) -> None:
        with self._lock:
            self._done = self.lost = True
        self.inbox.put(None)
        self.acked.set()
        _reset(self.sock)

    # ---- the two directions ---------------------------------------------------------------------

    def uplink(self) -> None:
        reset = False
        try:
            while not self._done:
                if not select.select([self.sock], [], [], POLL_S)[0]:
                    continue
                data = self.sock.recv(self.link.maxdata)
                if not data:
                    break  # the target closed: CLSE once the phone has the rest
                if not self._wait_acked():
                    return
                self.acked.clear()
                self.link.send(WRTE, self.local_id, self.remote_id, data)
        except ConnectionError as exc:
            if isinstance(exc, ConnectionResetError) and not self._done:
                reset = True  # the target reset
            else:
                return  # the link failed: the pump sees it too and ends every stream
        except (OSError, ValueError):  # the socket was closed under select or recv
            reset = not self._done
        self._target_closed(reset)

    def downlink(self) -> None:
        while True:
            try:
                data = self.inbox.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if data is None:
                break
            try:
                self.sock.sendall(data)
            except OSError:  # the target went away or stopped reading for stall_s
                self._target_closed(reset=True)
                return
            with contextlib.suppress(ConnectionError):  # a dead link: the pump ends the stream
                self.link.send(OKAY, self.local_id, self.remote_id)
        if not self.lost:
            _close(self.sock)

    def _wait_acked(self) -> bool:
        deadline = time.monotonic() + self.tunnel.stall_s
        while not self.acked.wait(POLL_S):
            if time.monotonic() > deadline:
                log.warning("%s: the phone took no data on stream %d for %g s; closing it",
                            self.tunnel.name, self.local_id, self.tunnel.stall_s)
                self._target_closed(reset=True, wait=False)
                return False
        return not self._done

    def _target_closed(self, reset: bool, wait: bool = True) -> None:
        """End the stream from this side: CLSE after our last WRTE is acknowledged (adbd's
        order), then close (or reset) the target's socket."""
        if wait:
            self._wait_acked()
        with self._lock:
            if self._done:
                return
            self._done = True
        self.tunnel._forget(self.local_id)
        with contextlib.suppress(ConnectionError):
            self.link.send(CLSE, self.local_id, self.remote_id)
        self.inbox.put(None)
        (_reset if reset else _close)(self.sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it
    sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with RST: the peer must see an error, not an end of data."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(sock)


class ReverseTunnel:
    """The phone's localhost:`device_port` reaching `target` (default 127.0.0.1:`host_port`)
    on this host. `connect` returns a connected AdbDevice (handshake done) on a connection of
    the tunnel's own, each time it is called; ReverseTunnel.over(adb_transport, ...) makes one
    from an AdbTransport's address, key and time limits. `device_port` 0 lets the phone pick
    (device_port holds its choice afterwards, and keeps it across reconnections).

    open() (or ensure()) connects and registers; ensure() checks, with one round trip, that
    the forward is still registered on a live connection, and connects and registers again
    when not; close() removes the forward and ends every relayed connection. Thread-safe."""

    def __init__(self, connect: Callable[[], AdbDevice], device_port: int, host_port: int, *,
                 target: tuple[str, int] | None = None, name: str = "adb", timeout_s: float = 10.0,
                 connect_timeout_s: float = 5.0, stall_s: float = 60.0):
        self._open_device = connect
        self.device_port, self.host_port = device_port, host_port
        self.target = target or ("127.0.0.1", host_port)
        self.name = name
        self.timeout_s, self.connect_timeout_s, self.stall_s = timeout_s, connect_timeout_s, stall_s
        self.connections_relayed = 0  # phone-side connections accepted since the tunnel was made
        self.drops = 0  # ADB connections lost under the tunnel
        self._link: _Link | None = None
        self._streams: dict[int, _Call | _Relay] = {}
        self._ids = itertools.count(1)
        self._state = threading.Lock()  # _link and _streams; never held while waiting
        self._busy = threading.RLock()  # one ensure() or close() at a time
        self._lost = threading.Event()
        self._closed = False
        self._pump: threading.Thread | None = None

    @classmethod
    def over(cls, adb: AdbTransport, device_port: int, host_port: int, **kw) -> ReverseTunnel:
        """A tunnel on its own connection to the phone `adb` reaches: the same address, RSA key
        and time limits. (Over USB a second connection is not possible: one host claims the
        interface; a USB tunnel must share the transport's connection.)"""
        own = AdbTransport(adb.host, adb.port, usb_serial=adb.usb_serial, key_path=adb.key_path,
                           timeout_s=adb.timeout_s, auth_timeout_s=adb.auth_timeout_s,
                           tcp_nodelay=adb.tcp_nodelay, name=adb.name)

        def connect() -> AdbDevice:
            own.close()
            return own._connect()  # its errors are already the transport's

        kw.setdefault("timeout_s", adb.timeout_s)
        return cls(connect, device_port, host_port, name=adb.name, **kw)

    # ---- the caller's side ----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the tunnel holds a connection it has not seen fail."""
        link = self._link
        return link is not None and not link.closed

    @property
    def open_streams(self) -> int:
        with self._state:
            return sum(isinstance(s, _Relay) for s in self._streams.values())

    def wait_lost(self, timeout_s: float) -> bool:
        """Wait until the tunnel's connection is lost (True) or `timeout_s` passes (False)."""
        return self._lost.wait(timeout_s)

    def open(self) -> ReverseTunnel:
        self.ensure()
        return self

    def ensure(self) -> None:
        """Make sure the forward is registered on a live connection: one list-forward round trip
        when the tunnel has a connection; a new connection and registration when it has none or
        the round trip fails. Raises DeviceOffline, DeviceUnauthorized, DeviceTimeout or
        TransportError (the phone refused the forward, with adbd's reason)."""
        with self._busy:
            if self._closed:
                raise TransportError(self.name, "the reverse tunnel is closed; make a new one")
            link = self._link
            if link is not None and not link.closed:
                try:
                    if self._registered(link):
                        return
                    self._register(link)
                    return
                except (DeviceOffline, DeviceTimeout) as exc:
                    log.info("%s: the reverse tunnel's connection failed (%s); connecting again", self.name, exc.detail)
                    self._drop(link, exc)
            self._register(self._connect())

    def forwards(self) -> list[str]:
        """adbd's list of reverse forwards ("SERIAL tcp:P tcp:H" lines), read on this connection."""
        with self._busy:
            link = self._link
            if link is None or link.closed:
                raise DeviceOffline(self.name, "the reverse tunnel is not connected (call ensure())")
            return self._list(link)

    def close(self) -> None:
        """Remove the forward from the phone (best effort) and end the connection and every
        relayed connection."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
            link = self._link
            if link is not None and not link.closed:
                with contextlib.suppress(TransportError):
                    self._call(link, f"reverse:killforward:tcp:{self.device_port}", min(self.timeout_s, 5.0))
            if link is not None:
                self._drop(link, ConnectionError("the tunnel was closed"))
            pump = self._pump
        if pump is not None and pump is not threading.current_thread():
            pump.join(timeout=POLL_S * 4)

    def __enter__(self) -> ReverseTunnel:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- connecting and registering -------------------------------------------------------------

    def _connect(self) -> _Link:
        try:
            device = self._open_device()
        except TransportError:
            raise
        except adb_errors.DeviceAuthError as exc:
            raise DeviceUnauthorized(self.name, f"reverse tunnel: {exc}") from None
        except (adb_errors.TcpTimeoutException, adb_errors.AdbTimeoutError, TimeoutError) as exc:
            raise DeviceTimeout(self.name, f"reverse tunnel: no answer ({exc})") from None
        except OSError as exc:
            raise DeviceOffline(self.name, f"reverse tunnel: {exc}") from None
        handle = device._io_manager._transport  # adb-shell keeps it private; the pump reads it directly
        link = _Link(handle, device._maxdata or constants.MAX_PUSH_DATA, self.timeout_s)
        with self._state:
            self._link = link
            self._lost.clear()
        self._pump = threading.Thread(target=self._run_pump, args=(link,), name=f"adb-reverse-{self.name}",
                                      daemon=True)
        self._pump.start()
        return link

    def _register(self, link: _Link) -> None:
        spec = f"tcp:{self.device_port};tcp:{self.host_port}"
        reply = self._call(link, f"reverse:forward:{spec}")
        if reply.startswith(b"OKAY"):
            if self.device_port == 0:
                self.device_port = int(_protocol_string(reply[4:]) or 0)
            log.info("%s: reverse forward tcp:%d -> %s:%d", self.name, self.device_port, *self.target)
            return
        message = _protocol_string(reply[4:]) if reply.startswith(b"FAIL") else repr(bytes(reply[:200]))
        raise TransportError(self.name, f"the phone refused `adb reverse {spec.replace(';', ' ')}`: {message}")

    def _registered(self, link: _Link) -> bool:
        wanted = [f"tcp:{self.device_port}", f"tcp:{self.host_port}"]
        return any(line.split()[1:] == wanted for line in self._list(link))

    def _list(self, link: _Link) -> list[str]:
        return _protocol_string(self._call(link, "reverse:list-forward")).splitlines()

    def _call(self, link: _Link, service: str, timeout_s: float | None = None) -> bytes:
        timeout_s = timeout_s or self.timeout_s
        call = _Call(next(self._ids))
        with self._state:
            if link is not self._link:
                raise DeviceOffline(self.name, f"{service}: the tunnel's connection is gone")
            self._streams[call.local_id] = call
        try:
            link.send(OPEN, call.local_id, 0, service.encode() + b"\0")
            if not call.done.wait(timeout_s):
                raise DeviceTimeout(self.name, f"{service}: no answer within {timeout_s:g} s")
        except ConnectionError as exc:
            raise DeviceOffline(self.name, f"{service}: connection lost ({exc})") from None
        finally:
            with self._state:
                self._streams.pop(call.local_id, None)
        if call.error is not None:
            raise DeviceOffline(self.name, f"{service}: connection lost ({call.error})")
        if call.refused:
            raise TransportError(self.name, f"the phone has no {service.split(':')[0]!r} service (adbd too old?)")
        return bytes(call.reply)

    # ---- the message pump -----------------------------------------------------------------------

    def _run_pump(self, link: _Link) -> None:
        error: BaseException = ConnectionError("closed")
        try:
            while not link.closed:
                message = link.receive()
                if message is not None:
                    self._dispatch(link, *message)
        except Exception as exc:  # the connection failed; whatever the cause, it is gone
            error = exc
        self._drop(link, error)

    def _dispatch(self, link: _Link, command: bytes, arg0: int, arg1: int, data: bytes) -> None:
        if command == OPEN:
            destination = data.rstrip(b"\0").decode("utf-8", "replace")
            if destination != f"tcp:{self.host_port}":  # only what we forwarded (adb checks this too)
                log.warning("%s: refused the phone's OPEN of %r", self.name, destination)
                link.send(CLSE, 0, arg0)
                return
            threading.Thread(target=self._accept, args=(link, arg0), name=f"adb-reverse-{self.name}-open",
                             daemon=True).start()
            return
        if command in (CNXN, AUTH):
            raise ConnectionError(f"the phone restarted the connection ({command.decode()})")
        with self._state:
            stream = self._streams.get(arg1)
            if stream is None or (stream.remote_id and arg0 and arg0 != stream.remote_id):
                return  # a stream already ended (e.g. the echo of our CLSE)
            if command == CLSE:
                del self._streams[arg1]
        if command == OKAY:
            stream.on_okay(arg0)
        elif command == WRTE:
            stream.on_write(data, link)
        elif command == CLSE:
            stream.on_close(arg0)

    def _accept(self, link: _Link, remote_id: int) -> None:
        """A phone-side connection: connect to the target, then OKAY and relay, or CLSE."""
        try:
            sock = socket.create_connection(self.target, timeout=self.connect_timeout_s)
        except OSError as exc:
            log.info("%s: %s:%d refused the phone's connection (%s)", self.name, *self.target, exc)
            with contextlib.suppress(ConnectionError):
                link.send(CLSE, 0, remote_id)
            return
        sock.settimeout(self.stall_s)  # bounds sendall to a target that stops reading
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        relay = _Relay(self, link, next(self._ids), remote_id, sock)
        with self._state:
            if link is not self._link:
                sock.close()
                return
            self._streams[relay.local_id] = relay
            self.connections_relayed += 1
        try:
            link.send(OKAY, relay.local_id, remote_id)
        except ConnectionError:
            return  # the pump ends the stream with the rest
        threading.Thread(target=relay.downlink, name=f"adb-reverse-{self.name}-down", daemon=True).start()
        relay.uplink()

    def _forget(self, local_id: int) -> None:
        with self._state:
            self._streams.pop(local_id, None)

    def _drop(self, link: _Link, error: BaseException) -> None:
        """The connection is over: close it, fail its calls and reset its relays (once)."""
        with self._state:
            if self._link is not link:
                return
            self._link = None
            streams, self._streams = list(self._streams.values()), {}
        link.close()
        if not self._closed:
            self.drops += 1
            log.warning("%s: the reverse tunnel lost its connection (%s); ensure() reconnects", self.name,
                        error or type(error).__name__)
        for stream in streams:
            stream.on_lost(error)
        self._lost.set()


def _protocol_string(data: bytes) -> str:
    """adb's length-prefixed string (four hex digits, then the text); "" when there is none."""
    if len(data) < 4:
        return ""
    try:
        n = int(data[:4], 16)
    except ValueError:
        return data.decode("utf-8", "replace")
    return data[4:4 + n].decode("utf-8", "replace")
