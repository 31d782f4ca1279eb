"""The ADB wire format: 24-byte message headers (six little-endian u32: command, arg0, arg1,
data length, data checksum, magic), the command words, the two protocol versions and the
payload checksum. Nothing here knows about streams or services; device.py builds on it."""

from __future__ import annotations

import struct
from dataclasses import dataclass

CNXN = 0x4E584E43
AUTH = 0x48545541
OPEN = 0x4E45504F
OKAY = 0x59414B4F
CLSE = 0x45534C43
WRTE = 0x45545257
STLS = 0x534C5453  # recognised so it can be ignored; the virtual phone never sends it
COMMANDS = {CNXN: "CNXN", AUTH: "AUTH", OPEN: "OPEN", OKAY: "OKAY", CLSE: "CLSE", WRTE: "WRTE", STLS: "STLS"}

VERSION_MIN = 0x01000000  # payloads carry a byte-sum checksum
VERSION_SKIP_CHECKSUM = 0x01000001  # the checksum field is zero and not checked
MAX_PAYLOAD = 1024 * 1024
MAX_PAYLOAD_V1 = 4096  # CNXN and AUTH payloads never exceed this

AUTH_TOKEN = 1
AUTH_SIGNATURE = 2
AUTH_RSAPUBLICKEY = 3
TOKEN_SIZE = 20

HEADER = struct.Struct("<6I")


class WireError(ValueError):
    """A header or payload that breaks the framing rules; the connection is dropped."""


def checksum(data: bytes) -> int:
    return sum(data) & 0xFFFFFFFF


@dataclass(frozen=True)
class Message:
    command: int
    arg0: int
    arg1: int
    data: bytes = b""

    @property
    def name(self) -> str:
        return COMMANDS.get(self.command, hex(self.command))


def pack(msg: Message, version: int) -> bytes:
    """Header and payload in one buffer (one write, so concurrent streams never interleave
    inside a message). The checksum is real below VERSION_SKIP_CHECKSUM, zero from it on, as
    adbd does; adb-shell 0.4.4 (version 0x01000000) always verifies it."""
    check = checksum(msg.data) if version < VERSION_SKIP_CHECKSUM else 0
    header = HEADER.pack(msg.command, msg.arg0, msg.arg1, len(msg.data), check, msg.command ^ 0xFFFFFFFF)
    return header + msg.data


def unpack_header(header: bytes) -> tuple[int, int, int, int, int]:
    command, arg0, arg1, length, check, magic = HEADER.unpack(header)
    if magic != command ^ 0xFFFFFFFF:
        raise WireError(f"bad magic {magic:#010x} for command {command:#010x}")
    if command not in COMMANDS:
        raise WireError(f"unknown command {command:#010x}")
    return command, arg0, arg1, length, check
