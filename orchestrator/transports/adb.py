"""The adb transport: a phone reached over ADB (TCP, or USB when adb-shell's usb extra is
installed) with no adb server in between. It owns the host's RSA key (generated on first
use, kept 0600), the socket (TCP_NODELAY: Nagle's algorithm would hold small messages ~40 ms),
and the device-side layout under a device root (default /data/local/tmp/devicefarm):

    <root>/store/<aa>/<sha>             the agent's blob store (read, via one `stat` per batch)
    <root>/incoming/.partial/<sha>      files being pushed; only complete files leave it, by `mv`
    <root>/incoming/.resume/<sha>       a file of several chunks being pushed: its whole chunks so far,
    <root>/incoming/.resume/<sha>.<k>   checked and appended by the agent, then moved into place
    <root>/incoming/<build>/            the staged bundle: manifest.json, manifest.sig, files/...
    <root>/incoming/jobs/<job>.json     job documents
    <root>/jobs/<job>/                  a job's output folder (result.json, job.log, artifacts)

A deploy stages the signed manifest, asks the device which blobs it lacks (its store and what an
interrupted deploy already staged), pushes only those to temporary names and moves each into
place once whole, then runs `farm-agent install` on the staged folder. A file of several
chunks goes a chunk at a time (`farm-agent resume` checks each against the signed manifest
and appends it), so a cut deploy resumes it from its last whole chunk. A job runs
`farm-agent run --json` over shell v2 (exit code and stderr apart), streams the agent's JSON
progress lines from stderr, and pulls result.json's artifacts. Everything on the device goes through the agent command,
toybox commands and sync; nothing here imports the agent's job code.

Every connection is a SharedAdbDevice (adb_shared.py): the ADB protocol with one reader thread per
connection, so that streams the phone opens (the OPENs of an `adb reverse` forward,
orchestrator/transports/adb_reverse.py) are taken and relayed on the same connection while the
transport's own commands run on it, over USB as over TCP. Of adb-shell it uses only the public
pieces: message packing, constants, exceptions, the USB transport and the RSA key tools.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import select
import shlex
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from adb_shell import exceptions as adb_errors

from agent.link import RESUME, collect_android
from agent.protocol import (
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    FILES,
    MANIFEST,
    SIGNATURE,
    DeviceInfo,
    JobSpec,
    Manifest,
    ManifestFile,
    ProtocolError,
    from_json,
    to_json,
)
from orchestrator.transports.adb_shared import HostStream, ServiceRefused, SharedAdbDevice
from orchestrator.transports.adb_sync import SyncFailed
from orchestrator.transports.base import (
    MAX_REPLY_BYTES,
    AgentExit,
    BundleRefused,
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    InfraFailure,
    ProgressFn,
    ProtocolMismatch,
    Screenshot,
    Transport,
    TransportError,
    kept_current,
    reply_too_large,
)

log = logging.getLogger("orchestrator.transports.adb")
STDERR_TAIL_BYTES = 2**20  # of a command's stderr, what is kept for its error message (lines are relayed as they come)

DEFAULT_KEY = Path("~/.config/devicefarm/adbkey")
DEFAULT_ROOT = "/data/local/tmp/devicefarm"
_COMMAND_CHARS = 3000  # keep each shell line well under the 4 KiB an old adbd takes in an OPEN
# Chunks pushed before the agent appends them to their file: the room they take on the phone
# beside the partial, against one start of the agent per this many bytes.
ABSORB_BYTES = 64 << 20


class NoDelayTcpTransport:
    """A phone's ADB port over TCP, as SharedIO reads and writes it: TCP_NODELAY (a message's
    header and payload would otherwise wait ~40 ms on Nagle's algorithm), every byte of a write
    sent (the socket's buffer takes part of it when the phone reads slower than the host sends),
    a peer's close reported as an error, and each wait bounded by the time limit it is given.
    The socket is non-blocking: the reader thread and writers use it at once."""

    def __init__(self, host: str, port: int, nodelay: bool = True):
        self.host, self.port, self.nodelay = host, port, nodelay
        self.sock: socket.socket | None = None
        self.tcp_connected = False

    def connect(self, timeout_s: float) -> None:
        self.close()
        self.tcp_connected = False
        self.sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        self.tcp_connected = True
        if self.nodelay:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)

    def bulk_read(self, numbytes: int, timeout_s: float) -> bytes:
        sock = self._socket()
        if select.select([sock], [], [], timeout_s)[0]:
            try:
                data = sock.recv(numbytes)
            except BlockingIOError:
                data = None
            if data == b"":
                raise ConnectionResetError(f"{self.host}:{self.port} closed the connection")
            if data is not None:
                return data
        raise adb_errors.TcpTimeoutException(f"reading from {self.host}:{self.port} timed out ({timeout_s:g} s)")

    def bulk_write(self, data: bytes, timeout_s: float) -> int:
        """All of `data`; each wait for room is bounded by `timeout_s`."""
        sock = self._socket()
        view, sent = memoryview(data), 0
        while sent < len(view):
            if not select.select([], [sock], [], timeout_s)[1]:
                raise adb_errors.TcpTimeoutException(f"writing to {self.host}:{self.port} timed out ({timeout_s:g} s)")
            with contextlib.suppress(BlockingIOError):
                sent += sock.send(view[sent:])
        return sent

    def shutdown(self) -> None:
        """Wake a thread blocked on the socket (the connection is over)."""
        if self.sock is not None:
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()

    def _socket(self) -> socket.socket:
        if self.sock is None:
            raise ConnectionAbortedError(f"{self.host}:{self.port}: not connected")
        return self.sock


def load_or_create_adb_key(path: Path) -> Path:
    """The host's ADB RSA key at `path` (and `path`.pub), generated on first use. The private
    key is created 0600 in a 0700 folder; an existing key readable by others is refused."""
    from adb_shell.auth.keygen import keygen

    path = Path(path).expanduser()
    if path.is_file():
        if os.name == "posix" and path.stat().st_mode & 0o077:
            raise TransportError("adb", f"{path}: ADB private key is readable by others (mode "
                                 f"{path.stat().st_mode & 0o777:o}); fix with `chmod 600 {path}`")
        return path
    if not path.parent.exists():
        path.parent.mkdir(parents=True, mode=0o700)
    work = Path(tempfile.mkdtemp(prefix=".adbkey-", dir=path.parent))  # 0700: no one sees it half made
    try:
        keygen(str(work / "adbkey"))
        os.chmod(work / "adbkey", 0o600)
        os.replace(work / "adbkey.pub", path.with_name(path.name + ".pub"))
        os.replace(work / "adbkey", path)
    finally:
        for leftover in work.iterdir():
            leftover.unlink()
        work.rmdir()
    return path


class AdbTransport(Transport):
    """One Android device over ADB. `host`/`port` for TCP (`adb tcpip 5555`, or a virtual phone);
    `host=None` for USB (`usb_serial` picks one of several). `timeout_s` bounds every exchange
    with the device except a running job, which gets its time limit plus `job_margin_s`.

    Its commands may run from several threads at once on the one connection (a job's shell while
    a pull runs, a reverse tunnel relaying beside both). A failed exchange closes the connection
    it failed on and the next command connects again; functions given to add_connect_listener
    run on each new connection before any command uses it (a reverse tunnel registers again)."""

    def __init__(self, host: str | None = None, port: int = 5555, *, usb_serial: str | None = None,
                 key_path: Path = DEFAULT_KEY, device_root: str = DEFAULT_ROOT,
                 agent_command: str = "farm-agent", timeout_s: float = 10.0, auth_timeout_s: float = 10.0,
                 job_margin_s: float = 120.0, tcp_nodelay: bool = True, name: str | None = None):
        self.host, self.port, self.usb_serial = host, port, usb_serial
        self.name = name or (f"{host}:{port}" if host else f"usb:{usb_serial or 'any'}")
        self.key_path = Path(key_path).expanduser()
        self.root = device_root.rstrip("/") or "/"
        self.agent = agent_command
        self.timeout_s, self.auth_timeout_s, self.job_margin_s = timeout_s, auth_timeout_s, job_margin_s
        self.tcp_nodelay = tcp_nodelay
        self._device: SharedAdbDevice | None = None
        self._handle: NoDelayTcpTransport | None = None
        self._connecting = threading.RLock()  # one connect at a time; a listener may use the device
        self._listeners: list[Callable[[SharedAdbDevice], None]] = []
        self._arrived: dict[str, int] = {}  # of the deploy under way: sha256 -> bytes a cut upload left
        self._chunked = False  # the deploy under way sends files of several chunks a chunk at a time

    # ---- connection ------------------------------------------------------------------------

    def _signer(self):
        from adb_shell.auth.sign_pythonrsa import PythonRSASigner

        key = load_or_create_adb_key(self.key_path)
        return PythonRSASigner.FromRSAKeyPath(str(key))

    def connection(self) -> SharedAdbDevice:
        """The live connection, made (and announced to the connect listeners) when there is none."""
        return self._connect()

    def add_connect_listener(self, listener: Callable[[SharedAdbDevice], None]) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_connect_listener(self, listener: Callable[[SharedAdbDevice], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _connect(self) -> SharedAdbDevice:
        with self._connecting:
            device = self._device
            if device is not None:
                if device.alive:
                    return device
                self._drop(device)  # its reader saw the connection end: start afresh
            signer = self._signer()
            if self.host is not None:
                self._handle = NoDelayTcpTransport(self.host, self.port, self.tcp_nodelay)
                device = SharedAdbDevice(self._handle, default_transport_timeout_s=self.timeout_s)
            else:
                device = self._usb_device()
            with self._errors("connect", device, connecting=True):
                device.connect([signer], auth_timeout_s=self.auth_timeout_s)
            self._device = device
            for listener in list(self._listeners):
                try:
                    listener(device)
                except Exception:  # a listener's failure is its own; the connection is fine
                    log.exception("%s: a connect listener failed", self.name)
            return device

    def _usb_device(self) -> SharedAdbDevice:
        try:
            from adb_shell.transport.usb_transport import UsbTransport
        except ImportError:
            raise TransportError(self.name, "USB needs adb-shell's usb extra: pip install 'adb-shell[usb]' "
                                 "(libusb1); or connect over TCP after `adb tcpip 5555`") from None
        try:
            handle = UsbTransport.find_adb(self.usb_serial, None, self.timeout_s)
        except adb_errors.UsbDeviceNotFoundError as exc:
            raise DeviceOffline(self.name, f"no USB device found ({exc}); check the cable and "
                                "that USB debugging is on") from None
        return SharedAdbDevice(handle, default_transport_timeout_s=self.timeout_s)

    def close(self) -> None:
        device = self._device
        if device is not None:
            self._drop(device)

    def _drop(self, device: SharedAdbDevice) -> None:
        """Close `device`'s connection; the next command connects again if it was the current one
        (a thread that failed on an old connection must not close the one another thread made)."""
        if self._device is device:
            self._device = None
        with contextlib.suppress(Exception):
            device.close()

    @contextlib.contextmanager
    def _errors(self, what: str, device: SharedAdbDevice | None, connecting: bool = False) -> Iterator[None]:
        """Turn the connection's and the socket's exceptions into TransportErrors; any of them leaves
        `device`'s connection unusable, so it is closed and the next call reconnects."""

        def close() -> None:
            if device is not None:
                self._drop(device)

        try:
            yield
        except TransportError:
            raise
        except SyncFailed as exc:  # the phone refused one file; the connection is whole
            raise TransportError(self.name, f"{what}: {exc}") from None
        except ServiceRefused as exc:  # the phone has no such service; the connection is whole
            raise TransportError(self.name, f"{what}: the device refused the service {exc}") from None
        except adb_errors.DeviceAuthError as exc:
            close()
            raise DeviceUnauthorized(self.name, f"{what}: {exc}") from None
        except (adb_errors.TcpTimeoutException, adb_errors.AdbTimeoutError, TimeoutError) as exc:
            close()
            if connecting and device is not None and device.io.auth_requested:
                raise DeviceUnauthorized(
                    self.name, f"the device did not accept this host's RSA key ({self.key_path}.pub) within "
                    f"{self.auth_timeout_s:g} s: unlock the phone and tap 'Allow' on the USB debugging "
                    "prompt (tick 'Always allow from this computer')") from None
            if connecting and self._handle is not None and not self._handle.tcp_connected:
                raise DeviceOffline(self.name, f"{what}: no answer within {self.timeout_s:g} s ({exc})") from None
            raise DeviceTimeout(self.name, f"{what}: the device stopped answering ({exc})") from None
        except (ConnectionRefusedError, socket.gaierror) as exc:
            close()
            raise DeviceOffline(self.name, f"{what}: {exc}") from None
        except (ConnectionError, adb_errors.AdbConnectionError, adb_errors.UsbReadFailedError,
                adb_errors.UsbWriteFailedError, OSError) as exc:
            close()
            raise DeviceOffline(self.name, f"{what}: connection lost ({exc})") from None
        except (adb_errors.InvalidResponseError, adb_errors.InvalidChecksumError,
                adb_errors.InvalidCommandError) as exc:
            close()
            raise TransportError(self.name, f"{what}: garbled ADB stream ({exc})") from None

    # ---- device primitives -----------------------------------------------------------------

    def shell(self, command: str, timeout_s: float | None = None,
              on_stderr_line: Callable[[str], None] | None = None) -> tuple[str, str, int]:
        """Run `command` over shell v2: (stdout, stderr, exit code), its packets ([id u8][len u32
        LE][data]) read from the connection's stream. stderr lines go to `on_stderr_line` as they
        arrive."""
        device = self._connect()
        timeout = timeout_s or self.timeout_s
        out, err, code = bytearray(), bytearray(), None
        buf, line, overflow = bytearray(), bytearray(), False
        with self._errors(f"shell {command[:60]!r}", device):
            stream = device.open("shell,v2,raw:" + command, timeout)
            for chunk in stream.until_close(timeout):
                buf += chunk
                while len(buf) >= 5:
                    kind, length = struct.unpack_from("<BI", buf)
                    if len(buf) < 5 + length:
                        break
                    data = bytes(buf[5:5 + length])
                    del buf[:5 + length]
                    if kind == 1:
                        if len(out) + len(data) > MAX_REPLY_BYTES:
                            overflow = True  # read on (the stream stays in step), keep nothing more
                        else:
                            out += data
                    elif kind == 2:
                        err += data
                        del err[:-STDERR_TAIL_BYTES]  # a long job's progress: only its tail is kept
                        if on_stderr_line is not None:
                            line += data
                            while b"\n" in line or len(line) > STDERR_TAIL_BYTES:
                                one, _, rest = bytes(line).partition(b"\n")
                                line[:] = rest
                                on_stderr_line(one[:STDERR_TAIL_BYTES].decode(errors="replace"))
                    elif kind == 3:
                        code = data[0]
        if code is None:
            raise DeviceOffline(self.name, f"shell {command[:60]!r}: the stream closed without an exit code")
        if overflow:
            raise reply_too_large(self.name, f"the output of shell {command[:60]!r}")
        return out.decode(errors="replace"), err.decode(errors="replace"), code

    def exec_out(self, command: str, timeout_s: float | None = None) -> bytes:
        """`command`'s output as bytes, untranslated (`adb exec-out`: the exec service, no pty;
        a shell v1 pty would turn its \\n into \\r\\n)."""
        device = self._connect()
        timeout = timeout_s or self.timeout_s
        out = bytearray()
        with self._errors(f"exec {command[:60]!r}", device), device.open("exec:" + command, timeout) as stream:
            for chunk in stream.until_close(timeout):
                out += chunk
                if len(out) > MAX_REPLY_BYTES:
                    raise reply_too_large(self.name, f"the output of {command[:60]!r}")
        return bytes(out)

    @contextlib.contextmanager
    def service_stream(self, destination: str, what: str, refused: str = "") -> Iterator[HostStream]:
        """A stream to the phone's service `destination` ("localabstract:chrome_devtools_remote")
        for the caller to speak its protocol on; its errors come out as TransportErrors naming
        `what`, a service nobody offers with `refused` as the fix."""
        device = self._connect()
        with self._errors(what, device):
            try:
                stream = device.open(destination, self.timeout_s)
            except ServiceRefused:
                raise TransportError(self.name, f"{what}: nothing answers at {destination} on the device"
                                     + (f"; {refused}" if refused else "")) from None
            with stream:
                yield stream

    def push(self, source: Path | bytes, device_path: str, mode: int = 0o644,
             progress: Callable[[int], None] | None = None) -> None:
        device = self._connect()
        with self._errors(f"push {device_path}", device):
            device.push(source, device_path, 0o100000 | mode, progress, self.timeout_s)

    def pull(self, device_path: str) -> bytes:
        device = self._connect()
        sink = io.BytesIO()
        missing = None
        with self._errors(f"pull {device_path}", device):
            try:
                device.pull(device_path, sink, self.timeout_s)
            except SyncFailed as exc:
                missing = exc  # raised outside: _errors takes any OSError for a lost connection
        if missing is not None:
            # the failed sync stream was closed: the connection is whole, and a tunnel relaying on
            # it goes on
            raise FileNotFoundError(f"{device_path}: {missing}")
        return sink.getvalue()

    def sizes(self, paths: list[str]) -> dict[str, int]:
        """Sizes of the regular files among `paths` that exist, one `stat` per batch of paths."""
        found: dict[str, int] = {}
        for batch in _batches(paths):
            out, _, _ = self.shell("stat -c '%F %s %n' " + " ".join(shlex.quote(p) for p in batch))
            for line in out.splitlines():
                kind, _, rest = line.partition(" file ")  # "regular file 123 /path", "regular empty file 0 /p"
                size, _, path = rest.partition(" ")
                if kind.startswith("regular") and size.isdigit():
                    found[path] = int(size)
        return found

    def digests(self, paths: list[str]) -> dict[str, str]:
        """sha256 of the readable regular files among `paths`, one `sha256sum` per batch."""
        found: dict[str, str] = {}
        for batch in _batches(paths):
            out, _, _ = self.shell("sha256sum " + " ".join(shlex.quote(p) for p in batch),
                                   timeout_s=max(self.timeout_s, 600.0))  # a model's weights: gigabytes
            for line in out.splitlines():
                digest, _, path = line.partition("  ")
                if len(digest) == 64 and path:
                    found[path] = digest
        return found

    def _run_checked(self, command: str, what: str) -> str:
        out, err, code = self.shell(command)
        if code != 0:
            raise TransportError(self.name, f"{what} failed (exit {code}): {(err or out).strip()[-500:]}")
        return out

    def agent_missing(self, err: str) -> TransportError:
        return TransportError(self.name, f"the agent command {self.agent!r} is not on the device ({err.strip()}); "
                              "install it (docs/phones.md: Connecting real devices) or set agent_command")

    # ---- the Transport interface -------------------------------------------------------------

    def info(self) -> DeviceInfo:
        def run(command: str) -> str:
            out, err, _ = self.shell(command)
            return out + err

        serial = run("getprop ro.serialno").strip() or self.name
        out, err, code = self.shell(f"{self.agent} info --json")
        adapter, agent_version, adapter_id, notes = {}, "", "", {}
        if code == 0:
            try:
                reported = from_json(DeviceInfo, out)
            except ProtocolError as exc:
                raise ProtocolMismatch(self.name, f"`{self.agent} info --json`: {exc}") from None
            adapter, agent_version, adapter_id = reported.adapter, reported.agent_version, reported.adapter_id
        else:
            notes["agent"] = f"unavailable (exit {code}): {err.strip()[-200:]}"
        device = collect_android(run, adapter, serial)
        device.agent_version, device.adapter_id = agent_version, adapter_id
        device.virtual = run("getprop ro.devicefarm.virtual").strip() == "1"
        device.properties.update(notes)
        return device

    def installed_manifest_is(self, manifest_bytes: bytes, manifest: Manifest) -> bool:
        out, _, _ = self.shell(f"sha256sum {shlex.quote(self.root + '/builds/current/' + MANIFEST)}")
        if out.split()[:1] != [_sha256(manifest_bytes)]:
            return False
        _, _, code = self.shell(f"{self.agent} verify --root {shlex.quote(self.root)}", timeout_s=max(self.timeout_s, 600.0))
        return code == 0  # else a file of it is damaged (or the agent is missing): deploy again

    def _staging(self, manifest: Manifest) -> tuple[str, str]:
        return f"{self.root}/incoming/{manifest.build}", f"{self.root}/incoming/.partial"

    def _absorb(self, manifest: Manifest, check: bool = False) -> dict[str, int]:
        """`farm-agent resume`: the agent appends the chunk files pushed so far to their partial
        uploads, each checked against the staged signed manifest; sha256 -> bytes it holds."""
        staging, _ = self._staging(manifest)
        out, err, code = self.shell(f"{self.agent} resume {shlex.quote(staging)} --root {shlex.quote(self.root)}"
                                    + (" --check" if check else ""), timeout_s=max(self.timeout_s, 600.0))
        if code == EXIT_NOT_FOUND:
            raise self.agent_missing(err)
        if code == EXIT_FAILED and "resume refused: " in err:
            raise BundleRefused(self.name, f"build {manifest.build}: {err.strip().split('resume refused: ', 1)[1]}")
        try:
            held = json.loads(out)["held"]
            return {str(sha): int(n) for sha, n in held.items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            raise TransportError(self.name, f"`farm-agent resume` failed (exit {code}): "
                                 f"{(err or out).strip()[-500:]}") from None

    def prepare_deploy(self, manifest_bytes: bytes, manifest: Manifest) -> list[ManifestFile]:
        staging, partial = self._staging(manifest)
        self._run_checked(f"rm -rf {shlex.quote(partial)} && mkdir -p {shlex.quote(partial)} "
                          f"{shlex.quote(staging + '/' + FILES)}", "preparing the staging folder")
        firsts = list({f.sha256: f for f in reversed(manifest.files)}.values())[::-1]  # one per blob
        blob = {f.sha256: f"{self.root}/store/{f.sha256[:2]}/{f.sha256}" for f in firsts}
        staged = {f.sha256: f"{staging}/{FILES}/{f.path}" for f in firsts}
        have = self.sizes([*blob.values(), *staged.values()])
        # Of the right size is not enough (a file damaged in place keeps its size): the ones
        # that are get hashed on the device, and only those that hash right are held.
        sized = [path for f in firsts for path in (blob[f.sha256], staged[f.sha256]) if have.get(path) == f.size]
        digests = self.digests(sized)
        lacking = [f for f in firsts
                   if digests.get(blob[f.sha256]) != f.sha256 and digests.get(staged[f.sha256]) != f.sha256]
        self._arrived = {f.sha256: self._arrived[f.sha256] for f in lacking if self._arrived.get(f.sha256)}
        parents = sorted({str(PurePosixPath(staged[f.sha256]).parent) for f in lacking})
        for batch in _batches(parents):
            self._run_checked("mkdir -p " + " ".join(shlex.quote(p) for p in batch), "mkdir")
        return lacking

    def arrived(self, f: ManifestFile) -> int:
        return self._arrived.get(f.sha256, 0)

    def push_file(self, manifest: Manifest, f: ManifestFile, source: Path, on_bytes: Callable[[int], None]) -> None:
        staging, partial = self._staging(manifest)
        if self._chunked and len(f.chunks) > 1:
            self._push_chunks(manifest, f, source, on_bytes)
            return
        tmp = f"{partial}/{f.sha256}"
        self.push(source, tmp, f.mode, on_bytes)
        self._run_checked(f"mv {shlex.quote(tmp)} {shlex.quote(staging + '/' + FILES + '/' + f.path)}",
                          f"moving {f.path} into place")

    def _push_chunks(self, manifest: Manifest, f: ManifestFile, source: Path, on_bytes: Callable[[int], None]) -> None:
        """The file from its last whole chunk on the device, each chunk as a file of its own (sync
        cannot append; one cut off dies with its connection), which the agent checks and
        appends every ABSORB_BYTES and at the end, when it moves the whole file into place."""
        size = manifest.chunk_size
        start, waiting = self.arrived(f), 0
        with open(source, "rb") as src:
            src.seek(start)
            for k in range(start // size, len(f.chunks)):
                piece = src.read(size)
                self.push(piece, f"{self.root}/{RESUME}/{f.sha256}.{k}")
                on_bytes(len(piece))
                waiting += len(piece)
                if waiting >= ABSORB_BYTES and k + 1 < len(f.chunks):
                    self._absorb(manifest)
                    waiting = 0
        held = self._absorb(manifest).get(f.sha256, 0)
        if held != f.size:
            raise TransportError(self.name, f"{f.path}: the agent holds {held} of its {f.size} bytes after every "
                                 "chunk was pushed (a chunk did not hash as signed); deploy again")

    def push_signed(self, manifest: Manifest, bundle_dir: Path) -> None:
        staging, partial = self._staging(manifest)
        self._run_checked(f"mkdir -p {shlex.quote(partial)} {shlex.quote(self.root + '/' + RESUME)} "
                          f"{shlex.quote(staging + '/' + FILES)}", "mkdir")
        for name in (MANIFEST, SIGNATURE):
            self.push((bundle_dir / name).read_bytes(), f"{partial}/{name}")
            self._run_checked(f"mv {shlex.quote(partial + '/' + name)} {shlex.quote(staging + '/' + name)}", "staging")
        # The agent checks the signature now (a build signed with another key is refused before
        # any file is sent) and what a cut deploy left of files sent in chunks: each chunk
        # against the signed manifest; a file it makes whole moves into place. An agent without
        # the command takes whole files, as before.
        self._arrived, self._chunked = {}, manifest.chunk_size > 0
        if self._chunked:
            try:
                self._arrived = self._absorb(manifest, check=True)
            except BundleRefused:
                raise
            except TransportError as exc:
                if isinstance(exc, DeviceOffline | DeviceTimeout):
                    raise
                log.warning("%s: no resume inside files (%s)", self.name, exc.detail)
                self._chunked = False

    def install(self, manifest: Manifest, allow_downgrade: bool = False) -> str | None:
        """The agent verifies every file against the signed manifest and installs."""
        staging, partial = self._staging(manifest)
        out, err, code = self.shell(f"{self.agent} install {shlex.quote(staging)} --root {shlex.quote(self.root)}"
                                    + (" --allow-downgrade" if allow_downgrade else ""),
                                    timeout_s=max(self.timeout_s, 600.0))
        if code == EXIT_NOT_FOUND:
            raise self.agent_missing(err)
        if code != 0:
            raise BundleRefused(self.name, f"build {manifest.build}: {(err or out).strip().removeprefix('error: ')}")
        self._run_checked(f"rm -rf {shlex.quote(staging)} {shlex.quote(partial)}", "cleaning up")
        return kept_current(out)

    def screenshot(self) -> Screenshot:
        """The phone's screen through `screencap -p` (a few MiB at most on a real phone)."""
        return self.checked_png(self.exec_out("screencap -p", timeout_s=max(self.timeout_s, 30.0)), "adb",
                                "screencap -p")

    def stop_job(self, job_id: str, reason: str) -> bool:
        out, err, code = self.shell(f"{self.agent} stop {shlex.quote(job_id)} --root {shlex.quote(self.root)} "
                                    f"--reason {shlex.quote(reason)}", timeout_s=60.0)
        if code == EXIT_NOT_FOUND:
            raise self.agent_missing(err)
        return code == 0

    def _job_dir(self, spec: JobSpec) -> str:
        return f"{self.root}/jobs/{spec.job_id}"

    def exec_job(self, spec: JobSpec, limit_s: float, on_line: Callable[[str], None],
                 progress: ProgressFn | None) -> AgentExit:
        spec_path = f"{self.root}/incoming/jobs/{spec.job_id}.json"
        self.push(to_json(spec).encode(), spec_path)
        command = (f"{self.agent} run {shlex.quote(spec_path)} --out {shlex.quote(self._job_dir(spec))} "
                   f"--root {shlex.quote(self.root)} --json")
        try:
            out, _, code = self.shell(command, timeout_s=limit_s, on_stderr_line=on_line)
        except (DeviceOffline, DeviceTimeout) as exc:
            raise InfraFailure(self.name, f"job {spec.job_id}: {exc.detail}", self.job_log_tail(spec)) from None
        return AgentExit(code, out, code - 128 if code > 128 else None)

    def read_job_file(self, spec: JobSpec, path: str) -> bytes:
        where = f"{self._job_dir(spec)}/{path}"
        if self.sizes([where]).get(where, 0) > MAX_REPLY_BYTES:
            raise reply_too_large(self.name, f"job {spec.job_id}'s {path}")
        return self.pull(f"{self._job_dir(spec)}/{path}")


def _batches(items: list[str], limit: int = _COMMAND_CHARS) -> Iterator[list[str]]:
    batch, size = [], 0
    for item in items:
        if batch and size + len(item) + 3 > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item) + 3
    if batch:
        yield batch


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
