"""`adb reverse` without an adb server: a port of this host appears on the phone as
http://localhost:P, a secure context, so the phone's Chrome offers WebGPU to the farm's page.

A ReverseTunnel lives on an AdbTransport's connection: every connection the transport makes is
a SharedAdbDevice (adb.py), whose reader thread hands the tunnel the phone's OPENs and every
message of the streams they start, while the transport's own streams (shell, push, pull) run beside
them. ReverseTunnel.on(adb, ...) shares the transport's own connection; ReverseTunnel.over(adb,
...) makes a connection of its own to the same phone (TCP only: over USB one host claims the
interface, so a second connection is impossible); ReverseTunnel.for_transport picks on() over
USB and over() over TCP (see there why). On its connection the tunnel registers
`reverse:forward:tcp:P;tcp:H` with adbd, and then:

    an app on the phone connects to localhost:P
      -> adbd sends OPEN(phone id, 0, "tcp:H") on that connection
      -> the tunnel connects to its target (127.0.0.1:H) and answers OKAY(our id, phone id),
         or CLSE(0, phone id) when the target refuses
      -> bytes flow as WRTE/OKAY, one WRTE in flight per direction; either side's CLSE ends it

(an OPEN of anything but tcp:H is refused: the phone reaches only what was forwarded)

adbd forgets a forward when the connection that made it closes. When the connection drops,
every relayed connection is reset on this side too (the target sees an error, and the phone's
app gets no more bytes: a short body is never passed off as whole). The tunnel registers again
on each new connection the transport makes (its next command reconnects), and ensure() connects
and registers when asked, so the page's next request (or its retry of a cut one) goes through.
Every wait has a time limit, except a relay that is idle on both sides."""

from __future__ import annotations

import contextlib
import logging
import queue
import select
import socket
import struct
import threading
import time

from adb_shell import constants

from orchestrator.transports.adb import AdbTransport
from orchestrator.transports.adb_shared import ServiceRefused, SharedAdbDevice, SharedIO
from orchestrator.transports.base import DeviceOffline, DeviceTimeout, TransportError

log = logging.getLogger("orchestrator.transports.adb_reverse")

POLL_S = 0.5  # how often a waiting thread looks whether its stream or tunnel has ended
OKAY, WRTE, CLSE = constants.OKAY, constants.WRTE, constants.CLSE


