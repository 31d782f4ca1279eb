"""Running one job on this device: the device lock, the optional cool-down, the child process
that does the GPU work under a time limit, and the JobResult and log every job leaves behind.

    run_job(spec, out_dir, root)                      the agent process
      1. lock      <root>/locks/device.lock (pid, job, start); a live holder -> AgentBusy,
                   a dead or overdue one is recovered with a log line
      2. cool down poll the hottest thermal zone until <= cooldown.max_celsius (not for the
                   browser executor: this host's zones are not the device's)
      3. task      resolve model and profile against the build -> out_dir/task.json (ChildTask)
      4. child     `python -m agent.child out_dir/task.json` (agent/child.py): loads the engine, runs the kind,
                   streams progress events and finally the JobResult as JSON lines on its
                   stdout; its stderr (engine warnings, tracebacks) is out_dir/job.log.
                   Killed with its process group at spec.time_limit_s.
      5. result    out_dir/result.json, written atomically, also when the job failed

The GPU work runs in a child so that a hung driver or a runaway job can be killed without
taking the agent down, and so the agent process itself never holds a GPU device. Samples are
raw, one per repetition; nothing is aggregated on the device.

Who runs the model is the JobSpec's `executor`: "native" runs the eager engine on this host's
GPU, "plan" replays engine plans on it, "browser" has a WebGPU page run them (a headless
Chromium started here, or the page of a phone's browser that a farm's hub holds, named by the
agent's configuration: protocol.AgentConfig). Generate and latency jobs run on all three with
the same sample metrics; tune jobs only on the native executor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.bundle import sha256_file
from agent.files import atomic_write
from agent.fsroot import FsRoot, PathRefused
from agent.protocol import (
    AGENT_CONFIG_FILE,
    LOG_TAIL_CHARS,
    AgentConfig,
    Artifact,
    JobResult,
    JobSpec,
    ProtocolError,
    from_dict,
    to_dict,
    to_json,
)

ProgressFn = Callable[[dict], None]  # one event: {"event": ..., "job_id": ..., "t": ..., ...}
ThermalFn = Callable[[], "float | None"]  # the hottest zone now, in Celsius

LOCK_NAME = "device.lock"
LOCK_MARGIN_S = 120.0  # past time limit + cool-down, a lock whose holder still lives is overdue
SHIPPED_PROFILES = ("auto", "family", "reference")  # built into the engine: names, not paths
# A build's profiles tuned on one exact GPU (`farm profiles promote`): "auto" picks the one
# made on this device's GPU over its family's.
TUNED_PROFILES_DIR = "profiles/tuned"
RESULT_EVENT = "result"
TASK_FILE = "task.json"  # in the job's folder: the ChildTask


class AgentBusy(RuntimeError):
    """Another job holds this device (the CLI exits 75, EX_TEMPFAIL: try again later)."""


class JobError(Exception):
    """A job that cannot start here (model or build missing); it ends as a failed result."""


class Interrupted(Exception):
    """The agent was told to stop (SIGTERM) mid-job: the child is killed, the result says so."""


# ---- small file helpers ---------------------------------------------------------------------


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write(path, text.encode("utf-8"))


def artifact(out_dir: Path, path: Path, kind: str) -> Artifact:
    return Artifact(path=path.relative_to(out_dir).as_posix(), sha256=sha256_file(path),
                    size=path.stat().st_size, kind=kind)


def log_tail(path: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The end of a job's log as text; NUL bytes (a program's binary output) as U+FFFD, since
    the protocol refuses NUL in every string."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode("utf-8", "replace").replace("\x00", "\ufffd")
    except OSError:
        return ""


def agent_log(root: Path, line: str) -> None:
    """One line in <root>/logs/agent.log: what happened to the device outside any job's log."""
    logs = Path(root) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "agent.log", "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


# ---- the device lock -----------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process on Windows
        import ctypes

        handle = ctypes.windll.kernel32.OpenProcess(0x1000, False, pid)  # QUERY_LIMITED_INFORMATION
        if not handle:
            return False
        code = ctypes.c_ulong()
        ctypes.windll.kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        ctypes.windll.kernel32.CloseHandle(handle)
        return code.value == 259  # STILL_ACTIVE
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def read_lock(root: Path) -> dict | None:
    """The lock's record, or None when the device is free. An unreadable record is returned
    as {"corrupt": True, "mtime": ...}."""
    path = Path(root) / "locks" / LOCK_NAME
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError
        return data
    except ValueError:
        return {"corrupt": True, "mtime": mtime}


