"""Chromium's DevTools protocol, the little of it the farm speaks: a page's screenshot. Chrome on
Android serves DevTools on the abstract socket `chrome_devtools_remote` (HTTP for the list of
targets, a WebSocket per target), reached through ADB's `localabstract:` service; the virtual
phone relays the same service to its Chromium (agent/simulator/device.py). The byte stream is the
caller's (a Channel: an ADB stream), so this speaks HTTP/1.1 and RFC 6455 itself, one request a
stream: no client library holds a socket it did not make."""

from __future__ import annotations

import base64
import json
import os
import struct
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol
from urllib.parse import urlsplit

MAX_MESSAGE_BYTES = 64 << 20  # a screenshot of a large page is a few MiB of base64
WRITE_BYTES = 4096  # an ADB WRTE carries at most maxdata (4 KiB on old adbd)


class Channel(Protocol):
    def read(self, timeout_s: float) -> bytes | None: ...  # None: the other side closed
    def write(self, data: bytes, timeout_s: float) -> None: ...


class DevToolsError(Exception):
    """The browser's DevTools answered something else than asked; the message says what."""


OpenChannel = Callable[[], AbstractContextManager[Channel]]


# What Chromium answers while a page it has just opened is not attached to a renderer yet (a
# browser started a moment before): asked again, every RETRY_S, for at most SETTLE_S.
NOT_ATTACHED = "Not attached to an active page"
SETTLE_S = 10.0
RETRY_S = 0.25


def capture_screenshot(open_channel: OpenChannel, timeout_s: float = 30.0, prefer: str = "/web/") -> bytes:
    """The PNG of the browser's page (the first whose URL holds `prefer`, else the first page):
    its targets through GET /json/list, then Page.captureScreenshot on its WebSocket; a page not
    attached yet is asked again (targets listed anew) for up to SETTLE_S."""
    deadline = time.monotonic() + min(SETTLE_S, timeout_s)
    while True:
        try:
            return _capture_once(open_channel, timeout_s, prefer)
        except DevToolsError as exc:
            if NOT_ATTACHED not in str(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(RETRY_S)


def _capture_once(open_channel: OpenChannel, timeout_s: float, prefer: str) -> bytes:
    with open_channel() as channel:
        _send(channel, b"GET /json/list HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", timeout_s)
        status, body = _http_response(channel, timeout_s)
    if status != 200:
        raise DevToolsError(f"GET /json/list answered HTTP {status}")
    try:
        pages = [t for t in json.loads(body) if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
    except (ValueError, AttributeError) as exc:
        raise DevToolsError(f"GET /json/list answered no list of targets ({exc})") from None
    if not pages:
        raise DevToolsError("the browser has no page open")
    page = next((p for p in pages if prefer in p.get("url", "")), pages[0])
    path = urlsplit(page["webSocketDebuggerUrl"]).path
    with open_channel() as channel:
        socket = WebSocket.open(channel, path, timeout_s)
        socket.send_text(json.dumps({"id": 1, "method": "Page.captureScreenshot", "params": {"format": "png"}}))
        while True:
            try:
                reply = json.loads(socket.receive_text())
            except ValueError as exc:  # (UnicodeDecodeError is one too)
                raise DevToolsError(f"Page.captureScreenshot: the browser answered something that is not JSON ({exc})") from None
            if isinstance(reply, dict) and reply.get("id") == 1:
                break
    error = reply.get("error")
    if error is not None:
        message = error.get("message", error) if isinstance(error, dict) else error
        raise DevToolsError(f"Page.captureScreenshot: {message}")
    try:
        return base64.b64decode(reply["result"]["data"], validate=True)
    except (KeyError, TypeError, ValueError) as exc:  # (binascii.Error is a ValueError)
        raise DevToolsError(f"Page.captureScreenshot answered no base64 image ({type(exc).__name__}: {exc})") from None


def _send(channel: Channel, data: bytes, timeout_s: float) -> None:
    for i in range(0, len(data), WRITE_BYTES):
        channel.write(data[i:i + WRITE_BYTES], timeout_s)


class _Reader:
    """Bytes from a channel, as many as asked for."""

    def __init__(self, channel: Channel, timeout_s: float, pending: bytes = b""):
        self.channel, self.timeout_s, self.buf = channel, timeout_s, bytearray(pending)

    def fill(self) -> bool:
        data = self.channel.read(self.timeout_s)
        if data is None:
            return False
        self.buf += data
        if len(self.buf) > MAX_MESSAGE_BYTES:
            raise DevToolsError(f"the browser sent over {MAX_MESSAGE_BYTES >> 20} MiB in one message")
        return True

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self.fill():
                raise DevToolsError("the browser closed DevTools mid-message")
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def head(self) -> tuple[int, dict[str, str]]:
        """An HTTP response's status and headers (the body stays in the buffer)."""
        while b"\r\n\r\n" not in self.buf:
            if not self.fill():
                raise DevToolsError("the browser closed DevTools before its answer's headers")
        head, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        self.buf = bytearray(rest)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise DevToolsError(f"not an HTTP answer: {status_line[:80]!r}")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        return int(parts[1]), headers


def _http_response(channel: Channel, timeout_s: float) -> tuple[int, bytes]:
    reader = _Reader(channel, timeout_s)
    status, headers = reader.head()
    if "content-length" in headers:
        return status, reader.exactly(int(headers["content-length"]))
    while reader.fill():  # no length: the body ends with the stream
        pass
    return status, bytes(reader.buf)


class WebSocket:
    """The client side of RFC 6455 on a channel: text frames, masked as a client's must be."""

    def __init__(self, channel: Channel, reader: _Reader, timeout_s: float):
        self.channel, self.reader, self.timeout_s = channel, reader, timeout_s

    @classmethod
    def open(cls, channel: Channel, path: str, timeout_s: float) -> WebSocket:
        key = base64.b64encode(os.urandom(16)).decode()
        _send(channel, (f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode(), timeout_s)
        reader = _Reader(channel, timeout_s)
        status, _ = reader.head()
        if status != 101:
            raise DevToolsError(f"the browser refused the WebSocket of {path} (HTTP {status})")
        return cls(channel, reader, timeout_s)

    def send_text(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack(">BB", 0x81, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack(">BBH", 0x81, 0x80 | 126, n)
        else:
            head = struct.pack(">BBQ", 0x81, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        _send(self.channel, head + mask + masked, self.timeout_s)

    def receive_text(self) -> str:
        """The next text message, its fragments joined; pings and pongs are passed over."""
        parts: list[bytes] = []
        while True:
            first, second = self.reader.exactly(2)
            opcode, n = first & 0x0F, second & 0x7F
            if n == 126:
                (n,) = struct.unpack(">H", self.reader.exactly(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", self.reader.exactly(8))
            if n > MAX_MESSAGE_BYTES:
                raise DevToolsError(f"the browser sent a frame of {n} bytes")
            mask = self.reader.exactly(4) if second & 0x80 else b""
            data = self.reader.exactly(n)
            if mask:
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
            if opcode == 0x8:
                raise DevToolsError("the browser closed the page's DevTools WebSocket")
            if opcode in (0x9, 0xA):
                continue
            parts.append(data)
            if first & 0x80:
                return b"".join(parts).decode()