class _Relay:
    """One connection an app opened to the phone's port P, carried to the target socket:
    uplink (target -> phone) on the thread that accepted it, downlink (phone -> target) on
    its own thread."""

    def __init__(self, tunnel: ReverseTunnel, io: SharedIO, local_id: int, remote_id: int, sock: socket.socket):
        self.tunnel, self.io, self.sock = tunnel, io, sock
        self.local_id, self.remote_id = local_id, remote_id
        self.acked = threading.Event()  # our last WRTE was acknowledged
        self.acked.set()
        self.inbox: queue.Queue[bytes | None] = queue.Queue()  # the phone's WRTEs; None: stop
        self.lost = False
        self._done = False  # a CLSE went either way, or the connection was lost
        self._lock = threading.Lock()

    # ---- from the connection's reader (never blocks, never sends) ------------------------------

    def on_okay(self) -> None:
        self.acked.set()

    def on_write(self, data: bytes) -> None:
        self.inbox.put(data)  # acknowledged by downlink once the target took it

    def on_close(self) -> None:
        """The app closed: what it sent before goes to the target, then the target's socket closes."""
        with self._lock:
            self._done = True
        self.inbox.put(None)
        self.acked.set()

    def on_lost(self) -> None:
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
                data = self.sock.recv(self.io.maxdata)
                if not data:
                    break  # the target closed: CLSE once the phone has the rest
                if not self._wait_acked():
                    return
                self.acked.clear()
                self.io.post(WRTE, self.local_id, self.remote_id, data)
        except ConnectionError as exc:
            if isinstance(exc, ConnectionResetError) and not self._done:
                reset = True  # the target reset
            else:
                return  # the connection failed: its reader ends every stream
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
            with contextlib.suppress(ConnectionError):  # a dead connection: its reader ends the stream
                self.io.post(OKAY, self.local_id, self.remote_id)
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
        self.tunnel._forget(self)
        with contextlib.suppress(ConnectionError):
            self.io.post(CLSE, self.local_id, self.remote_id)
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
    on this host, over `adb`'s connection (use on(), over() or for_transport()). `device_port`
    0 lets the phone pick (device_port holds its choice afterwards, and keeps it across
    reconnections).

    open() (or ensure()) connects and registers; ensure() checks, with one round trip, that
    the forward is still registered on a live connection, and connects and registers again
    when not; from the first ensure() on, the tunnel also registers on every new connection
    `adb` makes. close() removes the forward, ends every relayed connection and leaves a shared
    transport as it was. Thread-safe."""

    def __init__(self, adb: AdbTransport, device_port: int, host_port: int, *, own_connection: bool = False,
                 target: tuple[str, int] | None = None, timeout_s: float | None = None,
                 connect_timeout_s: float = 5.0, stall_s: float = 60.0):
        self.adb, self.own_connection = adb, own_connection
        self.device_port, self.host_port = device_port, host_port
        self.target = target or ("127.0.0.1", host_port)
        self.name = adb.name
        self.timeout_s = timeout_s or adb.timeout_s
        self.connect_timeout_s, self.stall_s = connect_timeout_s, stall_s
        self.connections_relayed = 0  # phone-side connections accepted since the tunnel was made
        self.drops = 0  # ADB connections lost under the tunnel
        self._destination = f"tcp:{host_port}"  # what adbd's OPENs name
        self._device: SharedAdbDevice | None = None  # the connection the tunnel listens on
        self._registered = False  # the forward is registered on _device
        self._streams: dict[int, _Relay] = {}
        self._state = threading.Lock()  # _device, _registered, _streams; never held while waiting
        self._busy = threading.RLock()  # one registration or close() at a time; taken after adb's connect lock
        self._lost = threading.Event()
        self._closed = False

    @classmethod
    def on(cls, adb: AdbTransport, device_port: int, host_port: int, **kw) -> ReverseTunnel:
        """A tunnel on `adb`'s own connection, beside its commands: the only way over USB."""
        return cls(adb, device_port, host_port, **kw)

    @classmethod
    def over(cls, adb: AdbTransport, device_port: int, host_port: int, **kw) -> ReverseTunnel:
        """A tunnel on a connection of its own to the phone `adb` reaches over TCP: the same
        address, RSA key and time limits."""
        if adb.host is None:
            raise TransportError(adb.name, "a second ADB connection over USB is not possible (one host claims "
                                 "the interface): use ReverseTunnel.on(adb, ...) to share the transport's")
        own = AdbTransport(adb.host, adb.port, key_path=adb.key_path, timeout_s=adb.timeout_s,
                           auth_timeout_s=adb.auth_timeout_s, tcp_nodelay=adb.tcp_nodelay, name=adb.name)
        return cls(own, device_port, host_port, own_connection=True, **kw)

    @classmethod
    def for_transport(cls, adb: AdbTransport, device_port: int, host_port: int, **kw) -> ReverseTunnel:
        """The default: shared over USB, where nothing else is possible; a connection of its own
        over TCP, where a second one costs nothing. Apart, the page's traffic and the transport's
        commands do not fail together: the transport closes its connection on any failed exchange
        (a command timing out included), which would reset the page's fetches in flight, and a
        tunnel's stalled connection would take the job's shell with it."""
        return cls.on(adb, device_port, host_port, **kw) if adb.host is None else \
            cls.over(adb, device_port, host_port, **kw)

    # ---- the caller's side ----------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the forward is registered on a connection the tunnel has not seen fail."""
        device = self._device
        return device is not None and device.alive and self._registered

    @property
    def open_streams(self) -> int:
        with self._state:
            return len(self._streams)

    def wait_lost(self, timeout_s: float) -> bool:
        """Wait until the tunnel's connection is lost (True) or `timeout_s` passes (False)."""
        return self._lost.wait(timeout_s)

    def open(self) -> ReverseTunnel:
        self.ensure()
        return self

    def ensure(self) -> None:
        """Make sure the forward is registered on a live connection: one list-forward round trip
        when it is; a new connection (when the transport has none) and a registration when it is
        not. Raises DeviceOffline, DeviceUnauthorized, DeviceTimeout or TransportError (the phone
        refused the forward, with adbd's reason)."""
        self._check_open()
        self.adb.add_connect_listener(self._connected)
        for attempt in range(2):
            device = self.adb.connection()  # never under _busy: the transport's connect lock comes first
            with self._busy:
                self._check_open()
                try:
                    if device is self._device and self._registered and device.alive and self._is_registered(device):
                        return
                    self._register_on(device)
                    return
                except (DeviceOffline, DeviceTimeout) as exc:  # the exchange closed that connection
                    if attempt:
                        raise
                    log.info("%s: the reverse tunnel's connection failed (%s); connecting again", self.name, exc.detail)

    def forwards(self) -> list[str]:
        """adbd's list of reverse forwards ("SERIAL tcp:P tcp:H" lines), read on this connection."""
        with self._busy:
            device = self._device
            if device is None or not device.alive:
                raise DeviceOffline(self.name, "the reverse tunnel is not connected (call ensure())")
            return self._list(device)

    def close(self) -> None:
        """Remove the forward from the phone (best effort) and end every relayed connection; a
        shared transport stays connected and usable, a connection of the tunnel's own closes."""
        with self._busy:
            if self._closed:
                return
            self._closed = True
            self.adb.remove_connect_listener(self._connected)
            device = self._device
            if device is not None and device.alive and self._registered:
                with contextlib.suppress(TransportError):
                    self._call(device, f"reverse:killforward:tcp:{self.device_port}", min(self.timeout_s, 5.0))
            with self._state:
                self._device, self._registered = None, False
                relays = list(self._streams.values())
            if device is not None:
                device.io.unlisten(self._destination, self)
        for relay in relays:
            relay._target_closed(reset=True, wait=False)
        if self.own_connection:
            self.adb.close()
        self._lost.set()

    def __enter__(self) -> ReverseTunnel:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- registering ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(self.name, "the reverse tunnel is closed; make a new one")

    def _connected(self, device: SharedAdbDevice) -> None:
        """The transport made a new connection: the forward ended with the old one; register it
        on this one before any command runs on it."""
        with self._busy:
            if self._closed:
                return
            try:
                self._register_on(device)
            except TransportError as exc:
                log.warning("%s: the reverse forward could not be registered on the new connection (%s); "
                            "ensure() tries again", self.name, exc.detail)

    def _register_on(self, device: SharedAdbDevice) -> None:
        """Listen for the phone's OPENs on `device` (before the forward exists: none is missed),
        then register the forward there."""
        with self._state:
            if self._device is not device:
                old, self._device, self._registered = self._device, device, False
                if old is not None:
                    old.io.unlisten(self._destination, self)
                self._lost.clear()
        try:
            device.io.listen(self._destination, self)
        except ConnectionError as exc:
            raise DeviceOffline(self.name, f"reverse tunnel: connection lost ({exc})") from None
        spec = f"tcp:{self.device_port};tcp:{self.host_port}"
        reply = self._call(device, f"reverse:forward:{spec}")
        if not reply.startswith(b"OKAY"):
            message = _protocol_string(reply[4:]) if reply.startswith(b"FAIL") else repr(reply[:200])
            raise TransportError(self.name, f"the phone refused `adb reverse {spec.replace(';', ' ')}`: {message}")
        if self.device_port == 0:
            self.device_port = int(_protocol_string(reply[4:]) or 0)
        with self._state:
            self._registered = self._device is device
        log.info("%s: reverse forward tcp:%d -> %s:%d", self.name, self.device_port, *self.target)

    def _is_registered(self, device: SharedAdbDevice) -> bool:
        wanted = [f"tcp:{self.device_port}", f"tcp:{self.host_port}"]
        return any(line.split()[1:] == wanted for line in self._list(device))

    def _list(self, device: SharedAdbDevice) -> list[str]:
        return _protocol_string(self._call(device, "reverse:list-forward")).splitlines()

    def _call(self, device: SharedAdbDevice, service: str, timeout_s: float | None = None) -> bytes:
        """One exchange with an adbd service, on a stream of its own; a failure closes the
        connection (the transport's rule), which every stream on it then sees."""
        try:
            with self.adb._errors(service, device):
                return device.service(service, timeout_s or self.timeout_s)
        except ServiceRefused:
            raise TransportError(self.name, f"the phone has no {service.split(':')[0]!r} service (adbd too old?)") \
                from None

    # ---- the phone's streams (StreamHandler: called on the connection's reader thread) -----------

    def on_open(self, io: SharedIO, remote_id: int, destination: str) -> None:
        threading.Thread(target=self._accept, args=(io, remote_id), name=f"adb-reverse-{self.name}-open",
                         daemon=True).start()

    def on_message(self, command: bytes, arg0: int, arg1: int, data: bytes) -> None:
        with self._state:
            relay = self._streams.get(arg1)
            if relay is None or (arg0 and arg0 != relay.remote_id):
                return  # a stream already ended (e.g. the echo of our CLSE)
            if command == CLSE:
                del self._streams[arg1]
        if command == OKAY:
            relay.on_okay()
        elif command == WRTE:
            relay.on_write(data)
        elif command == CLSE:
            relay.io.end_stream(arg1)
            relay.on_close()

    def on_lost(self, io: SharedIO, error: BaseException) -> None:
        """The connection is over: reset its relays (once)."""
        with self._state:
            device = self._device
            if device is None or device.io is not io:
                return
            self._registered = False
            relays, self._streams = list(self._streams.values()), {}
        if not self._closed:
            self.drops += 1
            log.warning("%s: the reverse tunnel lost its connection (%s); the transport's next connection "
                        "registers the forward again", self.name, error or type(error).__name__)
        for relay in relays:
            relay.on_lost()
        self._lost.set()

    def _accept(self, io: SharedIO, remote_id: int) -> None:
        """A phone-side connection: connect to the target, then OKAY and relay, or CLSE."""
        try:
            sock = socket.create_connection(self.target, timeout=self.connect_timeout_s)
        except OSError as exc:
            log.info("%s: %s:%d refused the phone's connection (%s)", self.name, *self.target, exc)
            with contextlib.suppress(ConnectionError):
                io.post(CLSE, 0, remote_id)
            return
        sock.settimeout(self.stall_s)  # bounds sendall to a target that stops reading
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._state:
            try:
                if self._device is None or self._device.io is not io:
                    raise ConnectionAbortedError("the tunnel left this connection")
                relay = _Relay(self, io, io.new_stream(self), remote_id, sock)
            except ConnectionError:
                sock.close()
                return
            self._streams[relay.local_id] = relay
            self.connections_relayed += 1
        try:
            io.post(OKAY, relay.local_id, remote_id)
        except ConnectionError:
            return  # the reader ends the stream with the rest
        threading.Thread(target=relay.downlink, name=f"adb-reverse-{self.name}-down", daemon=True).start()
        relay.uplink()

    def _forget(self, relay: _Relay) -> None:
        with self._state:
            if self._streams.get(relay.local_id) is relay:
                del self._streams[relay.local_id]
        relay.io.end_stream(relay.local_id)


def _protocol_string(data: bytes) -> str:
    """adb's length-prefixed string (four hex digits, then the text); "" when there is none."""
    if len(data) < 4:
        return ""
    try:
        n = int(data[:4], 16)
    except ValueError:
        return data.decode("utf-8", "replace")
    return data[4:4 + n].decode("utf-8", "replace")
