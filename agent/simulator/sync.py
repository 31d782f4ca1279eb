"""The "sync:" service (adb push, pull, ls, stat), v1 and v2, as adbd's file_sync_service
serves it. Requests are [id][u32 length][path]; replies use the same little-endian structs
as adbd (stat_v1 16 bytes, stat_v2 72, dent_v1 20 + name, dent_v2 76 + name). A failed SEND
or RECV answers FAIL(message) and ends the service, as adbd does."""

from __future__ import annotations

import errno
import os
import stat as st
import struct
from collections.abc import Awaitable, Callable

from agent.simulator.fs import SandboxFS, Stat

SYNC_DATA_MAX = 64 * 1024
MAX_PATH = 1024

REQUEST = struct.Struct("<4sI")
STAT_V1 = struct.Struct("<4sIII")  # id, mode, size, mtime
STAT_V2 = struct.Struct("<4sIQQIIIIQqqq")  # id, error, dev, ino, mode, nlink, uid, gid, size, atime, mtime, ctime
DENT_V1 = struct.Struct("<4sIIII")  # id, mode, size, mtime, namelen
DENT_V2 = struct.Struct("<4sIQQIIIIQqqqI")
assert STAT_V2.size == 72 and DENT_V2.size == 76


class SyncEnd(Exception):
    """The service ends (QUIT, a failure adbd treats as fatal, or the stream closed)."""


def parse_mode(text: str) -> int:
    """strtoul(text, nullptr, 0): 0x.. hex, 0.. octal, else decimal (Python's int(x, 0)
    refuses "0644")."""
    text = text.strip()
    if text.lower().startswith("0x"):
        return int(text, 16)
    if text.startswith("0") and len(text) > 1:
        return int(text, 8)
    return int(text or "0")


