"""Packing a build: the files of its sources (the engine, shaders and agent of a checkout, model
weights, profiles) laid out as a bundle (files/ by path, chunked, hashed) with its manifest,
signed with the farm's key. A source's symbolic links are followed only inside its link root;
anything else is refused in one line. What `farm builds create` calls; the device checks what it
receives with agent/bundle.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.bundle import (
    DEFAULT_EXCLUDE,
    BundleError,
    check_build_id,
    check_manifest,
    check_path,
    load_private_key,
)
from agent.files import IO_CHUNK, copy_hashing
from agent.protocol import (
    CHUNK_SIZE,
    FILES,
    MANIFEST,
    SIGNATURE,
    Manifest,
    ManifestFile,
    to_json,
)


def build_bundle(sources: dict[str, Path], out_dir: Path, build_id: str, version: str,
                 private_key: Ed25519PrivateKey | Path, source_revision: str = "",
                 exclude: Iterable[str] = DEFAULT_EXCLUDE, chunk_size: int = CHUNK_SIZE,
                 link_roots: dict[str, Path] | None = None) -> Manifest:
    """Pack `sources` (bundle path -> file or folder) into `out_dir` (absent or empty) and sign
    the manifest, which lists each file's sha256 and the sha256 of each of its `chunk_size`
    chunks. Folders are walked recursively, leaving out names matching `exclude`. A build holds
    only regular files from inside its sources: a symbolic link is packed as what it points to
    where that lies inside the folder's link root (the folder itself, or the wider folder
    `link_roots` gives for its bundle path: a Hugging Face snapshot's links point into its
    repository's blob cache, a checkout's folders may link to each other), and any other link
    (out of the root, dangling, or a loop) is refused with one line naming it and its target,
    so a source tree that links to the farm's key or /etc/passwd cannot ship them."""
    if chunk_size <= 0 or chunk_size % IO_CHUNK and IO_CHUNK % chunk_size:
        raise BundleError(f"chunk size {chunk_size}: a positive divisor or multiple of {IO_CHUNK} bytes")
    key = private_key if isinstance(private_key, Ed25519PrivateKey) else load_private_key(private_key)
    check_build_id(build_id)
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise BundleError(f"{out_dir}: output folder is not empty")
    exclude = tuple(exclude)
    entries: dict[str, Path] = {}
    for bundle_path, source in sorted(sources.items()):
        source = Path(source)
        check_path(bundle_path)
        if source.is_file():
            _add_entry(entries, bundle_path, source)
        elif source.is_dir():
            root = Path((link_roots or {}).get(bundle_path, source))
            for rel, file in _walk_source(source, exclude, root, bundle_path):
                _add_entry(entries, f"{bundle_path}/{rel}", file)
        else:
            raise BundleError(f"{bundle_path}: source {source} is neither a file nor a folder")
    files = []
    for path, source in sorted(entries.items()):
        target = out_dir / FILES / path
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size, chunks = copy_hashing(source, target, chunk_size=chunk_size)
        mode = 0o755 if source.stat().st_mode & 0o111 else 0o644
        os.chmod(target, mode)
        files.append(ManifestFile(path=path, sha256=digest, size=size, mode=mode, chunks=chunks))
    manifest = Manifest(build=build_id, version=version, created=time.time(), files=files,
                        source_revision=source_revision, chunk_size=chunk_size)
    check_manifest(manifest)
    (out_dir / MANIFEST).write_text(to_json(manifest))
    (out_dir / SIGNATURE).write_bytes(key.sign(manifest.canonical_bytes()))
    return manifest


def _walk_source(folder: Path, exclude: tuple[str, ...], root: Path, label: str) -> Iterator[tuple[str, Path]]:
    """(path in the folder, file) for every regular file under `folder`, through links only
    where they stay inside `root` (see build_bundle)."""
    real_root = root.resolve()
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        here = Path(os.path.realpath(dirpath))
        dirnames[:] = sorted(d for d in dirnames if not _excluded(d, exclude))
        for name in dirnames:
            link = Path(dirpath) / name
            _check_link(folder, link, real_root, label)
            if link.is_symlink() and here.is_relative_to(link.resolve()):  # back to where the walk is
                raise BundleError(f"{label}/{link.relative_to(folder).as_posix()}: a link loop (to "
                                  f"{os.readlink(link)}, a folder it lies in); a build holds only files")
        for name in sorted(filenames):
            if _excluded(name, exclude):
                continue
            file = Path(dirpath) / name
            _check_link(folder, file, real_root, label)
            if not file.is_file():
                raise BundleError(f"{label}/{file.relative_to(folder).as_posix()}: not a regular file "
                                  "(a device, socket or pipe); a build holds only files")
            yield file.relative_to(folder).as_posix(), file


def _check_link(folder: Path, path: Path, real_root: Path, label: str) -> None:
    """Refuse `path` where it is a link whose target is missing or lies outside `real_root`."""
    if not path.is_symlink():
        return
    name = f"{label}/{path.relative_to(folder).as_posix()}"
    target = os.readlink(path)
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop of links
        raise BundleError(f"{name}: a link to {target} that leads nowhere; a build holds only files") from None
    if not resolved.is_relative_to(real_root):
        raise BundleError(f"{name}: a link to {resolved}, outside {real_root}; a build holds only the files "
                          "inside its sources (replace the link with the file, or leave it out)")


def _excluded(name: str, patterns: tuple[str, ...]) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(name, p) for p in patterns)


def _add_entry(entries: dict[str, Path], path: str, source: Path) -> None:
    check_path(path)
    if path in entries:
        raise BundleError(f"{path}: given twice ({entries[path]} and {source})")
    entries[path] = source