def lock_problem(record: dict, now: float | None = None) -> str | None:
    """Why a lock record is stale, or None if its holder is alive and within its time."""
    now = time.time() if now is None else now
    if record.get("corrupt"):
        # A lock is written in one small write; an empty one for seconds was left by a crash.
        return "unreadable lock file" if now - record.get("mtime", 0) > 5 else None
    pids = [p for p in (record.get("pid"), record.get("child_pid")) if isinstance(p, int)]
    if record.get("host", socket.gethostname()) == socket.gethostname() and not any(map(pid_alive, pids)):
        return f"its process {record.get('pid')} is gone"
    allowed = float(record.get("time_limit_s", 0)) + float(record.get("cooldown_max_s", 0)) + LOCK_MARGIN_S
    age = now - float(record.get("started_at", 0))
    if age > allowed:
        return f"it is {age:.0f} s old, past its time limit + cool-down + margin ({allowed:.0f} s)"
    return None


def busy_message(record: dict) -> str:
    if record.get("corrupt"):
        return "device busy: a job is taking the lock right now"
    return (f"device busy with job {record.get('job_id')!r} since {_iso(float(record.get('started_at', 0)))} "
            f"(agent pid {record.get('pid')}); retry when it has finished")


class DeviceLock:
    """<root>/locks/device.lock, created exclusively; released on exit. `notes` collects the
    stale-lock recoveries, for the job's log."""

    def __init__(self, root: Path, spec: JobSpec):
        self.path = Path(root) / "locks" / LOCK_NAME
        self.root = Path(root)
        self.record = {
            "job_id": spec.job_id,
            "kind": spec.kind,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": time.time(),
            "time_limit_s": spec.time_limit_s,
            "cooldown_max_s": spec.cooldown.max_wait_s if spec.cooldown else 0.0,
        }
        self.notes: list[str] = []

    def __enter__(self) -> DeviceLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                held = read_lock(self.root)
                if held is None:
                    continue  # released between our two looks
                why = lock_problem(held)
                if why is None:
                    raise AgentBusy(busy_message(held)) from None
                note = f"recovered stale lock of job {held.get('job_id')!r} (pid {held.get('pid')}): {why}"
                agent_log(self.root, note)
                self.notes.append(note)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.record))
            return self
        raise AgentBusy("device busy: the lock keeps being taken by other jobs")

    def update(self, **fields) -> None:
        self.record.update(fields)
        atomic_write_text(self.path, json.dumps(self.record))

    def __exit__(self, *exc) -> None:
        held = read_lock(self.root)
        if held is not None and held.get("pid") == os.getpid() and held.get("job_id") == self.record["job_id"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


# ---- stopping a running job ----------------------------------------------------------------


def _stop_path(root: Path, job_id: str) -> Path:
    return Path(root) / "locks" / f"stop-{job_id}"


def stop_job(root: Path, job_id: str, reason: str) -> bool:
    """Stop job `job_id` if it is the one running on this device: the request is written where
    its agent looks (before starting its job process and when that process ends), then the
    process and all it started are killed. The job ends `failed` with "stopped: <reason>".
    False when that job is not running here (finished, never started, or another one runs)."""
    from agent.protocol import NAME_PATTERN

    held = read_lock(root)
    if not NAME_PATTERN.fullmatch(job_id) or held is None or held.get("job_id") != job_id:
        return False
    path = _stop_path(root, job_id)
    atomic_write_text(path, reason[:500])
    child = held.get("child_pid")
    if isinstance(child, int) and child > 0:
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            if os.name == "posix":
                os.killpg(child, signal.SIGKILL)  # the job process leads its own group
            else:
                os.kill(child, signal.SIGTERM)
    return True


def _stop_requested(root: Path, job_id: str) -> str | None:
    try:
        return _stop_path(root, job_id).read_text().strip() or "no reason given"
    except OSError:
        return None


# ---- cool-down ----------------------------------------------------------------------------


def read_hottest_celsius() -> float | None:
    """The device's hottest thermal zone now, from agent.deviceinfo, without touching the GPU."""
    from agent.deviceinfo import hottest_celsius, read_thermal_local

    return hottest_celsius(read_thermal_local())


def cool_down(cooldown, thermal: ThermalFn, log: Callable[[str], None], emit: ProgressFn,
              sleep: Callable[[float], None] = time.sleep) -> tuple[float, bool]:
    """Poll until the hottest zone is at most cooldown.max_celsius, or until its trend has
    settled (cooling_rate); (seconds waited, timed out)."""
    t0 = time.monotonic()
    readings: list[tuple[float, float]] = []  # (seconds since t0, celsius)
    while True:
        try:
            celsius = thermal()
        except Exception as exc:  # a thermal reader must never fail the job
            log(f"cool-down: cannot read temperatures ({exc}); not waiting")
            return time.monotonic() - t0, False
        waited = time.monotonic() - t0
        if celsius is None:
            log("cool-down: this device reports no temperatures; not waiting")
            return waited, False
        readings.append((waited, celsius))
        rate = cooling_rate(readings, cooldown.settle_window_s)
        emit({"event": "cooldown", "celsius": celsius, "max_celsius": cooldown.max_celsius, "waited_s": round(waited, 3)}
             | ({} if rate is None else {"c_per_min": round(rate, 3)}))
        if celsius <= cooldown.max_celsius:
            log(f"cool-down: {celsius:.1f} C <= {cooldown.max_celsius:.1f} C after {waited:.1f} s")
            return waited, False
        if rate is not None and rate < cooldown.settle_c_per_min:
            log(f"cool-down: settled at {celsius:.1f} C (> {cooldown.max_celsius:.1f} C) after {waited:.1f} s: "
                f"cooling {rate:.2f} C/min over the last {cooldown.settle_window_s:g} s, "
                f"under {cooldown.settle_c_per_min:g}; waiting longer would not cool it")
            return waited, False
        if waited >= cooldown.max_wait_s:
            log(f"cool-down: still {celsius:.1f} C > {cooldown.max_celsius:.1f} C after {waited:.1f} s; "
                "running anyway (cooldown_timed_out)")
            return waited, True
        sleep(max(0.0, min(cooldown.poll_s, cooldown.max_wait_s - waited)))


def cooling_rate(readings: list[tuple[float, float]], window_s: float) -> float | None:
    """How fast the device cools, in C per minute (negative: it warms), from the least-squares
    slope of the readings of the last `window_s` seconds; None until the readings span the
    window (with at least three of them)."""
    if not readings or readings[-1][0] - readings[0][0] < window_s:
        return None
    recent = [(t, c) for t, c in readings if t >= readings[-1][0] - window_s]
    if len(recent) < 3:
        return None
    mean_t = sum(t for t, _ in recent) / len(recent)
    mean_c = sum(c for _, c in recent) / len(recent)
    var_t = sum((t - mean_t) ** 2 for t, _ in recent)
    if var_t <= 0:
        return None
    slope = sum((t - mean_t) * (c - mean_c) for t, c in recent) / var_t  # C per second
    return -slope * 60.0


# ---- the task: what the child runs ---------------------------------------------------------


@dataclass
class ChildTask:
    """What the child process runs (TASK_FILE in the job's folder, written by the agent): the
    job, with its model, profile and init image resolved against the installed build."""

    spec: JobSpec  # its init_image, when it has one, is a file the child opens
    model: str
    profile: str
    tuned_profiles: list[str]  # with "auto": the build's, beside the engine's shipped ones
    build: str | None
    build_path: str | None
    out_dir: str
    root: str
    confined: bool
    browser_page: str | None = None  # the browser executor's page (AgentConfig.browser_page)


def read_agent_config(root: Path) -> AgentConfig:
    """The agent's configuration under `root` (AgentConfig; defaults when there is none). A
    file that cannot be read is the agent's fault: JobError says where."""
    path = Path(root) / AGENT_CONFIG_FILE
    try:
        return from_dict(AgentConfig, json.loads(path.read_text()), AGENT_CONFIG_FILE)
    except FileNotFoundError:
        return AgentConfig()
    except (OSError, ValueError, ProtocolError) as exc:
        raise JobError(f"the agent's configuration {path} cannot be read: {exc}") from None


def write_agent_config(root: Path, config: AgentConfig) -> None:
    """Write the agent's configuration under `root` (read_agent_config reads it), readable by
    its owner only: it may hold a page URL with the hub's key."""
    Path(root).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(root) / AGENT_CONFIG_FILE, to_json(config).encode(), mode=0o600)


