"""One ADB connection shared by the transport's commands and the streams the phone opens, written
on the ADB protocol itself (../shared/notes/adb-facts.md: 24-byte headers; CNXN, AUTH, OPEN,
OKAY, WRTE, CLSE) with adb-shell's public pieces only: its message packing (AdbMessage, checksum,
unpack), constants, exceptions, transports (TCP, USB) and RSA signers.

SharedIO is the connection. The handshake (CNXN, then the RSA AUTH exchange when the phone asks)
reads the wire itself; from then on one reader thread takes every message off the wire and
routes it:

    OPEN (the phone opens a stream)              -> the StreamHandler listening for its
                                                    destination, or CLSE(0, id): refused
    to a local id >= DEVICE_STREAM_IDS           -> the handler that owns the id (a stream the
                                                    phone opened; dropped once it has ended)
    to a local id below                          -> the HostStream this host opened (a shell, a
                                                    sync session, a service), or dropped when it
                                                    is closing; a phone that keeps writing to
                                                    streams nobody reads is cut off
    CNXN or AUTH                                 -> the phone restarted: the connection is lost

Both kinds of stream hold the phone to ADB's flow control (one WRTE in flight per stream and
direction), so the host keeps at most one message per stream. Every message is written whole
(one bulk_write) under one lock; a write that fails part-way ends the connection. A lost
connection fails every waiting read and tells every handler. SharedAdbDevice is the commands on
it: connect, open a stream, push and pull (the sync service, adb_sync.py), and `service()` for
adbd's short calls (`reverse:...`). Used by orchestrator/transports/adb.py (every connection) and
adb_reverse.py (the tunnel)."""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from adb_shell import constants
from adb_shell import exceptions as adb_errors
from adb_shell.adb_message import AdbMessage, checksum, unpack

from orchestrator.transports import adb_sync

log = logging.getLogger("orchestrator.transports.adb")

CNXN, AUTH, OPEN, OKAY, WRTE, CLSE = (constants.CNXN, constants.AUTH, constants.OPEN, constants.OKAY,
                                      constants.WRTE, constants.CLSE)
POLL_S = 0.5  # how often the reader looks whether its connection is being closed
# Local stream ids from here up belong to streams the phone opened; the host's own count from 1
# and stay below (2**31 streams on one connection: never, in practice)
DEVICE_STREAM_IDS = 2**31
# What the phone may make this host hold (a phone is not trusted with the host's memory):
HOST_MAX_DATA = constants.MAX_ADB_DATA  # the largest message, as the host's CNXN announces (1 MiB)
MAX_PHONE_STREAMS = 64  # streams the phone opened, open or being opened, at once; more are refused
MAX_REFUSALS_QUEUED = 256  # refusals waiting to be sent; a phone that outruns them is cut off
# Messages to host stream ids that are neither open nor closing (a phone keeps to the protocol
# sends none): a few are forgiven, a phone that keeps sending them is cut off
MAX_STRAY_MESSAGES = 16
MAX_CLOSING = 1024  # host streams closed whose CLSE echo has not come; the oldest is forgotten
EMPTY_READS = 50  # a transport that keeps returning nothing at once has reached its end (TCP EOF)


class PhoneMisbehaved(adb_errors.InvalidResponseError):
    """The phone broke the protocol in a way that would make this host hold what it asks: a
    message over the size the host announced, a WRTE before its last was acknowledged, OPENs
    faster than they can be refused, messages to streams nobody reads. The connection is closed
    with this reason."""


class StreamHandler(Protocol):
    """Takes the streams a phone opens on a SharedAdbDevice's connection (adb_reverse.ReverseTunnel).
    on_open and on_message run on the connection's reader thread: they must return at once and
    never send (a reader that waits on a write can deadlock with a phone that waits on its own)."""

    def on_open(self, io: SharedIO, remote_id: int, destination: str) -> None: ...

    def on_message(self, command: bytes, arg0: int, arg1: int, data: bytes) -> None: ...

    def on_lost(self, io: SharedIO, error: BaseException) -> None: ...


class ServiceRefused(Exception):
    """The phone answered an OPEN with CLSE: it has no such service."""


class StreamClosed(adb_errors.InvalidResponseError):
    """The phone closed a stream in the middle of an exchange that needed its answer."""