class SyncService:
    """One sync session. `read_exact(n)` returns n bytes from the stream (raising SyncEnd at
    its end); `write(data)` sends bytes; replies are gathered and sent per request."""

    def __init__(self, fs: SandboxFS, read_exact: Callable[[int], Awaitable[bytes]],
                 write: Callable[[bytes], Awaitable[None]], maxdata: int):
        self.fs = fs
        self.read_exact = read_exact
        self.write = write
        self.maxdata = maxdata
        self._out = bytearray()

    async def _reply(self, data: bytes) -> None:
        self._out += data
        if len(self._out) >= self.maxdata:
            await self._flush()

    async def _flush(self) -> None:
        if self._out:
            data, self._out = bytes(self._out), bytearray()
            await self.write(data)

    async def _fail(self, message: str) -> None:
        data = message.encode()
        await self._reply(REQUEST.pack(b"FAIL", len(data)) + data)
        await self._flush()
        raise SyncEnd(message)

    async def run(self) -> None:
        try:
            while True:
                ident, length = REQUEST.unpack(await self.read_exact(REQUEST.size))
                if ident == b"QUIT":
                    return
                if length > MAX_PATH:
                    await self._fail(f"path too long: {length}")
                path = (await self.read_exact(length)).decode("utf-8", "surrogateescape")
                handler = {
                    b"STAT": self._stat_v1, b"STA2": self._stat_v2, b"LST2": self._stat_v2,
                    b"LIST": self._list, b"LIS2": self._list, b"SEND": self._send, b"RECV": self._recv,
                }.get(ident)
                if handler is None:
                    await self._fail(f"unknown sync request {ident!r}")
                await handler(ident, path)
                await self._flush()
        except SyncEnd:
            return

    # ---- requests --------------------------------------------------------------------------

    def _stat(self, path: str) -> tuple[Stat | None, int]:
        try:
            return self.fs.stat(path), 0
        except OSError as exc:
            return None, exc.errno or errno.EIO

    async def _stat_v1(self, ident: bytes, path: str) -> None:
        s, _ = self._stat(path)
        await self._reply(STAT_V1.pack(b"STAT", s.mode, s.size & 0xFFFFFFFF, s.mtime) if s
                          else STAT_V1.pack(b"STAT", 0, 0, 0))

    async def _stat_v2(self, ident: bytes, path: str) -> None:
        s, err = self._stat(path)
        if s is None:
            await self._reply(STAT_V2.pack(ident, err, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        else:
            await self._reply(STAT_V2.pack(ident, 0, s.dev, s.ino, s.mode, s.nlink, s.uid, s.gid,
                                           s.size, s.atime, s.mtime, s.ctime))

    async def _list(self, ident: bytes, path: str) -> None:
        v2 = ident == b"LIS2"
        try:
            names = [".", ".."] + self.fs.listdir(path)
        except OSError:
            names = []  # adbd: an unreadable directory lists as empty
        for name in names:
            s = self.fs.try_stat(f"{path}/{name}")
            if s is None:
                continue
            raw = name.encode("utf-8", "surrogateescape")
            if v2:
                head = DENT_V2.pack(b"DNT2", 0, s.dev, s.ino, s.mode, s.nlink, s.uid, s.gid, s.size,
                                    s.atime, s.mtime, s.ctime, len(raw))
            else:
                head = DENT_V1.pack(b"DENT", s.mode, s.size & 0xFFFFFFFF, s.mtime, len(raw))
            await self._reply(head + raw)
        if v2:
            await self._reply(DENT_V2.pack(b"DONE", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        else:
            await self._reply(DENT_V1.pack(b"DONE", 0, 0, 0, 0))

    async def _send(self, ident: bytes, spec: str) -> None:
        path, _, mode_text = spec.rpartition(",")
        if not path:
            path, mode_text = spec, "0644"
        error = None
        try:
            mode = parse_mode(mode_text)
        except ValueError:
            mode, error = 0o644, f"bad mode {mode_text!r}"
        if error is None and st.S_ISLNK(mode):
            error = "symlinks cannot be pushed to the virtual phone"
        target = tmp = f = None
        if error is None:
            try:
                target = self.fs.writable_host_path(path)
                if target.is_dir():
                    raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), path)
                target.parent.mkdir(parents=True, exist_ok=True)  # fixed_push_mkdir
                tmp = target.with_name(f".{target.name}.sync-tmp")
                f = tmp.open("wb")
            except OSError as exc:
                error = f"couldn't create file: {exc.strerror}"
        mtime = 0
        try:
            while True:  # read DATA until DONE even after a failure, so the stream stays framed
                ident2, size = REQUEST.unpack(await self.read_exact(REQUEST.size))
                if ident2 == b"DONE":
                    mtime = size
                    break
                if ident2 != b"DATA" or size > SYNC_DATA_MAX:
                    error = error or f"invalid data message {ident2!r} of {size} bytes"
                    break
                chunk = await self.read_exact(size)
                if f is not None and error is None:
                    f.write(chunk)
        finally:
            if f is not None:
                f.close()
        if error is not None:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            await self._fail(error)
        # adbd keeps the pushed permission bits; a setuid file planted in the sandbox would be
        # a setuid file on the host, so the special bits never survive a push.
        os.chmod(tmp, (st.S_IMODE(mode) & 0o777) or 0o644)
        os.utime(tmp, (mtime, mtime))
        os.replace(tmp, target)
        await self._reply(REQUEST.pack(b"OKAY", 0))

    async def _recv(self, ident: bytes, path: str) -> None:
        try:
            host = self.fs.readable_host_file(path)
            if host is None:
                payloads = [self.fs.read_bytes(path)]
            else:
                payloads = None
                f = host.open("rb")
        except OSError as exc:
            await self._fail(exc.strerror or "read failed")
        if payloads is not None:
            for chunk in payloads:
                await self._reply(REQUEST.pack(b"DATA", len(chunk)) + chunk)
        else:
            with f:
                while chunk := f.read(SYNC_DATA_MAX):
                    await self._reply(REQUEST.pack(b"DATA", len(chunk)) + chunk)
        await self._reply(REQUEST.pack(b"DONE", 0))