def check_executor(spec: JobSpec, config: AgentConfig) -> None:
    """JobError for a job this agent cannot run as asked: a tune job on any executor but the
    native one, or a browser page configured for a job of another executor."""
    if spec.kind == "tune" and spec.executor != "native":
        raise JobError(f"tune jobs run on the native executor (the farm tunes on the GPU host), not on "
                       f"the {spec.executor} executor; send this job to an agent on a GPU host")
    if config.browser_page and spec.executor != "browser":
        raise JobError(f"this agent's configuration names a browser page ({AGENT_CONFIG_FILE}), which runs "
                       f"jobs on the browser executor; this job asks for the {spec.executor} executor")


def _find_build(root: Path, build_id: str | None):
    """The InstalledBuild named (or the current one), or None when nothing is installed."""
    from agent.bundle import current_build, list_builds

    if build_id is None:
        return current_build(root)
    for b in list_builds(root):
        if b.build_id == build_id:
            return b
    installed = ", ".join(b.build_id for b in list_builds(root)) or "none"
    raise JobError(f"build {build_id!r} is not installed under {root / 'builds'} (installed: {installed}); "
                   "install it first (farm-agent install)")


# A build's default kernel profile: a shipped profile's name, "reference", or a path in the build
# (written by `farm builds create --default-profile`); used when a job asks for "auto".
DEFAULT_PROFILE_FILE = "profiles/DEFAULT"


