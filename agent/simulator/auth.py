"""RSA authentication of ADB hosts: the adb public-key format (base64 of Android's 524-byte
RSAPublicKey struct, then " user@host"), signature checks over AUTH tokens, and the
persisted list of accepted keys (`root/adb_keys`, one key a line, like the phone's
/data/misc/adb/adb_keys)."""

from __future__ import annotations

import base64
import binascii
import struct
import threading
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed

KEY_WORDS = 64  # 2048-bit modulus as 64 little-endian u32 words
KEY_STRUCT = struct.Struct(f"<II{KEY_WORDS * 4}s{KEY_WORDS * 4}sI")  # len, n0inv, n, rr, e
assert KEY_STRUCT.size == 524


class KeyFormatError(ValueError):
    """A public key that is not in the adb format."""


def parse_public_key(text: bytes | str) -> tuple[rsa.RSAPublicKey, str]:
    """Parse "BASE64 user@host" (trailing NUL and whitespace allowed) into the RSA public key
    and the comment."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip("\0 \r\n\t")
    b64, _, comment = text.partition(" ")
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KeyFormatError(f"adb public key is not base64: {exc}") from exc
    if len(blob) != KEY_STRUCT.size:
        raise KeyFormatError(f"adb public key struct is {len(blob)} bytes, expected {KEY_STRUCT.size}")
    words, _n0inv, n_le, _rr, e = KEY_STRUCT.unpack(blob)
    if words != KEY_WORDS:
        raise KeyFormatError(f"adb public key has {words} modulus words, expected {KEY_WORDS}")
    n = int.from_bytes(n_le, "little")
    return rsa.RSAPublicNumbers(e, n).public_key(), comment.strip()


def encode_public_key(key: rsa.RSAPublicKey, comment: str = "unknown@unknown") -> str:
    """The adb text form of `key` (what adb writes to adbkey.pub)."""
    numbers = key.public_numbers()
    n, e = numbers.n, numbers.e
    n0inv = (-pow(n, -1, 2**32)) % 2**32
    rr = pow(2, KEY_WORDS * 32 * 2, n)
    blob = KEY_STRUCT.pack(KEY_WORDS, n0inv, n.to_bytes(KEY_WORDS * 4, "little"),
                           rr.to_bytes(KEY_WORDS * 4, "little"), e)
    return f"{base64.b64encode(blob).decode()} {comment}"


def verify(key: rsa.RSAPublicKey, token: bytes, signature: bytes) -> bool:
    """adb signs the 20-byte token as if it were a SHA-1 digest (PKCS#1 v1.5 DigestInfo)."""
    try:
        key.verify(signature, token, padding.PKCS1v15(), Prehashed(hashes.SHA1()))
    except (InvalidSignature, ValueError):
        return False
    return True


class KeyStore:
    """The accepted host keys, persisted one per line in adb's text format, plus the keys of
    `trusted` (an adbkey.pub, or several keys a line each), the hosts the phone was paired with
    before it started; it is read at each connection, so it may appear later."""

    def __init__(self, path: Path, trusted: Path | None = None):
        self.path = path
        self.trusted = trusted
        self._lock = threading.Lock()

    def keys(self) -> list[rsa.RSAPublicKey]:
        return _read_keys(self.path) + (_read_keys(self.trusted) if self.trusted is not None else [])

    def verify_any(self, token: bytes, signature: bytes) -> bool:
        return any(verify(key, token, signature) for key in self.keys())

    def add(self, text: str) -> None:
        parse_public_key(text)  # refuse to persist anything that is not a key
        line = text.strip("\0 \r\n\t")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(line + "\n")


def _read_keys(path: Path) -> list[rsa.RSAPublicKey]:
    try:
        text = path.read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        if line.strip():
            try:
                found.append(parse_public_key(line)[0])
            except KeyFormatError:
                continue  # a damaged line must not lock every host out
    return found
