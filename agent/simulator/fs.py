"""The virtual phone's filesystem: device paths (/data/local/tmp/x, /sdcard/y) live under
`root/fs`, and read-only virtual files (/sys/class/thermal/..., /proc/...) are computed on
each read. Shell and sync both go through this class, so they see the same files. A device
path is normalised against "/" before it is mapped, and the mapped host path is resolved and
checked to lie inside `root/fs`, so neither ".." nor a symlink can reach the host."""

from __future__ import annotations

import errno
import fnmatch
import os
import posixpath
import stat as st
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Directories every Android device has; sync and shell tests expect them to exist.
DEFAULT_DIRS = ("data/local/tmp", "sdcard/Download", "storage/emulated/0", "system/bin", "vendor")
READ_ONLY_TREES = ("/sys", "/proc", "/system", "/vendor")


def fs_error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


@dataclass(frozen=True)
class Stat:
    mode: int
    size: int
    mtime: int
    atime: int = 0
    ctime: int = 0
    ino: int = 0
    nlink: int = 1
    dev: int = 0
    uid: int = 2000  # shell
    gid: int = 2000

    @property
    def is_dir(self) -> bool:
        return st.S_ISDIR(self.mode)


class SandboxFS:
    def __init__(self, root: Path, virtual_files: dict[str, Callable[[], bytes]] | None = None):
        self.base = (Path(root) / "fs").resolve()
        for d in DEFAULT_DIRS:
            (self.base / d).mkdir(parents=True, exist_ok=True)
        self.virtual_files = dict(virtual_files or {})
        self._boot = int(time.time())

    # ---- paths -------------------------------------------------------------------------

    @staticmethod
    def normalize(path: str, cwd: str = "/") -> str:
        p = posixpath.normpath(posixpath.join(cwd, path))
        return "/" + p.lstrip("/")  # normpath keeps a leading "//"; ".." above / stays at /

    def host_path(self, path: str, cwd: str = "/") -> Path:
        """The host path behind a device path; EACCES if it would leave the sandbox."""
        device = self.normalize(path, cwd)
        host = self.base / device.lstrip("/")
        resolved = host.resolve()
        if resolved != self.base and not resolved.is_relative_to(self.base):
            raise fs_error(errno.EACCES, device)
        return host

    def device_path(self, host: str | Path) -> str:
        rel = Path(host).resolve().relative_to(self.base)
        return "/" + rel.as_posix() if str(rel) != "." else "/"

    def _virtual_dirs(self) -> set[str]:
        dirs = set()
        for f in self.virtual_files:
            d = posixpath.dirname(f)
            while d != "/":
                dirs.add(d)
                d = posixpath.dirname(d)
        return dirs

    def _read_only(self, device: str) -> bool:
        return any(device == t or device.startswith(t + "/") for t in READ_ONLY_TREES)

    # ---- queries -----------------------------------------------------------------------

    def stat(self, path: str, cwd: str = "/") -> Stat:
        device = self.normalize(path, cwd)
        if device in self.virtual_files:
            return Stat(st.S_IFREG | 0o444, len(self.virtual_files[device]()), self._boot)
        if device in self._virtual_dirs():
            return Stat(st.S_IFDIR | 0o555, 0, self._boot, nlink=2)
        try:
            s = self.host_path(device).stat()
        except OSError as exc:  # name the device path, never the host path behind it
            raise fs_error(exc.errno or errno.EIO, device) from None
        return Stat(s.st_mode, s.st_size, int(s.st_mtime), int(s.st_atime), int(s.st_ctime),
                    s.st_ino, s.st_nlink, s.st_dev)

    def try_stat(self, path: str, cwd: str = "/") -> Stat | None:
        try:
            return self.stat(path, cwd)
        except OSError:
            return None

    def listdir(self, path: str, cwd: str = "/") -> list[str]:
        device = self.normalize(path, cwd)
        names = set()
        prefix = device.rstrip("/") + "/"
        for v in list(self.virtual_files) + list(self._virtual_dirs()):
            if v.startswith(prefix) and "/" not in v[len(prefix):]:
                names.add(v[len(prefix):])
        host = self.host_path(device)
        if host.is_dir():
            names.update(os.listdir(host))
        elif not names:
            code = errno.ENOTDIR if host.exists() else errno.ENOENT
            raise fs_error(code, device)
        return sorted(names)

    def read_bytes(self, path: str, cwd: str = "/") -> bytes:
        device = self.normalize(path, cwd)
        if device in self.virtual_files:
            return self.virtual_files[device]()
        if device in self._virtual_dirs():
            raise fs_error(errno.EISDIR, device)
        host = self.host_path(device)
        if host.is_dir():
            raise fs_error(errno.EISDIR, device)
        if not host.exists():
            raise fs_error(errno.ENOENT, device)
        return host.read_bytes()

    def readable_host_file(self, path: str, cwd: str = "/") -> Path | None:
        """The host file to stream for a real (non-virtual) regular file, else None."""
        device = self.normalize(path, cwd)
        if device in self.virtual_files:
            return None
        host = self.host_path(device)
        return host if host.is_file() else None

    def glob(self, pattern: str, cwd: str = "/") -> list[str]:
        """Expand a shell pattern component by component; results are in the pattern's form
        (relative patterns give relative paths), sorted, empty if nothing matches."""
        absolute = pattern.startswith("/")
        parts = [p for p in pattern.split("/") if p]
        found = ["/" if absolute else ""]
        for part in parts:
            nxt = []
            for base in found:
                if not any(c in part for c in "*?["):
                    nxt.append(posixpath.join(base, part) if base else part)
                    continue
                try:
                    names = self.listdir(base or ".", cwd)
                except OSError:
                    continue
                nxt += [posixpath.join(base, n) if base else n for n in names
                        if fnmatch.fnmatchcase(n, part) and (part.startswith(".") or not n.startswith("."))]
            found = nxt
        return sorted(p for p in found if self.try_stat(p, cwd) is not None)

    # ---- changes -----------------------------------------------------------------------

    def writable_host_path(self, path: str, cwd: str = "/") -> Path:
        device = self.normalize(path, cwd)
        if self._read_only(device):
            raise fs_error(errno.EROFS, device)
        return self.host_path(device)

    def mkdirs(self, path: str, cwd: str = "/") -> None:
        self.writable_host_path(path, cwd).mkdir(parents=True, exist_ok=True)