def make_task(spec: JobSpec, root: Path, out_dir: Path, fs: FsRoot | None = None,
              config: AgentConfig | None = None) -> ChildTask:
    """Resolve the model and the profile against the build; errors name what is missing. A
    model or profile named relative to the build stays inside it; under a confined agent
    (agent/fsroot.py) an absolute one is a device path, read under the device's filesystem."""
    fs = fs or FsRoot()
    try:
        return _task(spec, root, out_dir, fs, config or AgentConfig())
    except PathRefused as exc:
        raise JobError(str(exc)) from None


def _task(spec: JobSpec, root: Path, out_dir: Path, fs: FsRoot, config: AgentConfig) -> ChildTask:
    model = Path(spec.model)
    need_build = not model.is_absolute() or (
        spec.profile not in SHIPPED_PROFILES and not Path(spec.profile).is_absolute() and spec.profile.endswith(".json"))
    build = _find_build(root, spec.build) if (need_build or spec.build) else None
    if build is not None:
        from agent.bundle import verify_build

        damaged = verify_build(root, build)
        if damaged:
            raise JobError(f"build {build.build_id} is damaged on this device: {', '.join(damaged[:5])}"
                           f"{' ...' if len(damaged) > 5 else ''} no longer hash(es) to the signed manifest; "
                           "deploy the build again (farm deploy) to repair it")
    if not model.is_absolute():
        if build is None:
            raise JobError(f"model {spec.model!r} is relative to a build, but no build is installed under "
                           f"{root / 'builds'}; install a bundle (farm-agent install) or give an absolute model path")
        model = fs.within(build.path, spec.model, "model")
    else:
        model = fs.device(spec.model, "model")
    if not model.exists():
        where = f"build {build.build_id!r}" if build is not None and not Path(spec.model).is_absolute() else "this device"
        raise JobError(f"model {spec.model!r} not found in {where} (looked at {model})")
    profile, extra = spec.profile, []
    if spec.profile_document is not None:
        # A profile the farm sent with the job ("tuned": the newest one tuned on this GPU).
        path = out_dir / "profile-used.json"
        atomic_write(path, (json.dumps(spec.profile_document, indent=1) + "\n").encode())
        profile = str(path)
    elif profile == "tuned":
        raise JobError("profile 'tuned' is chosen by the farm, which sends the profile with the job; "
                       "name a profile (auto, family, reference, a shipped name or a path)")
    if profile == "auto" and build is not None and (build.path / DEFAULT_PROFILE_FILE).is_file():
        # The build names the profile its jobs use unless a job asks for one.
        profile = (build.path / DEFAULT_PROFILE_FILE).read_text().strip() or "auto"
    if spec.profile_document is not None:
        pass  # written above, in the job's own folder
    elif profile not in SHIPPED_PROFILES and build is not None and (build.path / profile).is_file():
        profile = str(fs.within(build.path, profile, "profile"))  # else a shipped profile's name or a device path
    elif profile not in SHIPPED_PROFILES and fs.confined:
        # A shipped profile's name passes (nothing of that name is outside); a path is the device's.
        profile = str(fs.device(profile, "profile") if Path(profile).is_absolute() else fs.check(profile, "profile"))
    if profile == "auto" and build is not None and (build.path / TUNED_PROFILES_DIR).is_dir():
        extra = [str(fs.within(build.path, f"{TUNED_PROFILES_DIR}/{p.name}", "profile"))
                 for p in sorted((build.path / TUNED_PROFILES_DIR).glob("*.json"))]
    return ChildTask(
        spec=dataclasses.replace(spec, init_image=_init_image(spec, build, out_dir, fs)),
        model=str(model), profile=profile, tuned_profiles=extra,
        build=build.build_id if build is not None else None,
        build_path=str(build.path) if build is not None else None,
        out_dir=str(out_dir), root=str(root), confined=fs.confined,
        browser_page=config.browser_page if spec.executor == "browser" else None)


