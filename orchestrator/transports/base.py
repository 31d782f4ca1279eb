"""The interface every transport (adb, http, local) gives the control plane, and the errors it
raises. A transport moves bundles and jobs to one device and brings JobResults and their
artifacts back; it never interprets results. Each error names the device and carries the
device state the caller should record (offline, unauthorized, unresponsive, ...), so a task
can mark the device and decide whether to retry without parsing messages.

What is the same whichever way a device is reached lives here, once: a job's time limit, what
the agent's exit codes mean, reading the bundle manifest, parsing and checking the JobResult,
fetching and checking artifacts, and telling progress events from log lines. `send_bundle` and
`run` are templates over a few primitives that a transport supplies: how it reaches the device
(`info`), what the device already holds and how a file gets there (`installed_manifest_is`,
`push_signed`, `prepare_deploy`, `arrived`, `push_file`, `install`), how the agent is run
(`exec_job`) and how a file of a job folder comes back (`read_job_file`, `fetch_job_file`).
The exit codes and sizes are the device contract's (agent/protocol.py)."""

from __future__ import annotations

import abc
import json
import os
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from agent.protocol import (
    EXIT_BAD_INPUT,
    EXIT_BUSY,
    EXIT_FAILED,
    EXIT_NOT_FOUND,
    FILES,
    LOG_TAIL_CHARS,
    MANIFEST,
    NAME_PATTERN,
    DeviceInfo,
    JobResult,
    JobSpec,
    Manifest,
    ManifestFile,
    ProtocolError,
    from_json,
    sha256_file,
    to_json,
)

DeviceState = Literal["ready", "busy", "offline", "unauthorized", "unresponsive", "incompatible", "error"]
ProgressFn = Callable[[dict], None]  # one event: {"event": "push" | "step" | ..., ...}


class TransportError(Exception):
    """Something went wrong talking to `device`; `state` is what the device should be marked."""

    state: DeviceState = "error"

    def __init__(self, device: str, message: str):
        super().__init__(f"{device}: {message}")
        self.device = device
        self.detail = message


class DeviceOffline(TransportError):
    """Nobody answers at the device's address (refused, unreachable, connection lost)."""

    state = "offline"


class DeviceUnauthorized(TransportError):
    """The device refuses this host: an RSA key not accepted on the phone, a wrong token."""

    state = "unauthorized"


class DeviceTimeout(TransportError):
    """The device was reached but stopped answering within the configured timeout."""

    state = "unresponsive"


class ProtocolMismatch(TransportError):
    """The device's agent speaks another protocol version or refuses our documents as malformed:
    deploy a matching build."""

    state = "incompatible"


class NoScreen(TransportError):
    """The way the farm reaches this device shows no screen (a GPU host, an agent over HTTP):
    asking for a screenshot of it is the asker's mistake; the device is fine."""

    state = "ready"


class DeviceBusy(TransportError):
    """Another job holds the device lock (the agent's exit code 75); retry later."""

    state = "busy"


class BundleRefused(TransportError):
    """The agent refused to install a bundle (bad signature, tampered file); the message names
    the file. The device itself is fine."""

    state = "ready"


