"""Where the agent's paths may lead. On a device every path is the device's own and nothing
here applies. The virtual phone runs the agent on the host with $FARM_AGENT_FS_ROOT naming
the host folder that is the phone's "/": then every path the agent is given (arguments, its
root, the model and profile of a job document) must resolve, symlinks and ".." followed,
inside that folder, a device path inside a document is read under it, and the agent never
imports code from it. A path that leads out is refused before anything is read or written."""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

FS_ROOT_ENV = "FARM_AGENT_FS_ROOT"


class PathRefused(ValueError):
    """A path that leads outside the device's filesystem."""


@dataclass(frozen=True)
class FsRoot:
    base: Path | None = None  # None: the agent owns the whole filesystem (a real device)

    @classmethod
    def from_env(cls) -> FsRoot:
        value = os.environ.get(FS_ROOT_ENV)
        return cls(Path(value).resolve()) if value else cls()

    @property
    def confined(self) -> bool:
        return self.base is not None

    def check(self, path: str | Path, what: str) -> Path:
        """`path` (a host path, relative to the current folder or absolute), refused when it
        resolves outside the device's filesystem."""
        path = Path(path)
        if self.base is not None and not _inside(path.resolve(), self.base):
            raise PathRefused(f"{what} {path}: outside the device's filesystem (a symlink or '..' leads out "
                              "of it); name a path on the device")
        return path

    def device(self, path: str, what: str) -> Path:
        """The host file behind an absolute device path written in a document."""
        if self.base is None:
            return Path(path)
        return self.check(self.base / posixpath.normpath("/" + path).lstrip("/"), what)

    def within(self, folder: Path, relative: str, what: str) -> Path:
        """`folder`/`relative`, refused when it resolves outside `folder` (a model or profile
        named relative to a build must stay in the build, on any device)."""
        path = folder / relative
        if not _inside(path.resolve(), folder.resolve()):
            raise PathRefused(f"{what} {relative!r} leads outside the build ({folder}); name a path inside it")
        return path


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or path.is_relative_to(folder)
