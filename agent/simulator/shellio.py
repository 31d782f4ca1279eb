"""What the virtual phone's shell and its built-in commands pass each other: standard input
(bytes given up front, or arriving on the ADB stream), the writers a command's output goes to, a
shell session (working directory, variables, the last status) and the two ways a command line
ends early (a syntax error, `exit`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

DEFAULT_ENV = {
    "PATH": "/product/bin:/apex/com.android.runtime/bin:/apex/com.android.art/bin:/system_ext/bin:"
            "/system/bin:/system/xbin:/odm/bin:/vendor/bin:/vendor/xbin",
    "HOME": "/", "TMPDIR": "/data/local/tmp", "ANDROID_DATA": "/data", "ANDROID_ROOT": "/system",
    "EXTERNAL_STORAGE": "/sdcard", "HOSTNAME": "localhost", "USER": "shell", "LOGNAME": "shell",
    "SHELL": "/system/bin/sh",
}


class ShellSyntaxError(ValueError):
    pass


class ShellExit(Exception):
    def __init__(self, code: int):
        self.code = code


@dataclass
class Session:
    cwd: str = "/"
    env: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ENV))
    exported: set[str] = field(default_factory=set)
    status: int = 0


# ---- standard input ----------------------------------------------------------------------


class Stdin:
    """Bytes given up front (a pipe, a file, nothing)."""

    def __init__(self, data: bytes = b""):
        self._data = data

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._data:
            yield self._data
            self._data = b""

    async def read_all(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class StreamStdin(Stdin):
    """Bytes arriving from the ADB stream; None in the queue marks end of input. Commands
    that never read standard input never wait for it."""

    def __init__(self):
        super().__init__()
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._eof = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self._eof:
            chunk = await self.queue.get()
            if chunk is None:
                self._eof = True
                return
            yield chunk

    async def readline(self) -> bytes | None:
        """One line for the interactive shell; None at end of input."""
        buf = getattr(self, "_line_buf", b"")
        while b"\n" not in buf:
            if self._eof:
                self._line_buf = b""
                return buf or None
            chunk = await self.queue.get()
            if chunk is None:
                self._eof = True
                continue
            buf += chunk
        line, _, self._line_buf = buf.partition(b"\n")
        return line


Writer = Callable[[bytes], Awaitable[None]]


@dataclass
class IO:
    stdin: Stdin
    out: Writer
    err: Writer


async def discard(_: bytes) -> None:
    return None
