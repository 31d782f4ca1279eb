"""The interface every transport (adb, http, local) gives the control plane, and the errors it
raises. A transport moves bundles and jobs to one device and brings JobResults and their
artifacts back; it never interprets results. Each error names the device and carries the
device state the caller should record (offline, unauthorized, unresponsive, ...), so a task
can mark the device and decide whether to retry without parsing messages."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agent.bundle import NAME_PATTERN
from agent.protocol import DeviceInfo, JobResult, JobSpec

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


class Transport(abc.ABC):
    """One device reached one way. Methods raise TransportError subclasses, never the
    underlying library's exceptions. Not thread-safe: one caller per device at a time."""

    name: str  # how errors name the device (serial, host:port, "local")

    @abc.abstractmethod
    def info(self) -> DeviceInfo:
        """What the device is: model, OS, WebGPU adapter, temperatures, battery."""

    @abc.abstractmethod
    def send_bundle(self, bundle_dir: Path, progress: ProgressFn | None = None) -> SendReport:
        """Send the files of a signed bundle that the device's store lacks, then install it as
        the current build. Resumable: after an interruption the next call sends only what is
        still missing, and no partial file ever lies at a path the agent reads."""

    @abc.abstractmethod
    def run(self, spec: JobSpec, out_dir: Path, progress: ProgressFn | None = None) -> JobResult:
        """Run one job; progress events stream to `progress`; the JobResult's artifacts are
        fetched into `out_dir` (checked against their sha256) and result.json written there."""

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
