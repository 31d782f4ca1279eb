"""The local transport: the orchestrator host's own GPU, driven through the same `farm-agent`
command a phone runs (a subprocess per call, with its own agent root), so a local job has the
same lock, child process, time limit and JobResult as anywhere else. The agent's output
folder is <root>/jobs/<job>; artifacts are copied from there into the caller's folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from agent.bundle import FILES, MANIFEST, SIGNATURE, current_build, missing_files
from agent.protocol import (
    LOG_TAIL_CHARS,
    DeviceInfo,
    JobResult,
    JobSpec,
    ProtocolError,
    from_json,
    to_json,
)
from orchestrator.transports.base import (
    BundleRefused,
    InfraFailure,
    ProgressFn,
    ProtocolMismatch,
    SendReport,
    Transport,
    TransportError,
    check_name,
    emit,
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

    def send_bundle(self, bundle_dir: Path, progress: ProgressFn | None = None) -> SendReport:
        started = time.monotonic()
        bundle_dir = Path(bundle_dir)
        manifest_bytes, manifest = self.read_manifest(bundle_dir)
        current = current_build(self.root) if self.root.is_dir() else None
        if current is not None and (current.path / MANIFEST).read_bytes() == manifest_bytes:
            return SendReport(0, 0, len(manifest.files), time.monotonic() - started, manifest.build, False)
        lacking = missing_files(manifest, self.root)
        staging = self.root / "incoming" / manifest.build
        sent = 0
        for f in lacking:  # copied by temp file + rename: never a partial file at its final path
            target = staging / FILES / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = staging.parent / f".partial-{f.sha256}"
            shutil.copyfile(bundle_dir / FILES / f.path, tmp)
            os.replace(tmp, target)
            sent += f.size
            emit(progress, {"event": "push", "path": f.path, "bytes_sent": sent})
        staging.mkdir(parents=True, exist_ok=True)
        for name in (MANIFEST, SIGNATURE):
            shutil.copyfile(bundle_dir / name, staging / name)
        done = self._agent("install", str(staging), "--root", str(self.root), timeout_s=max(self.timeout_s, 600))
        if done.returncode != 0:
            raise BundleRefused(self.name, f"build {manifest.build}: "
                                f"{(done.stderr or done.stdout).strip().removeprefix('error: ')}")
        shutil.rmtree(staging, ignore_errors=True)
        return SendReport(sent, len(lacking), len(manifest.files) - len(lacking), time.monotonic() - started,
                          manifest.build, True)

    def run(self, spec: JobSpec, out_dir: Path, progress: ProgressFn | None = None) -> JobResult:
        check_name(self.name, "job id", spec.job_id)
        job_dir = self.root / "jobs" / spec.job_id
        spec_path = self.root / "incoming" / "jobs" / f"{spec.job_id}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(to_json(spec))
        limit = self.job_limit_s(spec)
        proc = subprocess.Popen([*self.agent, "run", str(spec_path), "--out", str(job_dir), "--root", str(self.root),
                                 "--json"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        other: list[str] = []
        on_line = self.line_relay(progress, other)

        def relay() -> None:
            for line in proc.stderr:
                on_line(line)

        expired = threading.Event()

        def expire() -> None:
            expired.set()
            proc.terminate()  # the agent kills its job child on SIGTERM

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        timer = threading.Timer(limit, expire)
        timer.start()
        try:
            stdout = proc.stdout.read()
            proc.wait()
        finally:
            timer.cancel()
        reader.join(timeout=10)
        if expired.is_set():
            raise InfraFailure(self.name, f"job {spec.job_id}: no answer within {limit:g} s", self._log_tail(job_dir))
        code = proc.returncode
        self.check_exit(spec, code, "\n".join(other), lambda: self._log_tail(job_dir),
                        signal=-code if code < 0 else None)
        try:
            text = stdout if stdout.strip() else (job_dir / "result.json").read_text()
        except FileNotFoundError:
            raise InfraFailure(self.name, f"job {spec.job_id}: no result.json", self._log_tail(job_dir)) from None
        result = self.parse_result(spec, text)
        def fetch(path: str, tmp: Path) -> None:
            source = (job_dir / path).resolve()
            if job_dir.resolve() not in source.parents:  # a link out of the job folder
                raise ProtocolMismatch(self.name, f"artifact path {path!r} leaves the job folder")
            shutil.copyfile(source, tmp)

        self.fetch_artifacts(result, out_dir, fetch)
        return result

    def _log_tail(self, job_dir: Path) -> str:
        try:
            return (job_dir / "job.log").read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""
