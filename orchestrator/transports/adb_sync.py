"""ADB's file sync service (v1) on a stream opened to "sync:" (adb_shared.SharedAdbDevice): push
a file and pull one. Requests and replies are an id of four bytes and a little-endian u32, then
that many bytes of data (../shared/notes/adb-facts.md):

    push: SEND "path,mode" -> DATA chunks (<= 64 KiB each) -> DONE(mtime)  <- OKAY, or FAIL(message)
    pull: RECV "path"                                                     <- DATA chunks, DONE; or FAIL(message)

Requests are gathered into WRTEs of up to the connection's message size; replies span WRTEs as
they please."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import BinaryIO

from adb_shell import exceptions as adb_errors

SYNC_DATA_MAX = 64 * 1024  # the largest DATA adbd takes
HEADER = struct.Struct("<4sI")


class SyncFailed(adb_errors.AdbCommandFailureException):
    """The phone answered FAIL: its message says why (no such file, no permission, ...)."""


def push(stream, source: BinaryIO, device_path: str, mode: int, progress: Callable[[int], None] | None,
         maxdata: int, timeout_s: float) -> None:
    """Send `source` to `device_path` with `mode`; `progress(n)` after each n bytes sent."""
    out = _Requests(stream, maxdata, timeout_s)
    out.add(b"SEND", f"{device_path},{mode}".encode())
    chunk = max(1, min(SYNC_DATA_MAX, maxdata - HEADER.size))
    while piece := source.read(chunk):
        out.add(b"DATA", piece)
        if progress is not None:
            progress(len(piece))
    out.add(b"DONE", size=int(time.time()))
    out.flush()
    replies = _Replies(stream, timeout_s)
    ident, size = replies.header()
    if ident == b"OKAY":
        return
    if ident == b"FAIL" and size <= SYNC_DATA_MAX:
        raise SyncFailed(f"push {device_path}: {replies.exactly(size).decode('utf-8', 'replace')}")
    raise adb_errors.InvalidResponseError(f"push {device_path}: the phone answered {ident!r} to DONE")


def pull(stream, device_path: str, sink: BinaryIO, timeout_s: float) -> None:
    """Write the phone's `device_path` into `sink`."""
    out = _Requests(stream, SYNC_DATA_MAX, timeout_s)
    out.add(b"RECV", device_path.encode())
    out.flush()
    replies = _Replies(stream, timeout_s)
    while True:
        ident, size = replies.header()
        if ident == b"DONE":
            return
        if ident == b"FAIL" and size <= SYNC_DATA_MAX:
            raise SyncFailed(f"pull {device_path}: {replies.exactly(size).decode('utf-8', 'replace')}")
        if ident != b"DATA" or size > SYNC_DATA_MAX:
            raise adb_errors.InvalidResponseError(f"pull {device_path}: a {ident!r} of {size} bytes in the reply")
        sink.write(replies.exactly(size))


class _Requests:
    """Sync requests gathered into WRTEs of at most `maxdata` bytes."""

    def __init__(self, stream, maxdata: int, timeout_s: float):
        self.stream, self.maxdata, self.timeout_s = stream, maxdata, timeout_s
        self.buf = bytearray()

    def add(self, ident: bytes, data: bytes = b"", size: int | None = None) -> None:
        message = HEADER.pack(ident, len(data) if size is None else size) + data
        if len(self.buf) + len(message) > self.maxdata:
            self.flush()
        self.buf += message
        while len(self.buf) > self.maxdata:  # a request longer than a message (a long path at 4 KiB)
            self.stream.write(bytes(self.buf[:self.maxdata]), self.timeout_s)
            del self.buf[:self.maxdata]

    def flush(self) -> None:
        if self.buf:
            self.stream.write(bytes(self.buf), self.timeout_s)
            self.buf.clear()


class _Replies:
    """The phone's replies, read across the WRTEs that carry them."""

    def __init__(self, stream, timeout_s: float):
        self.stream, self.timeout_s = stream, timeout_s
        self.buf = bytearray()

    def header(self) -> tuple[bytes, int]:
        return HEADER.unpack(self.exactly(HEADER.size))

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            data = self.stream.read(self.timeout_s)
            if data is None:
                raise adb_errors.InvalidResponseError(f"the phone closed the sync stream {n - len(self.buf)} bytes "
                                                      "short of a reply")
            self.buf += data
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out
