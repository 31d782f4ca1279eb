"""The virtual phone's screen, as `screencap -p` shows it: a PNG drawn from the phone's state,
with zlib and struct alone (the device side stays light). Dark when the phone sleeps; awake, a
status bar with the battery level and, below it, Chrome's page (white) when Chrome runs, else the
launcher. A third of a 1080x2400 screen on each side: enough to tell the states apart, small to
send."""

from __future__ import annotations

import struct
import zlib

WIDTH, HEIGHT = 360, 800
STATUS_BAR = 24
BLACK, STATUS, BATTERY, PAGE, LAUNCHER = (0, 0, 0), (32, 33, 36), (52, 168, 83), (255, 255, 255), (26, 115, 232)


def render(awake: bool, battery_level: int, chrome_running: bool) -> bytes:
    """The screen as PNG bytes (8-bit RGB)."""
    if not awake:
        rows = [_row([(WIDTH, BLACK)])] * HEIGHT
    else:
        charged = max(0, min(WIDTH - 16, (WIDTH - 16) * battery_level // 100))
        bar = _row([(8, STATUS), (charged, BATTERY), (WIDTH - 8 - charged, STATUS)])
        status = [_row([(WIDTH, STATUS)])] * 6 + [bar] * (STATUS_BAR - 12) + [_row([(WIDTH, STATUS)])] * 6
        body = _row([(WIDTH, PAGE if chrome_running else LAUNCHER)])
        rows = status + [body] * (HEIGHT - STATUS_BAR)
    return png(WIDTH, HEIGHT, rows)


def _row(runs: list[tuple[int, tuple[int, int, int]]]) -> bytes:
    """One scanline from (pixels, colour) runs, with its filter byte (0: none)."""
    return b"\x00" + b"".join(bytes(colour) * count for count, colour in runs)


def png(width: int, height: int, rows: list[bytes]) -> bytes:
    """A PNG of 8-bit RGB scanlines (each with its filter byte)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, deflate, no filter, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
            + chunk(b"IEND", b""))