class HostStream:
    """A stream this host opened (SharedAdbDevice.open). The reader delivers the phone's OKAY,
    WRTE and CLSE to it; read() takes the phone's next WRTE and acknowledges it (so the phone
    may send the next), write() sends one WRTE and waits for its OKAY, close() ends the stream."""

    def __init__(self, io: SharedIO, local_id: int, destination: str):
        self.io, self.local_id, self.destination = io, local_id, destination
        self.remote_id = 0
        self.opened = False  # the phone's OKAY to the OPEN came
        self.ended = False  # the phone's CLSE came
        self.acks = 0  # the phone's OKAYs to our WRTEs, not yet taken by write()
        self.inbox: collections.deque[bytes] = collections.deque()  # the phone's WRTE, until read()
        self._closed = False  # this side's CLSE went (or the phone's was answered)

    def deliver(self, command: bytes, arg0: int, data: bytes) -> None:
        """The reader's side, under the connection's lock: never blocks, never sends."""
        if command == OKAY:
            if self.opened:
                self.acks += 1
            else:
                self.opened, self.remote_id = True, arg0
        elif command == WRTE:
            if self.inbox:  # ADB: one WRTE in flight per stream and direction
                raise PhoneMisbehaved(f"the phone sent a WRTE on stream {self.local_id} ({self.destination[:40]}) "
                                      "before its last one was acknowledged (ADB's flow control): closing the "
                                      "connection")
            self.inbox.append(data)
        elif command == CLSE:
            self.ended = True

    def wait_open(self, timeout_s: float) -> None:
        self.io.wait(lambda: self.opened or self.ended, timeout_s, f"the phone's answer to OPEN {self.destination}")
        if not self.opened:
            self.io.forget(self)
            raise ServiceRefused(self.destination)

    def read(self, timeout_s: float) -> bytes | None:
        """The phone's next WRTE, or None once the phone has closed the stream (its CLSE answered).
        Raises AdbTimeoutError when nothing came within `timeout_s`."""
        self.io.wait(lambda: bool(self.inbox) or self.ended, timeout_s, f"data on {self.destination}")
        with self.io.arrived:
            data = self.inbox.popleft() if self.inbox else None
        if data is None:
            self.close()
            return None
        self.io.send(OKAY, self.local_id, self.remote_id)
        return data

    def until_close(self, timeout_s: float) -> Iterator[bytes]:
        """The phone's WRTEs until it closes the stream; each wait at most `timeout_s`."""
        while (data := self.read(timeout_s)) is not None:
            yield data

    def write(self, data: bytes, timeout_s: float) -> None:
        """One WRTE (at most the connection's maxdata), then wait for the phone's OKAY."""
        self.io.send(WRTE, self.local_id, self.remote_id, data)
        self.io.wait(lambda: self.acks > 0 or self.ended, timeout_s, f"the phone's OKAY on {self.destination}")
        with self.io.arrived:
            if self.acks:
                self.acks -= 1
                return
        raise StreamClosed(f"the phone closed {self.destination} while this host was writing to it")

    def close(self) -> None:
        """Send CLSE (once; an answer when the phone closed first). What the phone still sends to
        the stream before its own CLSE is dropped."""
        with self.io.arrived:
            if self._closed:
                return
            self._closed = True
        self.io.forget(self)
        if self.opened:
            with contextlib.suppress(ConnectionError, adb_errors.AdbTimeoutError):
                self.io.send(CLSE, self.local_id, self.remote_id)

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SharedIO:
    """The connection: the handshake, one reader thread that routes every message (the module's
    table), and writes of whole messages under one lock. When the connection ends (the phone, a
    garbled or misbehaving stream, close()), every waiting read raises and every handler hears
    on_lost; `error` says why."""

    def __init__(self, transport, timeout_s: float):
        self.transport = transport
        self.timeout_s = timeout_s
        self.maxdata = constants.MAX_LEGACY_ADB_DATA
        self.auth_requested = False  # the phone asked for AUTH in the last handshake
        self.arrived = threading.Condition()  # host streams, _error; notified on every change
        self._write_lock = threading.Lock()
        self._error: BaseException | None = None
        self._reader: threading.Thread | None = None
        self._streams: dict[int, HostStream] = {}
        self._closing: dict[int, None] = {}  # host stream ids this side closed, awaiting the phone's CLSE
        self._host_ids = itertools.count(1)
        self._strays = 0
        self._routes = threading.Lock()  # _listeners and _owners; never held while calling a handler
        self._listeners: dict[str, StreamHandler] = {}
        self._owners: dict[int, StreamHandler] = {}
        self._ids = itertools.count(DEVICE_STREAM_IDS)
        self._opening = 0  # the phone's OPENs handed to a handler that has not answered yet
        self._unacked: set[int] = set()  # phone-opened streams whose last WRTE awaits our OKAY
        self._refusals: queue.Queue[int] = queue.Queue(MAX_REFUSALS_QUEUED)
        self._refuser: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._reader is not None and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the connection ended; None while it lives."""
        return self._error

    # ---- the handshake -----------------------------------------------------------------------------

    def connect(self, rsa_keys: list | None, auth_timeout_s: float, banner: str) -> int:
        """Connect the transport and shake hands: CNXN, then (when the phone asks) sign its token
        with each key, and offer the first key's public half when none is known (the phone's
        'Allow USB debugging?' prompt: up to `auth_timeout_s`). Starts the reader; returns the
        message size both sides keep to."""
        if self._reader is not None or self._error is not None:
            raise RuntimeError("a SharedIO is one connection: make a new one to connect again")
        self.transport.connect(self.timeout_s)
        self.auth_requested = False
        self._write(CNXN, constants.VERSION, HOST_MAX_DATA, b"host::%s\0" % banner.encode())
        command, arg0, maxdata, payload = self._handshake_read((AUTH, CNXN), self.timeout_s)
        if command == AUTH:
            self.auth_requested = True
            if not rsa_keys:
                raise adb_errors.DeviceAuthError("the phone asks for authentication and no key was given")
            for key in rsa_keys:
                if arg0 != constants.AUTH_TOKEN:
                    raise adb_errors.InvalidResponseError(f"unexpected AUTH message of type {arg0}")
                self._write(AUTH, constants.AUTH_SIGNATURE, 0, key.Sign(payload))
                command, arg0, maxdata, payload = self._handshake_read((CNXN, AUTH), self.timeout_s)
                if command == CNXN:
                    break
            else:  # no key is known to the phone: offer one and wait for a person to allow it
                public = rsa_keys[0].GetPublicKey()
                public = public.encode() if isinstance(public, str) else bytes(public)
                self._write(AUTH, constants.AUTH_RSAPUBLICKEY, 0, public + b"\0")
                command, arg0, maxdata, payload = self._handshake_read((CNXN,), auth_timeout_s)
        if maxdata > HOST_MAX_DATA:  # ADB's rule: each side sends at most the smaller of the two
            log.info("the phone announced %d-byte messages; the host keeps to the %d it announced",
                     maxdata, HOST_MAX_DATA)
        self.maxdata = min(maxdata or constants.MAX_LEGACY_ADB_DATA, HOST_MAX_DATA)
        self._reader = threading.Thread(target=self._read_loop, name="adb-reader", daemon=True)
        self._reader.start()
        return self.maxdata

    def _handshake_read(self, expected: tuple[bytes, ...], timeout_s: float) -> tuple[bytes, int, int, bytes]:
        """The next message of an expected kind, before the reader runs (others are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._receive(deadline)
            if message is not None and message[0] in expected:
                return message

    # ---- streams this host opens -------------------------------------------------------------------

    def open(self, destination: str, timeout_s: float) -> HostStream:
        """OPEN `destination` and wait for the phone's OKAY; ServiceRefused on its CLSE."""
        with self.arrived:
            if self._error is not None:
                raise self._lost()
            local_id = next(self._host_ids)
            while local_id in self._streams or local_id in self._closing or local_id >= DEVICE_STREAM_IDS:
                if local_id >= DEVICE_STREAM_IDS:
                    self._host_ids = itertools.count(1)
                local_id = next(self._host_ids)
            stream = self._streams[local_id] = HostStream(self, local_id, destination)
        self.send(OPEN, local_id, 0, destination.encode() + b"\0")
        stream.wait_open(timeout_s)
        return stream

    def forget(self, stream: HostStream) -> None:
        """`stream` is done here: messages the phone still sends it are dropped until its CLSE."""
        with self.arrived:
            if self._streams.pop(stream.local_id, None) is not None and stream.opened and not stream.ended:
                self._closing[stream.local_id] = None
                if len(self._closing) > MAX_CLOSING:
                    del self._closing[next(iter(self._closing))]

    def wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Wait (under `arrived`) until `ready()`; AdbTimeoutError after `timeout_s`, the
        connection's error once it has ended."""
        deadline = time.monotonic() + timeout_s
        with self.arrived:
            while not ready():
                if self._error is not None:
                    raise self._lost()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise adb_errors.AdbTimeoutError(f"no {what} within {timeout_s:g} s")
                self.arrived.wait(left)

    # ---- streams the phone opens --------------------------------------------------------------------

    def listen(self, destination: str, handler: StreamHandler) -> None:
        """Hand the phone's OPENs of `destination` ("tcp:8790") to `handler`."""
        with self._routes:
            if self._error is not None:
                raise self._lost()
            current = self._listeners.get(destination)
            if current is not None and current is not handler:
                raise ValueError(f"another handler takes the phone's OPENs of {destination}")
            self._listeners[destination] = handler

    def unlisten(self, destination: str, handler: StreamHandler) -> None:
        with self._routes:
            if self._listeners.get(destination) is handler:
                del self._listeners[destination]

    def new_stream(self, handler: StreamHandler) -> int:
        """A local id for a stream the phone opened; its messages go to `handler` until end_stream."""
        with self._routes:
            if self._error is not None:
                raise self._lost()
            local_id = next(self._ids)
            self._owners[local_id] = handler
            self._opening = max(0, self._opening - 1)
            return local_id

    def end_stream(self, local_id: int) -> None:
        with self._routes:
            self._owners.pop(local_id, None)
            self._unacked.discard(local_id)

    def post(self, command: bytes, arg0: int, arg1: int, data: bytes = b"") -> None:
        """Send one message for a handler. Raises ConnectionError (itself, never a subclass: a
        handler tells the connection's failure from its own socket's reset) when the message could
        not be sent whole."""
        if command == OKAY and arg0 >= DEVICE_STREAM_IDS:
            with self._routes:  # before it leaves: the phone may answer with its next WRTE at once
                self._unacked.discard(arg0)
        elif command == CLSE and arg0 == 0:  # a handler refused the phone's OPEN
            with self._routes:
                self._opening = max(0, self._opening - 1)
        try:
            self.send(command, arg0, arg1, data)
        except Exception as exc:  # a timeout, a reset, a closed handle: the connection is gone
            raise ConnectionError(f"sending {command.decode()}: {exc or type(exc).__name__}") from exc

    # ---- writing ---------------------------------------------------------------------------------------

    def send(self, command: bytes, arg0: int, arg1: int, data: bytes = b"") -> None:
        """One whole message; a failed write ends the connection (the stream of messages is no
        longer whole)."""
        with self._write_lock:
            if self._error is not None:
                raise self._lost()
            try:
                self._write(command, arg0, arg1, data)
            except Exception as exc:
                self._fail(exc)
                raise

    def _write(self, command: bytes, arg0: int, arg1: int, data: bytes = b"") -> None:
        message = memoryview(AdbMessage(command, arg0, arg1, data).pack() + data)
        sent = 0
        while sent < len(message):  # a transport may take part of it (a TCP socket's full buffer)
            n = self.transport.bulk_write(message[sent:].tobytes(), self.timeout_s)
            sent += len(message) - sent if n is None else n

    # ---- the reader ---------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while self._error is None:
                message = self._receive(None)
                if message is not None:
                    self._route(*message)
        except Exception as exc:  # whatever the cause, the connection is gone
            self._fail(exc)

    def _route(self, command: bytes, arg0: int, arg1: int, data: bytes) -> None:
        if command in (CNXN, AUTH):
            raise ConnectionResetError(f"the phone restarted the connection ({command.decode()})")
        if command == OPEN:
            self._phone_opens(arg0, data.rstrip(b"\0").decode("utf-8", "replace"))
        elif arg1 >= DEVICE_STREAM_IDS:
            with self._routes:
                handler = self._owners.get(arg1)
                if handler is not None and command == WRTE:
                    if arg1 in self._unacked:  # ADB: one WRTE in flight per stream and direction
                        raise PhoneMisbehaved(f"the phone sent a WRTE on stream {arg1} before its last one was "
                                              "acknowledged (ADB's flow control): closing the connection")
                    self._unacked.add(arg1)
            if handler is not None:
                handler.on_message(command, arg0, arg1, data)
        else:
            with self.arrived:
                stream = self._streams.get(arg1)
                if stream is not None:
                    stream.deliver(command, arg0, data)
                    self.arrived.notify_all()
                elif arg1 in self._closing:
                    if command == CLSE:
                        del self._closing[arg1]
                else:
                    self._strays += 1
                    if self._strays > MAX_STRAY_MESSAGES:
                        raise PhoneMisbehaved(f"the phone sent {self._strays} messages to streams nobody reads "
                                              f"(the last a {command.decode()} to {arg1}): closing the connection")

    def _phone_opens(self, remote_id: int, destination: str) -> None:
        with self._routes:
            handler = self._listeners.get(destination)
            full = len(self._owners) + self._opening >= MAX_PHONE_STREAMS
            if handler is not None and not full:
                self._opening += 1
        if handler is not None and not full:
            handler.on_open(self, remote_id, destination)
            return
        log.warning("refused the phone's OPEN of %r: %s", destination[:100],
                    f"{MAX_PHONE_STREAMS} of its streams are open already" if handler is not None
                    else "nothing here takes it")
        self._refuse_later(remote_id)

    def _refuse_later(self, remote_id: int) -> None:
        """CLSE the phone's OPEN from the one refusing thread (the reader never sends); a phone
        whose OPENs outrun it is cut off, not given a thread each."""
        try:
            self._refusals.put_nowait(remote_id)
        except queue.Full:
            raise PhoneMisbehaved(f"the phone opened streams faster than {MAX_REFUSALS_QUEUED} refusals could be "
                                  "sent: closing the connection") from None
        if self._refuser is None:
            self._refuser = threading.Thread(target=self._refuse_loop, name="adb-refuser", daemon=True)
            self._refuser.start()

    def _refuse_loop(self) -> None:
        while self._error is None:
            try:
                remote_id = self._refusals.get(timeout=POLL_S)
            except queue.Empty:
                continue
            with contextlib.suppress(Exception):  # a failed send has ended the connection: the loop ends
                self.send(CLSE, 0, remote_id)

    def _receive(self, deadline: float | None) -> tuple[bytes, int, int, bytes] | None:
        """The next message. The reader (no deadline) gets None when none began within POLL_S;
        the handshake waits until `deadline`."""
        header = self._read_exact(constants.MESSAGE_SIZE, deadline)
        if header is None:
            return None
        wire, arg0, arg1, length, check = unpack(header)
        command = constants.WIRE_TO_ID.get(wire)
        if command is None or struct.unpack_from("<I", header, 20)[0] != wire ^ 0xFFFFFFFF:
            raise adb_errors.InvalidCommandError(f"garbled ADB header {header.hex()}")
        if length > HOST_MAX_DATA:  # never buffered: the phone announced more, the host did not
            raise PhoneMisbehaved(f"a {command.decode()} of {length} bytes, more than the {HOST_MAX_DATA} the host "
                                  "announced: closing the connection")
        data = self._read_exact(length, deadline or time.monotonic() + self.timeout_s) if length else b""
        if checksum(data) != check:  # the host announces version 0x01000000: payloads carry checksums
            raise adb_errors.InvalidChecksumError(f"bad checksum on {command.decode()}")
        return command, arg0, arg1, data

    def _read_exact(self, n: int, deadline: float | None) -> bytes | None:
        """`n` bytes, or None when `deadline` is None and nothing came within one poll. A message
        begun must end within the connection's time limit (or by `deadline`)."""
        buf = bytearray()
        started, empty = time.monotonic(), 0
        while len(buf) < n:
            if self._error is not None:
                raise ConnectionAbortedError("closed")
            try:
                got = self.transport.bulk_read(n - len(buf), POLL_S)
            except Exception as exc:
                if not _is_timeout(exc):
                    raise
                got = getattr(getattr(exc, "usb_error", None), "received", None) or b""  # libusb1 keeps a partial read
                if deadline is None and not buf and not got:
                    return None
            else:
                empty = 0 if got else empty + 1
                if empty >= EMPTY_READS:
                    raise ConnectionResetError("the phone closed the connection")
            buf += got
            now = time.monotonic()
            if deadline is not None and now > deadline and len(buf) < n:
                raise adb_errors.AdbTimeoutError(f"the phone sent {len(buf)} of {n} bytes by the deadline")
            if deadline is None and buf and now - started > self.timeout_s:
                raise adb_errors.AdbTimeoutError(f"the phone sent {len(buf)} of {n} bytes and stopped")
        return bytes(buf)

    # ---- the end --------------------------------------------------------------------------------------

    def close(self) -> None:
        self._fail(ConnectionAbortedError("the connection was closed"))
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(POLL_S * 4)  # before the handle closes: libusb must not close under a read
        with self._write_lock, contextlib.suppress(Exception):
            self.transport.close()

    def _fail(self, error: BaseException) -> None:
        """The connection is over (once): wake every read, tell every handler, and shut the
        transport down so that a thread blocked on it returns."""
        with self.arrived:
            if self._error is not None:
                return
            self._error = error
            self.arrived.notify_all()
        with self._routes:
            handlers = list({id(h): h for h in (*self._listeners.values(), *self._owners.values())}.values())
            self._listeners.clear()
            self._owners.clear()
        for handler in handlers:
            try:
                handler.on_lost(self, error)
            except Exception:
                log.exception("a stream handler failed on a lost connection")
        shutdown = getattr(self.transport, "shutdown", None)
        if shutdown is not None:
            with contextlib.suppress(OSError):
                shutdown()

    def _lost(self) -> Exception:
        """What a read or write on the ended connection raises: the class its cause calls for."""
        error = self._error
        if isinstance(error, adb_errors.AdbTimeoutError) or _is_timeout(error):
            return adb_errors.AdbTimeoutError(f"the connection stalled ({error})")
        if isinstance(error, (adb_errors.InvalidChecksumError, adb_errors.InvalidCommandError,
                              adb_errors.InvalidResponseError)):
            return type(error)(str(error))
        return ConnectionResetError(f"the connection is gone ({error or type(error).__name__})")


def _is_timeout(exc: BaseException | None) -> bool:
    if isinstance(exc, (adb_errors.TcpTimeoutException, TimeoutError)):
        return True
    usb = getattr(exc, "usb_error", None)  # libusb1's USBErrorTimeout, without importing usb1
    return usb is not None and type(usb).__name__ == "USBErrorTimeout"


class SharedAdbDevice:
    """A phone's ADB connection (a SharedIO on `transport`) and the commands on it: open a stream,
    push and pull files, call an adbd service. Its commands may run from several threads at once,
    and `io` takes the streams the phone opens (StreamHandler). `default_transport_timeout_s`
    bounds every wait but a stream's reads, which take their own limit."""

    def __init__(self, transport, default_transport_timeout_s: float = 10.0, banner: str | None = None):
        self.io = SharedIO(transport, default_transport_timeout_s)
        self.timeout_s = default_transport_timeout_s
        self.banner = banner or socket.gethostname()
        self._connected = False

    @property
    def alive(self) -> bool:
        """Connected, and the reader has not seen the connection fail."""
        return self._connected and self.io.alive

    def connect(self, rsa_keys: list | None = None, auth_timeout_s: float = 10.0) -> None:
        """Connect and authenticate with `rsa_keys` (adb-shell signers); see SharedIO.connect."""
        self._connected = False
        self.io.connect(rsa_keys, auth_timeout_s, self.banner)
        self._connected = True

    def close(self) -> None:
        self._connected = False
        self.io.close()

    def open(self, destination: str, timeout_s: float | None = None) -> HostStream:
        """A stream to the phone's service `destination` ("shell,v2,raw:ls", "sync:")."""
        return self.io.open(destination, timeout_s or self.timeout_s)

    def service(self, destination: str, timeout_s: float) -> bytes:
        """Open `destination` ("reverse:list-forward") and read its reply to the end. Raises
        ServiceRefused when the phone has no such service."""
        with self.open(destination, timeout_s) as stream:
            return b"".join(stream.until_close(timeout_s))

    def push(self, source: Path | str | bytes | BinaryIO, device_path: str, mode: int = 0o100644,
             progress: Callable[[int], None] | None = None, timeout_s: float | None = None) -> None:
        """Write `source` (a local file, bytes or a binary stream) to `device_path` with `mode`
        (S_IFREG included), through the sync service. SyncFailed carries the phone's refusal."""
        with contextlib.ExitStack() as stack:
            if isinstance(source, bytes):
                stream_in: BinaryIO = io.BytesIO(source)
            elif isinstance(source, (str, Path)):
                stream_in = stack.enter_context(open(source, "rb"))
            else:
                stream_in = source
            sync = stack.enter_context(self.open("sync:", timeout_s))
            adb_sync.push(sync, stream_in, device_path, mode, progress, self.io.maxdata, timeout_s or self.timeout_s)

    def pull(self, device_path: str, sink: BinaryIO, timeout_s: float | None = None) -> None:
        """Write the phone's `device_path` into `sink`, through the sync service. SyncFailed when
        the phone cannot read it (absent, a folder, no permission)."""
        with self.open("sync:", timeout_s) as sync:
            adb_sync.pull(sync, device_path, sink, timeout_s or self.timeout_s)