def _init_image(spec: JobSpec, build, out_dir: Path, fs: FsRoot) -> str | None:
    """The init image as a file the child opens: a data: URI is written to out_dir (the job's
    record keeps the image it started from), a path is looked up in the build or on the device."""
    import base64
    import binascii

    value = spec.init_image
    if value is None:
        return None
    if value.startswith("data:"):
        kind, _, payload = value.partition(",")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise JobError(f"init image: the data: URI is not valid base64 ({exc})") from None
        path = out_dir / ("init_image.png" if "png" in kind else "init_image.jpg")
        atomic_write(path, data)
        return str(path)
    if not Path(value).is_absolute():
        if build is None:
            raise JobError(f"init image {value!r} is relative to a build, but no build is installed")
        path = fs.within(build.path, value, "init image")
    else:
        path = fs.device(value, "init image")
    if not path.is_file():
        raise JobError(f"init image {value!r} not found (looked at {path})")
    return str(path)


def _child_env(task: ChildTask) -> dict:
    """The child imports the build's engine and agent when the build ships them, else ours.
    A confined agent (the virtual phone's) runs on the host, and a build is files on the phone
    that whoever holds adb can change: its child imports only the host's code."""
    paths = [str(Path(__file__).resolve().parent.parent)]
    build_path = task.build_path
    if build_path and not task.confined and (Path(build_path) / "engine" / "__init__.py").is_file() \
            and (Path(build_path) / "agent" / "jobs.py").is_file():
        paths.insert(0, build_path)
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    if task.confined:
        env["PYTHONSAFEPATH"] = "1"  # `-m` would put the current folder, on the phone, first
    return env


# ---- the agent side -----------------------------------------------------------------------


