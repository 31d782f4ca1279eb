"""One ADB connection shared by the transport's commands and the streams the phone opens.

adb-shell 0.4.4 has no reader thread: whichever command waits reads the socket, holding the lock
writes also take, and a message for a stream it did not open (a phone's OPEN for an `adb
reverse` forward) is stored and never read. SharedIO gives each connection one reader thread
that takes every message off the wire and routes it: an OPEN to the handler listening for its
destination (refused with CLSE when none is), messages to the ids of streams the phone opened
(DEVICE_STREAM_IDS and up, which adb-shell never reaches) to their handler, the rest to adb-shell's
packet store, where its own commands wait for them. Every write, adb-shell's and the handlers',
goes through adb-shell's transport lock; a write that fails part-way ends the connection. A lost
connection fails every waiting command and tells every handler. SharedAdbDevice is adb-shell's
AdbDevice on it, with `service()` for adbd's short calls (`reverse:...`). Used by
orchestrator/transports/adb.py (every connection) and adb_reverse.py (the tunnel)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import struct
import threading
import time
from typing import Protocol

from adb_shell import constants
from adb_shell import exceptions as adb_errors
from adb_shell.adb_device import AdbDevice, _AdbIOManager
from adb_shell.adb_message import AdbMessage, checksum, unpack
from adb_shell.hidden_helpers import Queue as _StoreQueue
from adb_shell.hidden_helpers import _AdbPacketStore, _AdbTransactionInfo

log = logging.getLogger("orchestrator.transports.adb")

POLL_S = 0.5  # how often the reader looks whether its connection is being closed
# Local stream ids from here up belong to streams the phone opened; adb-shell counts its own from 1
# and SharedAdbDevice keeps them below (2**31 streams on one connection: never, in practice)
DEVICE_STREAM_IDS = 2**31
# What the phone may make this host hold (a phone is not trusted with the host's memory):
HOST_MAX_DATA = constants.MAX_ADB_DATA  # the largest message, as the host's CNXN announces (1 MiB)
MAX_PHONE_STREAMS = 64  # streams the phone opened, open or being opened, at once; more are refused
MAX_REFUSALS_QUEUED = 256  # refusals waiting to be sent; a phone that outruns them is cut off
MAX_HELD_BYTES = 16 * 2**20  # unread messages of adb-shell's streams (a shell's output, a pull)


class PhoneMisbehaved(adb_errors.InvalidResponseError):
    """The phone broke the protocol in a way that would make this host hold what it asks: a
    message over the size the host announced, a WRTE before its last was acknowledged, OPENs
    faster than they can be refused. The connection is closed with this reason."""

class StreamHandler(Protocol):
    """Takes the streams a phone opens on a SharedAdbDevice's connection (adb_reverse.ReverseTunnel).
    on_open and on_message run on the connection's reader thread: they must return at once and
    never send (a reader that waits on a write can deadlock with a phone that waits on its own)."""

    def on_open(self, io: SharedIO, remote_id: int, destination: str) -> None: ...

    def on_message(self, command: bytes, arg0: int, arg1: int, data: bytes) -> None: ...

    def on_lost(self, io: SharedIO, error: BaseException) -> None: ...


class ServiceRefused(Exception):
    """The phone answered an OPEN with CLSE: it has no such service."""


class _Store(_AdbPacketStore):
    """adb-shell's packet store, except that a refusal (CLSE(0, local id): the answer to an OPEN)
    is kept although the stream has no entry yet (adb-shell's drops a CLSE for a stream it holds
    nothing of, which is right only when the stream's owner reads its own packets)."""

    def put(self, arg0, arg1, cmd, data):
        if cmd == constants.CLSE and arg0 == 0 and arg0 not in self._dict.get(arg1, {}):
            self._dict.setdefault(arg1, {})[arg0] = _StoreQueue()
        super().put(arg0, arg1, cmd, data)

    def held_bytes(self) -> int:
        """What the store holds unread: adb-shell's streams wait for OKAY, so a phone that keeps
        to the protocol leaves one message a stream; one that sends to streams nobody reads
        fills it."""
        # adb-shell's queues are asyncio's or queue's by Python version: the deque under either
        return sum(len(data) for streams in self._dict.values() for q in streams.values()
                   for _, data in getattr(q, "queue", None) or getattr(q, "_queue", ()))


class SharedIO(_AdbIOManager):
    """adb-shell's IO manager with one reader thread per connection instead of "whoever waits
    reads". adb-shell holds its transport lock while it waits for a packet, so a stream that
    waits (a job's shell, quiet for minutes) would block every write, and packets of streams the
    phone opened would be stored and never read. Here, once the handshake is done, the reader
    takes every message off the connection and routes it:

        OPEN (the phone opens a stream)            -> the StreamHandler listening for its
                                                      destination, or CLSE(0, id): refused
        a message to a local id >= DEVICE_STREAM_IDS -> the handler that owns the id (or dropped:
                                                      the echo of a stream already ended)
        CNXN or AUTH                               -> the phone restarted: the connection is lost
        anything else                              -> adb-shell's packet store, where read()
                                                      waits for it (adb-shell's matching rules)

    Writes, adb-shell's and the handlers', go whole under adb-shell's transport lock; a write
    that fails part-way ends the connection (the stream of messages is no longer whole). When
    the connection ends, every waiting read raises and every handler hears on_lost."""

    def __init__(self, transport, timeout_s: float):
        super().__init__(transport)
        self._packet_store = _Store()
        self._arrived = threading.Condition(self._store_lock)
        self.timeout_s = timeout_s
        self.maxdata = constants.MAX_PUSH_DATA
        self._error: BaseException | None = None
        self._reader: threading.Thread | None = None
        self._routes = threading.Lock()  # _listeners and _owners; never held while calling a handler
        self._listeners: dict[str, StreamHandler] = {}
        self._owners: dict[int, StreamHandler] = {}
        self._ids = itertools.count(DEVICE_STREAM_IDS)
        self._opening = 0  # the phone's OPENs handed to a handler that has not answered yet
        self._unacked: set[int] = set()  # phone-opened streams whose last WRTE awaits our OKAY
        self._refusals: queue.Queue[int] = queue.Queue(MAX_REFUSALS_QUEUED)
        self._refuser: threading.Thread | None = None
        self._held = 0  # bytes put in the packet store since it was last counted (an upper bound)

    @property
    def alive(self) -> bool:
        return self._reader is not None and self._error is None

    # ---- adb-shell's interface -------------------------------------------------------------------

    def connect(self, banner, rsa_keys, auth_timeout_s, auth_callback, adb_info):
        if self._reader is not None:
            self.close()
        self._error, self._reader = None, None
        connected, maxdata = super().connect(banner, rsa_keys, auth_timeout_s, auth_callback, adb_info)
        if maxdata and maxdata > HOST_MAX_DATA:  # ADB's rule: each side sends at most the smaller of the two
            log.info("the phone announced %d-byte messages; the host keeps to the %d it announced",
                     maxdata, HOST_MAX_DATA)
        self.maxdata = min(maxdata or constants.MAX_PUSH_DATA, HOST_MAX_DATA)
        self._reader = threading.Thread(target=self._read_loop, name="adb-reader", daemon=True)
        self._reader.start()
        return connected, maxdata

    def _read_packet_from_device(self, adb_info):
        """adb-shell's read of one message, for the handshake (before the reader runs), with the
        size check the reader makes: a phone's CNXN or AUTH of 4 GiB is refused, not buffered."""
        header = self._read_bytes_from_device(constants.MESSAGE_SIZE, adb_info)
        wire, arg0, arg1, length, check = unpack(header)
        command = constants.WIRE_TO_ID.get(wire)
        if not command:
            raise adb_errors.InvalidCommandError(f"garbled ADB header {header.hex()}")
        if length > HOST_MAX_DATA:
            raise PhoneMisbehaved(f"a {command.decode()} of {length} bytes, more than the {HOST_MAX_DATA} the host "
                                  "announced")
        data = self._read_bytes_from_device(length, adb_info) if length else b""
        if checksum(data) != check:
            raise adb_errors.InvalidChecksumError(f"bad checksum on {command.decode()}")
        return command, arg0, arg1, bytes(data)

    def read(self, expected_cmds, adb_info, allow_zeros=False):
        """adb-shell's read (the same matching, the same AdbTimeoutError after read_timeout_s),
        waiting for the reader to store the packet instead of reading it."""
        if self._reader is None:  # not connected: adb-shell's own, which fails as it always did
            return super().read(expected_cmds, adb_info, allow_zeros)
        find = self._packet_store.find_allow_zeros if allow_zeros else self._packet_store.find
        deadline = time.monotonic() + adb_info.read_timeout_s
        with self._arrived:
            while True:
                found = find(adb_info.remote_id, adb_info.local_id)
                while found:
                    cmd, arg0, arg1, data = self._packet_store.get(*found)
                    if cmd in expected_cmds:
                        return cmd, arg0, arg1, data
                    found = find(adb_info.remote_id, adb_info.local_id)
                if self._error is not None:
                    raise self._lost()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise adb_errors.AdbTimeoutError(
                        f"Never got one of the expected responses: {expected_cmds} (read_timeout_s = "
                        f"{adb_info.read_timeout_s})")
                self._arrived.wait(left)

    def send(self, msg, adb_info):
        with self._transport_lock:
            if self._error is not None:
                raise self._lost()
            try:
                self._send(msg, adb_info)
            except Exception as exc:
                self._fail(exc)
                raise

    def close(self):
        self._fail(ConnectionAbortedError("the connection was closed"))
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(POLL_S * 4)  # before the handle closes: libusb must not close under a read
        super().close()

    # ---- streams the phone opens ------------------------------------------------------------------

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
        if command == constants.OKAY and arg0 >= DEVICE_STREAM_IDS:
            with self._routes:  # before it leaves: the phone may answer with its next WRTE at once
                self._unacked.discard(arg0)
        elif command == constants.CLSE and arg0 == 0:  # a handler refused the phone's OPEN
            with self._routes:
                self._opening = max(0, self._opening - 1)
        try:
            self.send(AdbMessage(command, arg0, arg1, data), _AdbTransactionInfo(arg0, arg1, self.timeout_s,
                                                                                   self.timeout_s))
        except Exception as exc:  # a timeout, a reset, a closed handle: the connection is gone
            raise ConnectionError(f"sending {command.decode()}: {exc or type(exc).__name__}") from exc

    # ---- the reader ---------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while self._error is None:
                message = self._receive()
                if message is not None:
                    self._route(*message)
        except Exception as exc:  # whatever the cause, the connection is gone
            self._fail(exc)

    def _route(self, command: bytes, arg0: int, arg1: int, data: bytes) -> None:
        if command in (constants.CNXN, constants.AUTH):
            raise ConnectionResetError(f"the phone restarted the connection ({command.decode()})")
        if command == constants.OPEN:
            destination = data.rstrip(b"\0").decode("utf-8", "replace")
            with self._routes:
                handler = self._listeners.get(destination)
                full = len(self._owners) + self._opening >= MAX_PHONE_STREAMS
                if handler is not None and not full:
                    self._opening += 1
            if handler is not None and not full:
                handler.on_open(self, arg0, destination)
            else:
                log.warning("refused the phone's OPEN of %r: %s", destination[:100],
                            f"{MAX_PHONE_STREAMS} of its streams are open already" if handler is not None
                            else "nothing here takes it")
                self._refuse_later(arg0)
            return
        if arg1 >= DEVICE_STREAM_IDS:
            with self._routes:
                handler = self._owners.get(arg1)
                if handler is not None and command == constants.WRTE:
                    if arg1 in self._unacked:  # ADB: one WRTE in flight per stream and direction
                        raise PhoneMisbehaved(f"the phone sent a WRTE on stream {arg1} before its last one was "
                                              "acknowledged (ADB's flow control): closing the connection")
                    self._unacked.add(arg1)
            if handler is not None:
                handler.on_message(command, arg0, arg1, data)
            return
        with self._arrived:
            self._packet_store.put(arg0, arg1, command, data)
            self._held += len(data)
            if self._held > MAX_HELD_BYTES:  # an upper bound passed: count what is really held
                self._held = self._packet_store.held_bytes()
                if self._held > MAX_HELD_BYTES:
                    raise PhoneMisbehaved(f"the phone sent more than {MAX_HELD_BYTES} bytes to streams nobody "
                                          "reads: closing the connection")
            self._arrived.notify_all()

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
            with contextlib.suppress(ConnectionError):
                self.send(AdbMessage(constants.CLSE, 0, remote_id), _AdbTransactionInfo(0, remote_id, self.timeout_s,
                                                                                        self.timeout_s))

    def _receive(self) -> tuple[bytes, int, int, bytes] | None:
        """The next message, or None when none began within POLL_S."""
        header = self._read_exact(constants.MESSAGE_SIZE, idle_ok=True)
        if header is None:
            return None
        wire, arg0, arg1, length, check = unpack(header)
        command = constants.WIRE_TO_ID.get(wire)
        if command is None or struct.unpack_from("<I", header, 20)[0] != wire ^ 0xFFFFFFFF:
            raise adb_errors.InvalidCommandError(f"garbled ADB header {header.hex()}")
        if length > HOST_MAX_DATA:  # never buffered: the phone announced more, the host did not
            raise PhoneMisbehaved(f"a {command.decode()} of {length} bytes, more than the {HOST_MAX_DATA} the host "
                                  "announced: closing the connection")
        data = self._read_exact(length) if length else b""
        if checksum(data) != check:  # adb-shell agrees version 0x01000000: payloads carry checksums
            raise adb_errors.InvalidChecksumError(f"bad checksum on {command.decode()}")
        return command, arg0, arg1, data

    def _read_exact(self, n: int, idle_ok: bool = False) -> bytes | None:
        buf = bytearray()
        started = time.monotonic()
        while len(buf) < n:
            if self._error is not None:
                raise ConnectionAbortedError("closed")
            try:
                buf += self._transport.bulk_read(n - len(buf), POLL_S)
            except Exception as exc:
                if not _is_timeout(exc):
                    raise
                buf += getattr(getattr(exc, "usb_error", None), "received", None) or b""  # libusb1 keeps a partial read
                if idle_ok and not buf:
                    return None
                if time.monotonic() - started > self.timeout_s:
                    raise adb_errors.AdbTimeoutError(f"the phone sent {len(buf)} of {n} bytes and stopped") from None
        return bytes(buf)

    def _fail(self, error: BaseException) -> None:
        """The connection is over (once): wake every read, tell every handler, and shut the socket
        so that a thread blocked on it returns."""
        with self._arrived:
            if self._error is not None:
                return
            self._error = error
            self._arrived.notify_all()
        with self._routes:
            handlers = list({id(h): h for h in (*self._listeners.values(), *self._owners.values())}.values())
            self._listeners.clear()
            self._owners.clear()
        for handler in handlers:
            try:
                handler.on_lost(self, error)
            except Exception:
                log.exception("a stream handler failed on a lost connection")
        sock = getattr(self._transport, "_connection", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _lost(self) -> Exception:
        """What a read or write on the ended connection raises: the class adb-shell would have."""
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


class SharedAdbDevice(AdbDevice):
    """adb-shell's AdbDevice on a SharedIO: its commands work as adb-shell's do, from several
    threads at once, and `io` takes the streams the phone opens (StreamHandler)."""

    def __init__(self, transport, default_transport_timeout_s: float = 10.0, banner=None):
        super().__init__(transport, default_transport_timeout_s, banner)
        self._io_manager = SharedIO(transport, default_transport_timeout_s)

    @property
    def io(self) -> SharedIO:
        return self._io_manager

    @property
    def alive(self) -> bool:
        """Connected, and the reader has not seen the connection fail."""
        return self._available and self._io_manager.alive

    def _next_local_id(self) -> None:
        """Under _local_id_lock: keep adb-shell's ids below DEVICE_STREAM_IDS."""
        if self._local_id >= DEVICE_STREAM_IDS - 1:
            self._local_id = 0

    def _open(self, destination, transport_timeout_s, read_timeout_s, timeout_s):
        with self._local_id_lock:
            self._next_local_id()
        return super()._open(destination, transport_timeout_s, read_timeout_s, timeout_s)

    def service(self, destination: str, timeout_s: float) -> bytes:
        """Open `destination` ("reverse:list-forward") and read its reply to the end. Raises
        ServiceRefused when the phone has no such service (adb-shell's _open would wait for an
        OKAY until its time limit)."""
        with self._local_id_lock:
            self._next_local_id()
            self._local_id += 1
            local_id = self._local_id
        info = _AdbTransactionInfo(local_id, None, timeout_s, timeout_s, timeout_s)
        self._io_manager.send(AdbMessage(constants.OPEN, local_id, 0, destination.encode() + b"\0"), info)
        command, info.remote_id, _, _ = self._io_manager.read([constants.OKAY, constants.CLSE], info)
        if command == constants.CLSE:
            raise ServiceRefused(destination)
        return b"".join(self._read_until_close(info))


