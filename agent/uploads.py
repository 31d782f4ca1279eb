"""Uploads that resume inside a file (agent/bundle.py's "resuming an upload inside a file"):
whole chunks appended to a blob's partial after each is checked against the signed manifest's
chunk hashes (append_chunks, receive_chunks), chunks left beside it by a transport that cannot
append (adb sync) absorbed into it (absorb_chunks), and the signed manifest of a staged build
(staged_manifest). What `farm-agent serve` and `farm-agent absorb` call."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agent.bundle import (
    RESUME,
    BundleError,
    OffsetRefused,
    farm_public_key,
    locked_partial,
    partial_upload,
    public_key_of,
    resume_point,
    signed_manifest,
)
from agent.files import IO_CHUNK
from agent.protocol import (
    FILES,
    Manifest,
    ManifestFile,
    chunk_count,
)


def append_chunks(root: Path, entry: ManifestFile, chunk_size: int, offset: int, read: Callable[[int], bytes],
                  target: Path) -> int:
    """Append to `entry`'s partial upload the bytes `read(n)` gives from `offset` on (the
    partial's verified length, or less: it is cut back there), one chunk at a time, each
    checked against the manifest's chunk list before it is written and fsynced. A short read
    (a cut) keeps the whole chunks before it. Once the file is whole, its sha256 is checked and
    it is moved to `target`; a whole file that does not hash right is dropped. Returns the
    bytes now held. BundleError for an offset past what is held, off a chunk boundary, or a
    chunk that is not the manifest's (the partial keeps what it had)."""
    if not chunk_size or len(entry.chunks) != chunk_count(entry.size, chunk_size):
        raise BundleError(f"{FILES}/{entry.path}: the manifest lists no chunks for it; send it whole")
    path = partial_upload(root, entry.sha256)
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked_partial(path, entry) as f:
        held = os.fstat(f.fileno()).st_size
        if offset > held or (offset % chunk_size and offset != entry.size) or offset > entry.size:
            raise OffsetRefused(f"{FILES}/{entry.path}: an upload from byte {offset}, but {held} bytes of it are held "
                              f"here (resume from a {chunk_size}-byte chunk boundary at most that far)")
        if held != offset:
            f.truncate(offset)
        f.seek(offset)
        while offset < entry.size:
            k = offset // chunk_size
            want = min(chunk_size, entry.size - offset)
            piece = _read_exactly(read, want)
            if len(piece) < want:
                break  # the sender stopped mid-chunk: what came of this one is not kept
            if hashlib.sha256(piece).hexdigest() != entry.chunks[k]:
                raise BundleError(f"{FILES}/{entry.path}: chunk {k} (bytes {offset}-{offset + want}) does not "
                                  "hash as the signed manifest lists; not kept")
            f.write(piece)
            f.flush()
            os.fsync(f.fileno())
            offset += want
        if offset < entry.size:
            return offset
        digest = _hash_open(f)
    if digest != entry.sha256:
        path.unlink(missing_ok=True)
        raise BundleError(f"{FILES}/{entry.path}: every chunk matched but the whole file does not hash as signed; "
                          "dropped, send it again")
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, target)
    return offset


def staged_manifest(staging: Path, root: Path, public_key: Ed25519PublicKey | Path | None = None) -> Manifest:
    """The manifest staged in `staging`, once its signature verifies with the farm's key (the
    provisioned one by default): what chunks are checked against as they arrive."""
    return signed_manifest(Path(staging), farm_public_key(root) if public_key is None else public_key_of(public_key))


def receive_chunks(staging: Path, root: Path, path: str, offset: int, read: Callable[[int], bytes],
                   public_key: Ed25519PublicKey | Path | None = None) -> tuple[ManifestFile, int]:
    """append_chunks for the file at `path` of the build staged in `staging`, checked against
    that build's signed manifest, which must be staged first; its entry and the bytes held."""
    staging, root = Path(staging), Path(root)
    manifest = staged_manifest(staging, root, public_key)
    entry = next((f for f in manifest.files if f.path == path), None)
    if entry is None:
        raise BundleError(f"{FILES}/{path}: not in build {manifest.build}'s manifest")
    return entry, append_chunks(root, entry, manifest.chunk_size, offset, read, staging / FILES / path)


def absorb_chunks(staging: Path, root: Path, check: bool = False,
                  public_key: Ed25519PublicKey | Path | None = None) -> dict[str, int]:
    """For a transport that cannot append (adb sync pushes whole files): append the chunk files
    <sha>.<index> waiting beside each partial upload of the build staged in `staging` (its
    signed manifest must be there), in order, each checked against the signed chunk list; a
    chunk that is missing, torn or wrong ends that file's run and is deleted with any after
    it. With `check`, each partial is first verified again (resume_point). A file made whole
    is moved to its path under `staging`/files. Returns sha256 -> bytes held, for every
    chunked file of the build that has a partial upload or is staged whole."""
    staging, root = Path(staging), Path(root)
    manifest = staged_manifest(staging, root, public_key)
    folder = root / RESUME
    held: dict[str, int] = {}
    for f in {f.sha256: f for f in reversed(manifest.files)}.values():
        waiting = sorted(folder.glob(f"{f.sha256}.*")) if folder.is_dir() else []
        partial = partial_upload(root, f.sha256)
        if not f.chunks or not (waiting or partial.exists()):
            continue
        n = partial.stat().st_size if partial.is_file() else 0
        if check or (n % manifest.chunk_size and n != f.size):
            n = resume_point(root, f, manifest.chunk_size)
        target = staging / FILES / f.path
        while n < f.size:
            piece = folder / f"{f.sha256}.{n // manifest.chunk_size}"
            if not piece.is_file():
                break
            try:
                with open(piece, "rb") as src:
                    after = append_chunks(root, f, manifest.chunk_size, n, src.read, target)
            except BundleError:
                break  # a wrong chunk, or a whole file that does not hash: sent again
            finally:
                piece.unlink(missing_ok=True)
            if after == n:
                break  # a torn chunk
            n = after
        if n == f.size and partial.exists():  # whole, but its move was cut short
            with contextlib.suppress(BundleError):
                append_chunks(root, f, manifest.chunk_size, n, lambda _n: b"", target)
        for stale in waiting:
            stale.unlink(missing_ok=True)
        held[f.sha256] = n if partial.exists() or target.is_file() else 0
    return held


def _read_exactly(read: Callable[[int], bytes], n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = read(min(n - got, IO_CHUNK))
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _hash_open(f) -> str:
    h = hashlib.sha256()
    f.seek(0)
    while block := f.read(IO_CHUNK):
        h.update(block)
    return h.hexdigest()
