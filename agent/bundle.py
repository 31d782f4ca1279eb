"""Signed, content-addressed build bundles: the farm's keys, and how the agent checks and
installs a build (engine, shaders, agent, model weights, profiles). Packing one is
agent/packing.py's; uploads that resume inside a file, agent/uploads.py's; crash-safe writes,
agent/files.py's. A bundle is trusted
only through the farm's Ed25519 signature over the manifest and each file's sha256 in it; the
agent refuses anything else before a single byte reaches its store.

A bundle, as built and as pushed to a device:

    <bundle>/manifest.json     protocol.Manifest as JSON
    <bundle>/manifest.sig      raw 64-byte Ed25519 signature of Manifest.canonical_bytes()
    <bundle>/files/<path>      one file per manifest entry; a partial bundle (a re-deploy)
                               holds only the files the device's store lacks

The agent's root on the device:

    <root>/farm.pub                   the farm's public key (PEM), provisioned once
    <root>/store/<sha[:2]>/<sha>      content-addressed blobs, read-only, written by
                                      temp file + fsync + os.replace (never seen half written)
    <root>/builds/<build_id>/         the build as a tree: <path> for each manifest entry
                                      (hard links to the store where possible, else copies;
                                      executable files are always copies so their mode is
                                      their own), plus manifest.json and manifest.sig
    <root>/builds/current             symlink -> <build_id>, replaced atomically after the
                                      whole tree is in place (a one-line file on platforms
                                      without symlinks)

Build ids are immutable: installing a different manifest under an installed build id is
refused. Names starting with "." under store/ and builds/ are temporaries of an install in
progress and are swept by the next install (installs hold root/.install.lock).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from agent.files import (
    atomic_write,
    copy_hashing,
    fsync_dir,
    install_lock,
    sweep_temporaries,
)
from agent.protocol import (
    FARM_KEY,
    FILES,
    MANIFEST,
    NAME_PATTERN,
    SIGNATURE,
    Manifest,
    ManifestFile,
    ProtocolError,
    chunk_count,
    from_json,
    sha256_file,
)

CURRENT = "current"
# Names a build tree keeps for itself, so no manifest path may take them.
RESERVED_PATHS = frozenset({MANIFEST, SIGNATURE})
# Left out of folders given to agent.packing.build_bundle: interpreter caches and desktop litter.
DEFAULT_EXCLUDE = ("__pycache__", "*.pyc", "*.pyo", ".DS_Store", ".git")

_SHA256 = re.compile(r"[0-9a-f]{64}")
RESUME = "incoming/.resume"  # partial uploads, by sha256 (see partial_upload)
PARTIAL_LOCK_WAIT_S = 30.0


class BundleError(ValueError):
    """A bundle, key or install that cannot be trusted or completed; the message names the
    offending file and the reason."""


class OffsetRefused(BundleError):
    """An upload of a file's rest from a byte the device does not hold it up to (or off a chunk
    boundary): ask again what it holds."""


@dataclass
class InstalledBuild:
    build_id: str
    path: Path  # <root>/builds/<build_id>
    manifest: Manifest
    kept_current: str | None = None  # install_bundle: the newer build left current (a downgrade not allowed)


# ---- keys -----------------------------------------------------------------------------------


def generate_keypair(private_path: Path, public_path: Path, overwrite: bool = False) -> Ed25519PrivateKey:
    """Write a new Ed25519 key pair as PEM: the private key with mode 0600 (created so, never
    widened afterwards), the public key world-readable. Refuses to replace existing files
    unless `overwrite`."""
    private_path, public_path = Path(private_path), Path(public_path)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    for path in (private_path, public_path):
        if path.exists() and not overwrite:
            raise BundleError(f"{path}: already exists; refusing to overwrite a key (pass overwrite=True)")
        path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        private_path.unlink()  # so O_CREAT applies 0600 to a fresh inode
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public_path.write_bytes(public_pem)
    return key


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key; on POSIX refuses one readable by group or others."""
    path = Path(path)
    if os.name == "posix" and path.stat().st_mode & 0o077:
        raise BundleError(f"{path}: private key is readable by others (mode "
                          f"{stat.S_IMODE(path.stat().st_mode):o}); fix with `chmod 600 {path}`")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise BundleError(f"{path}: not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError(f"{path}: expected an Ed25519 key, got {type(key).__name__}")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read an Ed25519 public key: PEM (SubjectPublicKeyInfo) or an OpenSSH `ssh-ed25519` line."""
    path = Path(path)
    data = path.read_bytes()
    try:
        if data.lstrip().startswith(b"ssh-"):
            key = serialization.load_ssh_public_key(data.strip())
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise BundleError(f"{path}: not a PEM or OpenSSH public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BundleError(f"{path}: expected an Ed25519 key, got {type(key).__name__}")
    return key


def provision_public_key(root: Path, public_key: Ed25519PublicKey | Path) -> Path:
    """Install the farm's public key as <root>/farm.pub (done once per device)."""
    key = public_key if isinstance(public_key, Ed25519PublicKey) else load_public_key(public_key)
    pem = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_write(root / FARM_KEY, pem, mode=0o644)
    return root / FARM_KEY


def farm_public_key(root: Path) -> Ed25519PublicKey:
    path = Path(root) / FARM_KEY
    if not path.is_file():
        raise BundleError(f"{path}: no farm public key is provisioned on this device; "
                          "provision it once with bundle.provision_public_key")
    return load_public_key(path)


# ---- verifying ------------------------------------------------------------------------------


def verify_bundle(bundle_dir: Path, public_key: Ed25519PublicKey | Path, partial: bool = False) -> Manifest:
    """Check a bundle and return its manifest: the signature first (nothing else in an unsigned
    document is read as trusted), then the manifest's paths and hashes, then every file under
    files/: no symlinks, nothing outside the manifest, each size and sha256 as signed. With
    `partial`, files may be absent (a re-deploy that sends only what the store lacks)."""
    manifest = signed_manifest(Path(bundle_dir), public_key)
    present = _check_present_files(Path(bundle_dir), manifest)
    if not partial:
        absent = [f.path for f in manifest.files if f.path not in present]
        if absent:
            raise BundleError(f"{FILES}/{absent[0]}: listed in the manifest but missing from the bundle"
                              + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
    return manifest


def signed_manifest(bundle_dir: Path, public_key) -> Manifest:
    key = public_key_of(public_key)
    manifest_path, sig_path = bundle_dir / MANIFEST, bundle_dir / SIGNATURE
    for path in (manifest_path, sig_path):
        if path.is_symlink() or not path.is_file():
            what = "the manifest signature (unsigned bundle)" if path is sig_path else "the manifest"
            raise BundleError(f"{path.name}: missing or not a regular file: a bundle needs {what}")
    text = manifest_path.read_bytes()
    try:
        manifest = from_json(Manifest, text)
    except ProtocolError as exc:
        raise BundleError(f"{MANIFEST}: {exc}") from None
    try:
        key.verify(sig_path.read_bytes(), manifest.canonical_bytes())
    except InvalidSignature:
        raise BundleError(f"{MANIFEST}: manifest signature does not verify with the provisioned key") from None
    check_manifest(manifest)
    return manifest


def _check_present_files(bundle_dir: Path, manifest: Manifest) -> dict[str, Path]:
    """Every entry under the bundle must be expected and intact; returns path -> file."""
    expected = {f.path: f for f in manifest.files}
    for entry in bundle_dir.iterdir():
        if entry.name not in (MANIFEST, SIGNATURE, FILES):
            raise BundleError(f"{entry.name}: not part of a bundle (only {MANIFEST}, {SIGNATURE}, {FILES}/)")
    files_dir = bundle_dir / FILES
    present: dict[str, Path] = {}
    if not files_dir.exists() and not files_dir.is_symlink():
        return present
    if files_dir.is_symlink() or not files_dir.is_dir():
        raise BundleError(f"{FILES}: must be a real folder, not a symlink or a file")
    for dirpath, dirnames, filenames in os.walk(files_dir):  # never follows symlinks
        base = Path(dirpath)
        for name in dirnames + filenames:
            entry = base / name
            rel = entry.relative_to(files_dir).as_posix()
            if entry.is_symlink():
                raise BundleError(f"{FILES}/{rel}: is a symlink (-> {os.readlink(entry)}); bundles hold regular files only")
            if name in dirnames:
                if rel in expected:
                    raise BundleError(f"{FILES}/{rel}: is a folder, the manifest lists a file")
                continue
            if rel not in expected:
                raise BundleError(f"{FILES}/{rel}: not in the manifest")
            if not entry.is_file():
                raise BundleError(f"{FILES}/{rel}: not a regular file")
            _check_file(entry, expected[rel], f"{FILES}/{rel}")
            present[rel] = entry
    return present


def _check_file(path: Path, entry: ManifestFile, label: str) -> None:
    size = path.stat().st_size
    if size != entry.size:
        raise BundleError(f"{label}: size mismatch (manifest {entry.size} bytes, file {size})")
    if sha256_file(path) != entry.sha256:
        raise BundleError(f"{label}: sha256 mismatch")


def check_manifest(manifest: Manifest) -> None:
    check_build_id(manifest.build)
    seen: set[str] = set()
    for f in manifest.files:
        check_path(f.path)
        if f.path in seen:
            raise BundleError(f"{FILES}/{f.path}: listed twice in the manifest")
        seen.add(f.path)
        if not _SHA256.fullmatch(f.sha256):
            raise BundleError(f"{FILES}/{f.path}: sha256 {f.sha256!r} is not 64 lowercase hex digits")
        if f.size < 0 or not 0 <= f.mode <= 0o777:
            raise BundleError(f"{FILES}/{f.path}: bad size {f.size} or mode {f.mode:o}")
        if manifest.chunk_size < 0 or len(f.chunks) != chunk_count(f.size, manifest.chunk_size):
            raise BundleError(f"{FILES}/{f.path}: {len(f.chunks)} chunk hashes listed; {f.size} bytes in chunks of "
                              f"{manifest.chunk_size} make {chunk_count(f.size, max(manifest.chunk_size, 0))}")
        if not all(_SHA256.fullmatch(c) for c in f.chunks):
            raise BundleError(f"{FILES}/{f.path}: a chunk sha256 is not 64 lowercase hex digits")
    for path in seen:  # "a" and "a/b" cannot both be files
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise BundleError(f"{FILES}/{path}: its parent {'/'.join(parts[:i])} is listed as a file")


def check_path(path: str) -> None:
    """A manifest path: relative, forward slashes, no '..', '.' or empty parts, no drive."""
    label = f"{FILES}/{path}"
    if not path or "\x00" in path:
        raise BundleError(f"{label}: empty path or NUL byte")
    if "\\" in path:
        raise BundleError(f"{label}: backslash in path (paths use forward slashes)")
    if path.startswith("/") or re.match(r"[A-Za-z]:", path):
        raise BundleError(f"{label}: absolute path")
    parts = path.split("/")
    if ".." in parts:
        raise BundleError(f"{label}: path traversal ('..')")
    if any(p in ("", ".") for p in parts):
        raise BundleError(f"{label}: empty or '.' path component")
    if path in RESERVED_PATHS:
        raise BundleError(f"{label}: reserved name (the build tree keeps its manifest there)")


def check_build_id(build_id: str) -> None:
    if not NAME_PATTERN.fullmatch(build_id or "") or build_id == CURRENT:
        raise BundleError(f"build id {build_id!r}: use letters, digits and ._+- (not starting with "
                          f"'.' or '-', at most 128, not {CURRENT!r})")


def public_key_of(key) -> Ed25519PublicKey:
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, str | os.PathLike):
        return load_public_key(Path(key))
    raise BundleError(f"expected an Ed25519 public key or its file, got {type(key).__name__}")


# ---- installing -----------------------------------------------------------------------------


def blob_path(root: Path, sha256: str) -> Path:
    return Path(root) / "store" / sha256[:2] / sha256


def missing_files(manifest: Manifest, root: Path, staged: Path | None = None) -> list[ManifestFile]:
    """The manifest entries whose blob the store lacks (absent, or not hashing to its sha256:
    a blob damaged in place is sent again), one per distinct sha256: a re-deploy sends only
    these; install takes the rest from the store. With `staged` (a bundle folder an
    interrupted upload was filling), a file already there whole (its size and sha256) is not
    missing either: a resumed upload sends only what had not arrived, and a damaged staged
    file is sent again rather than refused at every install."""
    out, seen = [], set()
    present = set()
    with HashCache(root) as hashes:
        for f in manifest.files if staged is not None else []:
            if f.sha256 not in present and hashes.holds(staged / FILES / f.path, f):
                present.add(f.sha256)
        for f in manifest.files:
            if f.sha256 in seen:
                continue
            seen.add(f.sha256)
            if f.sha256 not in present and not hashes.holds(blob_path(root, f.sha256), f):
                out.append(f)
    return out


def arrived_bytes(manifest: Manifest, root: Path, files: Iterable[ManifestFile]) -> dict[str, int]:
    """Of `files` (what missing_files lists), sha256 -> the bytes an interrupted upload already
    left here, verified chunk by chunk (resume_point), for those with any: a resumed upload
    sends only the rest, and its progress counts only what it sends."""
    held = {f.sha256: resume_point(root, f, manifest.chunk_size) for f in files}
    return {sha: n for sha, n in held.items() if n}


# ---- resuming an upload inside a file ---------------------------------------------------------
#
# A file of a build whose manifest lists chunk hashes arrives as <root>/incoming/.resume/<sha>:
# only whole chunks, each checked against the signed manifest's list before it is appended, so
# the partial is always a verified prefix of the file; a cut costs at most the chunk it went
# through. Once whole, its sha256 is checked and it is moved to its staged path. A transport that
# cannot append (adb sync) leaves each chunk beside it as <sha>.<index> for absorb_chunks.


def partial_upload(root: Path, sha256: str) -> Path:
    """Where the verified first chunks of blob `sha256` wait for the rest of it."""
    return Path(root) / RESUME / sha256


def resume_point(root: Path, entry: ManifestFile, chunk_size: int) -> int:
    """The bytes of `entry` an interrupted upload left on this device: the whole chunks at the
    start of its partial upload that hash as the manifest lists (read a chunk at a time). What
    follows the first chunk that does not (torn by a crash, damaged) is cut off and dropped,
    never trusted; 0 when nothing usable is there or the manifest lists no chunks."""
    path = partial_upload(root, entry.sha256)
    if not chunk_size or not entry.chunks or not path.is_file() or path.is_symlink():
        return 0
    good = 0
    try:
        with locked_partial(path, entry, create=False) as f:
            for k, digest in enumerate(entry.chunks):
                want = min(chunk_size, entry.size - k * chunk_size)
                piece = f.read(want)
                if len(piece) != want or hashlib.sha256(piece).hexdigest() != digest:
                    break
                good += want
            f.truncate(good)
            if good == 0:
                path.unlink()
    except FileNotFoundError:  # made whole and moved into place meanwhile
        return 0
    return good


@contextlib.contextmanager
def locked_partial(path: Path, entry: ManifestFile, create: bool = True):
    """The partial upload open for reading and writing, held alone: an upload whose connection
    was cut may still be appending its last chunks when the resumed one asks (or, cut without
    a word, until its idle timeout); it is waited for, up to PARTIAL_LOCK_WAIT_S. One made whole
    and moved away meanwhile is not it: FileNotFoundError (or, with `create`, a new one)."""
    try:
        import fcntl
    except ImportError:  # Windows: one deploy at a time anyway
        fcntl = None
    deadline = time.monotonic() + PARTIAL_LOCK_WAIT_S
    while True:
        f = os.fdopen(os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644), "r+b")
        try:
            while fcntl is not None:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise BundleError(f"{FILES}/{entry.path}: another upload of it is still being received "
                                          f"after {PARTIAL_LOCK_WAIT_S:g} s; try again") from None
                    time.sleep(0.02)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                    break
        except BaseException:
            f.close()
            raise
        f.close()
        if not create:
            raise FileNotFoundError(path)
    with f:
        yield f


def verify_build(root: Path, build: InstalledBuild) -> list[str]:
    """The paths of an installed build whose file is missing or does not hash to the signed
    manifest's sha256 (empty: the build is intact). Run before every job, so a file damaged
    after its install never runs; cheap after the first time (HashCache)."""
    damaged = []
    with HashCache(root) as hashes:
        for f in build.manifest.files:
            if not hashes.holds(build.path / f.path, f):
                damaged.append(f.path)
    return damaged


class HashCache:
    """What this agent root has hashed: a file's identity and change times -> its sha256, in
    <root>/hashes.json. A file is hashed again when its inode, size, mtime or ctime differ
    from the recorded ones; writing into a file changes its mtime and ctime (and only the
    kernel sets ctime), so a file damaged in place is hashed again and found out. The cache
    holds only what was hashed here; a lost or unreadable one costs a re-hash, nothing more."""

    NAME = "hashes.json"
    MAX_ENTRIES = 100_000

    def __init__(self, root: Path):
        self.path = Path(root) / self.NAME
        self.entries: dict[str, list] = {}
        self.changed = False

    def __enter__(self) -> HashCache:
        import json

        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict):
                self.entries = loaded
        except (OSError, ValueError):
            pass
        return self

    def __exit__(self, *exc) -> None:
        import json

        if not self.changed or not self.path.parent.is_dir():
            return
        if len(self.entries) > self.MAX_ENTRIES:  # files long gone: start again
            self.entries = dict(list(self.entries.items())[-self.MAX_ENTRIES // 2:])
        tmp = self.path.parent / f".tmp-{self.NAME}-{uuid.uuid4().hex}"
        try:
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only or full root: the next look hashes again
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def holds(self, path: Path, entry: ManifestFile) -> bool:
        """Whether `path` is a regular file (not a symlink) of the entry's size and sha256."""
        try:
            st = os.lstat(path)
        except (OSError, ValueError):  # absent, or a manifest path this filesystem cannot hold
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            return False
        key = f"{st.st_dev}:{st.st_ino}"
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        known = self.entries.get(key)
        if isinstance(known, list) and len(known) == 4 and known[:3] == stamp:
            return known[3] == entry.sha256
        try:
            digest = sha256_file(path)
            after = os.lstat(path)
        except OSError:
            return False
        if [after.st_size, after.st_mtime_ns, after.st_ctime_ns] == stamp:  # unchanged while hashed
            self.entries[key] = [*stamp, digest]
            self.changed = True
        return digest == entry.sha256


def install_bundle(bundle_dir: Path, root: Path, public_key: Ed25519PublicKey | Path | None = None,
                   activate: bool = True, allow_downgrade: bool = False) -> InstalledBuild:
    """Verify a (possibly partial) bundle, add its files to the store, materialize the build
    tree and, with `activate`, point builds/current at it. `public_key` None means the
    provisioned <root>/farm.pub. Nothing becomes visible before it is complete: an install
    that fails part-way leaves the store without partial blobs and `current` unchanged.

    A build signed before the current one is installed beside it (jobs that name it run it)
    but made current only with `allow_downgrade`: an old, validly signed build never becomes
    what the device runs by default on its own. The returned build's `kept_current` then
    names the build left current."""
    bundle_dir, root = Path(bundle_dir), Path(root)
    key = farm_public_key(root) if public_key is None else public_key_of(public_key)
    with install_lock(root):
        sweep_temporaries(root)
        # 1. trust: signature, manifest, the files that came
        manifest = signed_manifest(bundle_dir, key)
        present = _check_present_files(bundle_dir, manifest)
        # 2. the files that did not come must already be in the store, intact
        coming = {f.sha256 for f in manifest.files if f.path in present}
        with HashCache(root) as hashes:
            for f in manifest.files:
                if f.path in present or f.sha256 in coming:
                    continue
                blob = blob_path(root, f.sha256)
                if not blob.is_file():
                    raise BundleError(f"{FILES}/{f.path}: not in the bundle and not in the device's store "
                                      f"(sha256 {f.sha256[:12]}...); send the files missing_files() lists")
                if not hashes.holds(blob, f):
                    _check_file(blob, f, f"{FILES}/{f.path} (store blob {f.sha256[:12]}...)")
        # 3. store the files that came (skipping blobs already there and intact); an upload
        # of one of them cut off earlier is of no use now
        for f in manifest.files:
            if f.path in present:
                _store_blob(present[f.path], f, root)
            partial_upload(root, f.sha256).unlink(missing_ok=True)
        # 4. the build tree, then 5. the switch
        build = _materialize(bundle_dir, manifest, root)
        current = current_build(root) if activate else None
        if (current is not None and current.build_id != build.build_id and not allow_downgrade
                and manifest.created < current.manifest.created):
            build.kept_current = current.build_id
        elif activate:
            activate_build(root, build.build_id)
        return build


def _store_blob(source: Path, entry: ManifestFile, root: Path) -> None:
    blob = blob_path(root, entry.sha256)
    if blob.is_file() and not blob.is_symlink():
        try:
            _check_file(blob, entry, "store blob")
            return
        except BundleError:
            pass  # a damaged blob: replace it with the verified copy below
    blob.parent.mkdir(parents=True, exist_ok=True)
    tmp = blob.parent / f".tmp-{entry.sha256[:12]}-{uuid.uuid4().hex}"
    try:
        # Hash again while copying: the bundle file could change between check and copy.
        digest, size, _ = copy_hashing(source, tmp, fsync=True)
        if digest != entry.sha256 or size != entry.size:
            raise BundleError(f"{FILES}/{entry.path}: changed while being installed (sha256 mismatch)")
        os.chmod(tmp, 0o444)
        os.replace(tmp, blob)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(blob.parent)


def _materialize(bundle_dir: Path, manifest: Manifest, root: Path) -> InstalledBuild:
    builds = root / "builds"
    builds.mkdir(parents=True, exist_ok=True)
    final = builds / manifest.build
    if final.exists():
        existing = _read_build(final)
        if existing is None:
            raise BundleError(f"{final}: exists but holds no readable {MANIFEST}; remove it and install again")
        if existing.manifest.canonical_bytes() != manifest.canonical_bytes():
            raise BundleError(f"build {manifest.build!r} is already installed with a different manifest; "
                              "build ids are immutable, build again under a new id")
        if _tree_intact(final, manifest):
            return existing
    tmp = builds / f".tmp-{manifest.build}-{uuid.uuid4().hex}"
    try:
        tmp.mkdir()
        for f in manifest.files:
            target = tmp / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            blob = blob_path(root, f.sha256)
            if f.mode & 0o111 or not _try_link(blob, target):
                shutil.copyfile(blob, target)
                os.chmod(target, f.mode)
        shutil.copyfile(bundle_dir / MANIFEST, tmp / MANIFEST)
        shutil.copyfile(bundle_dir / SIGNATURE, tmp / SIGNATURE)
        for dirpath, _, _ in os.walk(tmp):
            fsync_dir(Path(dirpath))
        if final.exists():  # same manifest, damaged tree: swap it for the fresh one
            old = builds / f".old-{manifest.build}-{uuid.uuid4().hex}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(builds)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return InstalledBuild(manifest.build, final, manifest)


def _tree_intact(tree: Path, manifest: Manifest) -> bool:
    with HashCache(tree.parent.parent) as hashes:
        return all(hashes.holds(tree / f.path, f) for f in manifest.files)


def _try_link(blob: Path, target: Path) -> bool:
    try:
        os.link(blob, target)
        return True
    except OSError:  # another filesystem, or one without hard links (FAT on a phone's sdcard)
        return False


def activate_build(root: Path, build_id: str) -> InstalledBuild:
    """Point <root>/builds/current at an installed build (also how to roll back)."""
    builds = Path(root) / "builds"
    check_build_id(build_id)
    build = _read_build(builds / build_id)
    if build is None:
        raise BundleError(f"build {build_id!r} is not installed under {builds}")
    tmp = builds / f".tmp-current-{uuid.uuid4().hex}"
    try:
        os.symlink(build_id, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):  # no symlinks here (Windows without privilege)
        tmp.write_text(build_id + "\n")
    try:
        os.replace(tmp, builds / CURRENT)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_dir(builds)
    return build


def list_builds(root: Path) -> list[InstalledBuild]:
    """Installed builds, oldest first (by manifest creation time)."""
    builds = Path(root) / "builds"
    if not builds.is_dir():
        return []
    out = []
    for entry in builds.iterdir():
        if entry.name.startswith(".") or entry.name == CURRENT or entry.is_symlink():
            continue
        build = _read_build(entry)
        if build is not None:
            out.append(build)
    return sorted(out, key=lambda b: (b.manifest.created, b.build_id))


def current_build(root: Path) -> InstalledBuild | None:
    link = Path(root) / "builds" / CURRENT
    if link.is_symlink():
        name = os.readlink(link)
    elif link.is_file():
        name = link.read_text().strip()
    else:
        return None
    if "/" in name or "\\" in name:  # always written relative by activate_build
        return None
    return _read_build(link.parent / name)


def _read_build(path: Path) -> InstalledBuild | None:
    try:
        manifest = from_json(Manifest, (path / MANIFEST).read_bytes())
    except (OSError, ProtocolError):
        return None
    return InstalledBuild(manifest.build, path, manifest)
