"""The local transport: the orchestrator host's own GPU, driven through the same `farm-agent`
command a phone runs (a subprocess per call, with its own agent root), so a local job has the
same lock, child process, time limit and JobResult as anywhere else. The agent's output
folder is <root>/jobs/<job>; artifacts are copied from there into the caller's folder.
A deploy's files are received into the root on this host through the agent's device link
(agent/link.py: what the root lacks, a file kept a verified chunk at a time, the staged
manifest's signature), where a phone's transport asks `farm-agent resume` and the shell; the
install itself is `farm-agent install`, as on a phone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.link import (
    BundleError,
    installed_build_is,
    lacking_files,
    receive_chunks,
    staged_manifest,
    write_agent_config,
)
from agent.protocol import (
    FILES,
    MANIFEST,
    SIGNATURE,
    AgentConfig,
    DeviceInfo,
    JobSpec,
    Manifest,
    ManifestFile,
    ProtocolError,
    from_json,
    to_json,
)
from orchestrator.transports.base import (
    MAX_REPLY_BYTES,
    AgentExit,
    BundleRefused,
    InfraFailure,
    ProgressFn,
    ProtocolMismatch,
    Transport,
    TransportError,
    kept_current,
    reply_too_large,
)


class LocalTransport(Transport):
    """The host itself. `agent_command` is how `farm-agent` is started (default: this
    interpreter's `-m agent.cli`); `root` is the agent root the jobs and builds live in."""

    def __init__(self, root: Path, agent_command: Sequence[str] = (sys.executable, "-m", "agent.cli"),
                 name: str = "local", timeout_s: float = 120.0, job_margin_s: float = 120.0):
        self.root = Path(root).expanduser().resolve()
        self.agent = list(agent_command)
        self.name = name
        self.timeout_s, self.job_margin_s = timeout_s, job_margin_s
        self._arrived: dict[str, int] = {}  # of the deploy under way: sha256 -> bytes a cut upload left

    def _agent(self, *args: str, timeout_s: float | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([*self.agent, *args], capture_output=True, text=True,
                                  timeout=timeout_s or self.timeout_s, stdin=subprocess.DEVNULL)
        except FileNotFoundError as exc:
            raise TransportError(self.name, f"cannot start the agent {self.agent[0]!r}: {exc}") from None
        except subprocess.TimeoutExpired:
            raise TransportError(self.name, f"`farm-agent {args[0]}` did not finish in "
                                 f"{timeout_s or self.timeout_s:g} s") from None

    def info(self) -> DeviceInfo:
        done = self._agent("info", "--json")
        if done.returncode != 0:
            raise TransportError(self.name, f"`farm-agent info` failed: {done.stderr.strip()[-500:]}")
        try:
            return from_json(DeviceInfo, done.stdout)
        except ProtocolError as exc:
            raise ProtocolMismatch(self.name, str(exc)) from None

    def installed_manifest_is(self, manifest_bytes: bytes, manifest: Manifest) -> bool:
        return installed_build_is(self.root, manifest_bytes)

    def _staging(self, manifest: Manifest) -> Path:
        return self.root / "incoming" / manifest.build

    def prepare_deploy(self, manifest_bytes: bytes, manifest: Manifest) -> list[ManifestFile]:
        self._staging(manifest).mkdir(parents=True, exist_ok=True)
        lacking, self._arrived = lacking_files(manifest, self.root, self._staging(manifest))
        return lacking

    def arrived(self, f: ManifestFile) -> int:
        return self._arrived.get(f.sha256, 0)

    def push_file(self, manifest: Manifest, f: ManifestFile, source: Path, on_bytes: Callable[[int], None]) -> None:
        target = self._staging(manifest) / FILES / f.path  # by temp file + rename: never a partial file there
        target.parent.mkdir(parents=True, exist_ok=True)
        if len(f.chunks) > 1:  # kept a verified chunk at a time: a crash costs at most one
            start = self.arrived(f)
            with open(source, "rb") as src:
                src.seek(start)

                def read(n: int) -> bytes:
                    data = src.read(n)
                    on_bytes(len(data))
                    return data

                try:
                    receive_chunks(self._staging(manifest), self.root, f.path, start, read)
                except BundleError as exc:
                    raise BundleRefused(self.name, f"build {manifest.build}: {exc}") from None
            return
        tmp = self.root / "incoming" / f".partial-{f.sha256}"  # beside the bundle folder: it holds only its files
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
        on_bytes(f.size)

    def push_signed(self, manifest: Manifest, bundle_dir: Path) -> None:
        self._staging(manifest).mkdir(parents=True, exist_ok=True)
        for name in (MANIFEST, SIGNATURE):
            shutil.copyfile(bundle_dir / name, self._staging(manifest) / name)
        if manifest.chunk_size:  # what chunks are checked against: refused before any file is sent
            try:
                staged_manifest(self._staging(manifest), self.root)
            except BundleError as exc:
                raise BundleRefused(self.name, f"build {manifest.build}: {exc}") from None

    def install(self, manifest: Manifest, allow_downgrade: bool = False) -> str | None:
        staging = self._staging(manifest)
        done = self._agent("install", str(staging), "--root", str(self.root),
                           *(["--allow-downgrade"] if allow_downgrade else []), timeout_s=max(self.timeout_s, 600))
        if done.returncode != 0:
            raise BundleRefused(self.name, f"build {manifest.build}: "
                                f"{(done.stderr or done.stdout).strip().removeprefix('error: ')}")
        shutil.rmtree(staging, ignore_errors=True)
        return kept_current(done.stdout)

    def stop_job(self, job_id: str, reason: str) -> bool:
        done = self._agent("stop", job_id, "--root", str(self.root), "--reason", reason, timeout_s=60)
        return done.returncode == 0

    def configure_agent(self, config: AgentConfig) -> None:
        """Write the agent's configuration (protocol.AgentConfig) under its root, readable by
        its owner only: it may hold a page URL with the hub's key."""
        write_agent_config(self.root, config)

    def _job_dir(self, spec: JobSpec) -> Path:
        return self.root / "jobs" / spec.job_id

    def exec_job(self, spec: JobSpec, limit_s: float, on_line: Callable[[str], None],
                 progress: ProgressFn | None) -> AgentExit:
        spec_path = self.root / "incoming" / "jobs" / f"{spec.job_id}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(to_json(spec))
        proc = subprocess.Popen([*self.agent, "run", str(spec_path), "--out", str(self._job_dir(spec)),
                                 "--root", str(self.root), "--json"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def relay() -> None:
            for line in proc.stderr:
                on_line(line)

        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.terminate()  # the agent kills its job child on SIGTERM

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        timer = threading.Timer(limit_s, expire)
        timer.start()
        try:
            stdout = proc.stdout.read()
            proc.wait()
        finally:
            timer.cancel()
        reader.join(timeout=10)
        if expired.is_set():
            raise InfraFailure(self.name, f"job {spec.job_id}: no answer within {limit_s:g} s", self.job_log_tail(spec))
        code = proc.returncode
        return AgentExit(code, stdout, -code if code < 0 else None)

    def read_job_file(self, spec: JobSpec, path: str) -> bytes:
        file = self._job_file(spec, path)
        if file.stat().st_size > MAX_REPLY_BYTES:
            raise reply_too_large(self.name, f"job {spec.job_id}'s {path}")
        return file.read_bytes()

    def fetch_job_file(self, spec: JobSpec, path: str, tmp: Path) -> None:
        shutil.copyfile(self._job_file(spec, path), tmp)

    def _job_file(self, spec: JobSpec, path: str) -> Path:
        job_dir = self._job_dir(spec).resolve()
        source = (job_dir / path).resolve()
        if job_dir not in source.parents:  # a link out of the job folder
            raise ProtocolMismatch(self.name, f"file {path!r} leaves the job folder")
        return source
