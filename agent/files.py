"""Files written so that a crash leaves either the old or the new one: atomic writes, copies
that hash as they go, fsyncs of a folder, the install lock, and sweeping temporaries a crash
left. What the bundle's installer and the agent's jobs write with."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from pathlib import Path

IO_CHUNK = 1 << 20  # files are read and hashed this much at a time


def copy_hashing(source: Path, target: Path, fsync: bool = False,
                  chunk_size: int = 0) -> tuple[str, int, list[str]]:
    """Copy a file; its sha256, size and the sha256 of each `chunk_size` piece (none for 0)."""
    h, size, chunks = hashlib.sha256(), 0, []
    piece, piece_len = hashlib.sha256(), 0
    step = min(IO_CHUNK, chunk_size) if chunk_size else IO_CHUNK
    with open(source, "rb") as src, open(target, "xb") as dst:
        while chunk := src.read(step):
            h.update(chunk)
            dst.write(chunk)
            size += len(chunk)
            if chunk_size:
                piece.update(chunk)
                piece_len += len(chunk)
                if piece_len == chunk_size:
                    chunks.append(piece.hexdigest())
                    piece, piece_len = hashlib.sha256(), 0
        if fsync:
            dst.flush()
            os.fsync(dst.fileno())
    if piece_len:
        chunks.append(piece.hexdigest())
    return h.hexdigest(), size, chunks


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write via a temporary file, fsync and rename: a reader never sees half a file. The
    temporary file is made with `mode` (at most), so a private file is never readable by others."""
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex}"
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sweep_temporaries(root: Path) -> None:
    """Remove what an install killed part-way left behind (we hold the install lock)."""
    for folder in [root / "builds", *sorted((root / "store").glob("??"))]:
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith((".tmp-", ".old-")):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        entry.unlink()


@contextlib.contextmanager
def install_lock(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: the agent runs one job at a time anyway
        yield
        return
    with open(root / ".install.lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