def run_job(spec: JobSpec, out_dir: Path, root: Path, progress: ProgressFn | None = None, *,
            thermal: ThermalFn | None = None, fs: FsRoot | None = None) -> JobResult:
    """Run one job under the device lock and write out_dir/result.json and out_dir/job.log.
    Returns the JobResult (status "failed" for anything that went wrong in the job); raises
    AgentBusy when another job holds the device. `thermal` replaces the thermal reader; `fs`
    confines the job's paths (agent/fsroot.py)."""
    out_dir, root = Path(out_dir).resolve(), Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    with DeviceLock(root, spec) as lock:  # before touching out_dir: it may be a running job's
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "result.json").unlink(missing_ok=True)  # a reader must never take an old one for ours
        log_path = out_dir / "job.log"
        log_path.write_text("")
        result = JobResult(job_id=spec.job_id, kind=spec.kind, status="failed", started_at=time.time())

        def log(line: str) -> None:
            with open(log_path, "a", encoding="utf-8") as f:
                f.write(f"[agent {time.strftime('%H:%M:%S')}] {line}\n")

        def emit(event: dict) -> None:
            event = {"event": event.pop("event"), "job_id": spec.job_id, "t": round(time.time(), 3), **event}
            if progress is not None:
                with contextlib.suppress(Exception):  # a broken listener must not break the job
                    progress(event)

        for note in lock.notes:
            log(note)
        log(f"job {spec.job_id} ({spec.kind}) on agent pid {os.getpid()}, time limit {spec.time_limit_s:g} s")
        emit({"event": "started", "kind": spec.kind})
        atomic_write_text(out_dir / "job.json", to_json(spec))
        try:
            config = read_agent_config(root)
            check_executor(spec, config)
            if spec.cooldown is not None and spec.executor == "browser" and thermal is None:
                log("cool-down: the engine runs in a browser's page; this host's temperatures are not "
                    "its device's; not waiting")
            elif spec.cooldown is not None:
                result.cooldown_wait_s, result.cooldown_timed_out = cool_down(
                    spec.cooldown, thermal or read_hottest_celsius, log, emit)
            task = make_task(spec, root, out_dir, fs, config)
            atomic_write(out_dir / TASK_FILE, json.dumps(to_dict(task), indent=2).encode(), mode=0o600)  # a page URL's key
            if _stop_requested(root, spec.job_id) is None:
                _run_child(task, spec, result, lock, log, emit, log_path)
            if (why := _stop_requested(root, spec.job_id)) is not None:  # before it started, or while it ran
                result.status, result.error = "failed", f"stopped: {why}"
                log(f"the job was stopped: {why}")
        except JobError as exc:
            result.error = str(exc)
            log(f"error: {exc}")
        except Interrupted as exc:
            result.error = f"job interrupted: {exc}"
            log(result.error)
        except Exception as exc:  # the agent's own bug: still a result, never a bare traceback
            result.error = f"agent error: {type(exc).__name__}: {exc}"
            log(traceback.format_exc())
        finally:
            with contextlib.suppress(OSError):
                _stop_path(root, spec.job_id).unlink()
        result.finished_at = time.time()
        log(f"{result.status}{': ' + result.error if result.error else ''} "
            f"after {result.finished_at - result.started_at:.1f} s")
        result.log_tail = log_tail(log_path)
        result.artifacts.append(artifact(out_dir, log_path, "log"))
        atomic_write_text(out_dir / "result.json", to_json(result))
        emit({"event": "finished", "status": result.status, "error": result.error})
        return result


def _run_child(task: ChildTask, spec: JobSpec, result: JobResult, lock: DeviceLock, log, emit, log_path: Path) -> None:
    """Start the child, relay its events, enforce the time limit, merge its result."""
    cmd = [sys.executable, "-m", "agent.child", str(Path(task.out_dir) / TASK_FILE)]
    popen_kw = {"start_new_session": True} if os.name == "posix" else {
        "creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)}
    with open(log_path, "ab") as child_err:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=child_err,
                                env=_child_env(task), **popen_kw)
    lock.update(child_pid=proc.pid)
    box: dict = {}

    def relay():
        for raw in proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue  # only our JSON lines go to this pipe
            if isinstance(event, dict) and event.get("event") == RESULT_EVENT:
                box["result"] = event.get("result")
            elif isinstance(event, dict) and "event" in event:
                emit(event)

    reader = threading.Thread(target=relay, name=f"job-{spec.job_id}-events", daemon=True)
    reader.start()
    try:
        proc.wait(timeout=spec.time_limit_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        reader.join(timeout=5)
        result.error = f"time limit of {spec.time_limit_s:g} s exceeded"
        log(f"killed the job process {proc.pid}: {result.error}")
        return
    except BaseException:  # the agent is being stopped: take the child down with it
        _kill(proc)
        log(f"killed the job process {proc.pid} (the agent is stopping)")
        raise
    finally:
        lock.update(child_pid=None)
    reader.join(timeout=10)
    data = box.get("result")
    if data is None:
        result.error = f"the job process exited with code {proc.returncode} without a result; see the log"
        return
    try:
        child = from_dict(JobResult, data)
    except ProtocolError as exc:
        result.error = f"the job process returned an unreadable result: {exc}"
        return
    for name in ("status", "error", "device", "engine", "samples", "kernel_timings", "thermal", "artifacts",
                 "environment"):
        setattr(result, name, getattr(child, name))


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        else:
            proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