class InfraFailure(TransportError):
    """The job did not end with a result: the agent was killed mid-job or the connection was
    lost. `log_tail` is the end of the job's log when it could still be read."""

    state = "error"

    def __init__(self, device: str, message: str, log_tail: str = ""):
        super().__init__(device, message + (f"\n--- job.log (tail) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


@dataclass
class SendReport:
    """What send_bundle did: payload bytes and files sent, files the device already held
    (counted per manifest entry), wall time."""

    bytes_sent: int
    files_sent: int
    files_skipped: int
    seconds: float
    build: str = ""
    installed: bool = False  # False when the build was already current and nothing was done
    kept_current: str | None = None  # an older build installed beside this newer current one


@dataclass
class AgentExit:
    """How `farm-agent run` ended: its exit code, the signal that killed it where the
    transport can tell, and its stdout (the JobResult, where the agent printed one there)."""

    code: int
    stdout: str = ""
    signal: int | None = None


@dataclass
class Screenshot:
    """What a device's screen showed: a PNG (checked: its signature and IHDR), its size, and how
    it was taken ("adb": screencap; "devtools": the browser's page through Chromium's DevTools
    protocol)."""

    png: bytes
    width: int
    height: int
    source: Literal["adb", "devtools"]


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR, or None when `data` is not a PNG."""
    if len(data) < 33 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return (width, height) if width and height else None


# The most a device may answer in one piece that is read whole: a JobResult (result.json or a
# job's stdout) or a JSON reply. Artifacts stream to files instead. A real result is kilobytes
# (a tune job's kernel timings: a few MiB); past this, a device is broken or hostile.
MAX_REPLY_BYTES = 64 * 2**20


def reply_too_large(name: str, what: str) -> InfraFailure:
    return InfraFailure(name, f"{what} is over {MAX_REPLY_BYTES // 2**20} MiB, more than any result or answer "
                        "can be; not read")


_KEPT_CURRENT = re.compile(r"not made current: it is older than the current build ([A-Za-z0-9._+-]+) ")


def kept_current(install_output: str) -> str | None:
    """The build `farm-agent install` kept current instead of the (older) one it installed."""
    found = _KEPT_CURRENT.search(install_output)
    return found.group(1) if found else None


class Transport(abc.ABC):
    """One device reached one way. Methods raise TransportError subclasses, never the
    underlying library's exceptions. Not thread-safe: one caller per device at a time."""

    name: str  # how errors name the device (serial, host:port, "local")
    job_margin_s: float = 120.0  # beyond a job's own time limit and cool-down, before it counts as lost

    @abc.abstractmethod
    def info(self) -> DeviceInfo:
        """What the device is: model, OS, WebGPU adapter, temperatures, battery."""

    # ---- the templates -------------------------------------------------------------------------

    def send_bundle(self, bundle_dir: Path, progress: ProgressFn | None = None, *,
                    allow_downgrade: bool = False) -> SendReport:
        """Send the files of a signed bundle that the device's store lacks (by sha256: a blob
        damaged on the device is sent again), then install it as the current build; one built
        before the device's current build is installed beside it unless `allow_downgrade`.
        Resumable: after an interruption the next call sends only what is still missing (of a
        file whose chunks the manifest lists, from its last whole chunk that arrived), and no
        partial file ever lies at a path the agent reads. `bytes_sent` counts only what was sent."""
        started = time.monotonic()
        bundle_dir = Path(bundle_dir)
        manifest_bytes, manifest = self.read_manifest(bundle_dir)
        if self.installed_manifest_is(manifest_bytes, manifest):
            emit(progress, {"event": "bundle_current", "build": manifest.build})
            return SendReport(0, 0, len(manifest.files), time.monotonic() - started, manifest.build, False)
        # The signed manifest goes first: a device checks each chunk of a file against it as the
        # chunk arrives, and keeps the whole ones of a file cut off for the next deploy.
        self.push_signed(manifest, bundle_dir)
        lacking = self.prepare_deploy(manifest_bytes, manifest)
        held = sum(self.arrived(f) for f in lacking)
        total = sum(f.size for f in lacking) - held
        emit(progress, {"event": "bundle_plan", "build": manifest.build, "files": len(lacking), "bytes": total}
             | ({"resumed_bytes": held} if held else {}))
        sent = 0
        for f in lacking:
            def on_bytes(n: int, f: ManifestFile = f) -> None:
                nonlocal sent
                sent += n
                emit(progress, {"event": "push", "path": f.path, "bytes_sent": sent, "bytes_total": total})

            self.push_file(manifest, f, bundle_dir / FILES / f.path, on_bytes)
        kept = self.install(manifest, allow_downgrade=allow_downgrade)
        emit(progress, {"event": "bundle_installed", "build": manifest.build} | ({"kept_current": kept} if kept else {}))
        return SendReport(sent, len(lacking), len(manifest.files) - len(lacking), time.monotonic() - started,
                          manifest.build, True, kept)

    def run(self, spec: JobSpec, out_dir: Path, progress: ProgressFn | None = None) -> JobResult:
        """Run one job; progress events stream to `progress`; the JobResult's artifacts are
        fetched into `out_dir` (checked against their sha256) and result.json written there."""
        check_name(self.name, "job id", spec.job_id)
        other: list[str] = []
        ended = self.exec_job(spec, self.job_limit_s(spec), self.line_relay(progress, other), progress)
        self.check_exit(spec, ended.code, "\n".join(other), lambda: self.job_log_tail(spec), ended.signal)
        if ended.stdout.strip().startswith("{"):
            text = ended.stdout
        else:
            try:
                text = self.read_job_file(spec, "result.json").decode()
            except FileNotFoundError:
                raise InfraFailure(self.name, f"job {spec.job_id}: the agent exited without result.json",
                                   self.job_log_tail(spec)) from None
        result = self.finish_result(spec, self.parse_result(spec, text))
        self.fetch_artifacts(result, out_dir, lambda path, tmp: self.fetch_job_file(spec, path, tmp))
        return result

    # ---- what a transport supplies ---------------------------------------------------------------

    def screenshot(self) -> Screenshot:
        """The device's screen now, as a PNG (`farm devices screenshot`). A transport that cannot
        see a screen says so in one line."""
        kind = type(self).__name__.removesuffix("Transport").lower() or "its transport"
        raise NoScreen(self.name, f"no screenshot: the farm reaches it over {kind}, which shows no screen "
                             "(screenshots are taken of adb phones and of browser pages)")

    def checked_png(self, data: bytes, source: Literal["adb", "devtools"], what: str) -> Screenshot:
        """`data` as a Screenshot; ProtocolMismatch naming `what` when it is not a PNG."""
        size = png_size(data)
        if size is None:
            shown = data[:120].decode(errors="replace").strip() or f"{len(data)} bytes"
            raise ProtocolMismatch(self.name, f"{what} did not answer with a PNG: {shown}")
        return Screenshot(data, size[0], size[1], source)

    def stop_job(self, job_id: str, reason: str) -> bool:
        """Stop job `job_id` on the device if it runs there (`farm-agent stop`): it ends failed
        with "stopped: <reason>". Called from another thread than the one running the job, on a
        transport of its own. False when that job is not running there."""
        raise TransportError(self.name, "this transport cannot stop a running job")

    @abc.abstractmethod
    def installed_manifest_is(self, manifest_bytes: bytes, manifest: Manifest) -> bool:
        """Whether the device's current build is this one and every file of it still hashes to
        the signed manifest (a damaged one is repaired by deploying again)."""

    @abc.abstractmethod
    def prepare_deploy(self, manifest_bytes: bytes, manifest: Manifest) -> list[ManifestFile]:
        """The files (one per blob) the device lacks, neither in its store nor staged by an
        earlier attempt, compared by sha256, with the staging room made for them."""

    def arrived(self, f: ManifestFile) -> int:
        """Of a file prepare_deploy listed, the bytes a cut upload already left on the device
        (whole chunks, verified there against the signed manifest); push_file sends the rest."""
        return 0

    @abc.abstractmethod
    def push_file(self, manifest: Manifest, f: ManifestFile, source: Path, on_bytes: Callable[[int], None]) -> None:
        """Stage one file of the build: under a temporary name until it is whole, from byte
        `arrived(f)` on. `on_bytes(n)` is told of every n bytes sent."""

    @abc.abstractmethod
    def push_signed(self, manifest: Manifest, bundle_dir: Path) -> None:
        """Stage the manifest and its signature (before any file: chunks are checked against it)."""

    @abc.abstractmethod
    def install(self, manifest: Manifest, allow_downgrade: bool = False) -> str | None:
        """Have the agent verify the staged build against its signature and make it current;
        BundleRefused when it will not. Returns the newer build the agent kept current (an
        older build installed beside it without `allow_downgrade`), else None."""

    @abc.abstractmethod
    def exec_job(self, spec: JobSpec, limit_s: float, on_line: Callable[[str], None],
                 progress: ProgressFn | None) -> AgentExit:
        """Run `farm-agent run` for `spec` on the device, within `limit_s`: its stderr lines go
        to `on_line` (or, where the agent sends events as such, the events to `progress`).
        A job that is lost (connection, time limit) raises InfraFailure with the log's tail."""

    @abc.abstractmethod
    def read_job_file(self, spec: JobSpec, path: str) -> bytes:
        """A file of the job's output folder; FileNotFoundError when it is not there."""

    def finish_result(self, spec: JobSpec, result: JobResult) -> JobResult:
        """What the transport knows of the job that the agent could not (the browser executor's
        device readings); may raise InfraFailure for a result that is the infrastructure's
        failure, not the job's. As it came by default."""
        return result

    def fetch_job_file(self, spec: JobSpec, path: str, tmp: Path) -> None:
        """A file of the job's output folder into `tmp` (transports that can stream override)."""
        tmp.write_bytes(self.read_job_file(spec, path))

    # ---- what every transport does the same way ------------------------------------------------

    def job_log_tail(self, spec: JobSpec) -> str:
        """The end of the job's log, best effort: the connection may be what failed."""
        try:
            return self.read_job_file(spec, "job.log").decode(errors="replace")[-LOG_TAIL_CHARS:]
        except (TransportError, OSError):
            return ""

    def job_limit_s(self, spec: JobSpec) -> float:
        """How long a job may take before the transport calls it lost: its time limit, its
        cool-down's longest wait and the transport's margin."""
        return spec.time_limit_s + (spec.cooldown.max_wait_s if spec.cooldown else 0.0) + self.job_margin_s

    def read_manifest(self, bundle_dir: Path) -> tuple[bytes, Manifest]:
        """A bundle's manifest, as bytes (compared with the device's) and parsed."""
        raw = (Path(bundle_dir) / MANIFEST).read_bytes()
        try:
            manifest = from_json(Manifest, raw)
        except ProtocolError as exc:
            raise ProtocolMismatch(self.name, f"{Path(bundle_dir) / MANIFEST}: {exc}") from None
        check_name(self.name, "build id", manifest.build)
        return raw, manifest

    def agent_missing(self, message: str) -> TransportError:
        """The device has no runnable `farm-agent` (the shell's exit code 127)."""
        return TransportError(self.name, f"farm-agent is not installed or not runnable on the device: {message}")

    def check_exit(self, spec: JobSpec, code: int, message: str, log_tail: Callable[[], str],
                   signal: int | None = None) -> None:
        """Raise what `farm-agent run`'s exit `code` means when it is not a result (0: succeeded,
        EXIT_FAILED: failed, both with a JobResult). `signal`: the signal that killed it, where
        the transport can tell; `log_tail` is called only for an infrastructure failure."""
        message = message.strip()
        if code == EXIT_BUSY:
            raise DeviceBusy(self.name, message.removeprefix("error: "))
        if code == EXIT_BAD_INPUT:
            raise ProtocolMismatch(self.name, f"the agent refused job {spec.job_id}: {message}")
        if code == EXIT_NOT_FOUND:
            raise self.agent_missing(message)
        if code not in (0, EXIT_FAILED):
            why = f"signal {signal}" if signal is not None else f"exit code {code}"
            raise InfraFailure(self.name, f"job {spec.job_id}: the agent died ({why}) without a result", log_tail())

    def parse_result(self, spec: JobSpec, text: str | bytes) -> JobResult:
        """The agent's JobResult for `spec`, checked: the protocol's schema and the job id."""
        try:
            result = from_json(JobResult, text)
        except ProtocolError as exc:
            raise ProtocolMismatch(self.name, f"job {spec.job_id}: {exc}") from None
        if result.job_id != spec.job_id:
            raise InfraFailure(self.name, f"asked for job {spec.job_id}, the agent answered for {result.job_id}")
        return result

    def fetch_artifacts(self, result: JobResult, out_dir: Path, fetch: Callable[[str, Path], None]) -> None:
        """Every artifact of `result` into `out_dir` by `fetch(artifact path, temporary file)`,
        each checked against its sha256 before it takes its name; then result.json. A path that
        leaves the job folder is refused before anything is fetched."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        for a in result.artifacts:
            rel = PurePosixPath(a.path)
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise ProtocolMismatch(self.name, f"artifact path {a.path!r} leaves the job folder")
        for a in result.artifacts:
            target = out_dir / a.path
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.part")
            fetch(a.path, tmp)
            if sha256_file(tmp) != a.sha256:
                tmp.unlink()
                raise InfraFailure(self.name, f"artifact {a.path} arrived with another sha256 than the result's")
            os.replace(tmp, target)
        (out_dir / "result.json").write_text(to_json(result))

    @staticmethod
    def line_relay(progress: ProgressFn | None, other: list[str]) -> Callable[[str], None]:
        """A handler for the agent's stderr lines: its JSON progress events go to `progress`,
        anything else is kept in `other` (the error message, when the job does not start)."""
        def on_line(line: str) -> None:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict) and "event" in event:
                emit(progress, event)
            else:
                other.append(line.rstrip("\n"))

        return on_line

    def close(self) -> None:  # noqa: B027  (nothing to release by default)
        """Release the connection; the transport may be used again (it reconnects)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def emit(progress: ProgressFn | None, event: dict) -> None:
    """Call a progress listener; a broken listener must not break a deploy or a job."""
    if progress is not None:
        try:
            progress(event)
        except Exception:  # noqa: BLE001
            pass


def check_name(device: str, kind: str, value: str) -> str:
    """A build or job id becomes a folder name on the device: refuse anything else up front."""
    if not NAME_PATTERN.fullmatch(value):  # what the agent accepts as a build or job id
        raise TransportError(device, f"{kind} {value!r} is not a plain name (letters, digits, . _ + -)")
    return value
