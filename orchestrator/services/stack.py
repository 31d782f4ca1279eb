"""The embedded stack: a Celery worker, beat and virtual phones as child processes of one
command (`farm up`, `farm demo`), each in its own process group with its log under
<data_dir>/logs, stopped together: SIGTERM to each child itself (a worker finishes or hands back
its task: acks are late), then SIGKILL to every group, with whatever is left in it, once the child
has exited or a grace period has passed. Not SIGTERM to the groups: a worker's prefork children
would die at once, one possibly holding the pool's queue lock, and the worker's warm shutdown
would wait on that lock until the SIGKILL. The broker is whatever the settings say: the
embedded filesystem broker needs no process of its own."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.infra.settings import Settings

STOP_GRACE_S = 20.0
READY_TIMEOUT_S = 60.0
LISTENING = re.compile(r"listening on (\S+):(\d+)")


NOTIFIER_RESTART_MAX_S = 60.0


class StackError(RuntimeError):
    """A process of the stack failed to start; the message names it and quotes its log."""


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that gives a child process these settings (FARM_* variables)."""
    env = dict(os.environ)
    for name in ("FARM_BROKER_URL", "FARM_DEVICES"):
        env.pop(name, None)
    env.update(FARM_DATA_DIR=str(settings.data_dir), FARM_CONFIG_DIR=str(settings.config_dir),
               FARM_DATABASE_URL=str(settings.database_url), FARM_HOST_NAME=settings.host_name)
    if settings.broker_url:
        env["FARM_BROKER_URL"] = settings.broker_url
    for name in ("reconcile_every_s", "stale_after_s", "message_grace_s", "max_queue_wait_s", "max_job_time_s",
                 "health_check_every_s"):
        env[f"FARM_{name.upper()}"] = repr(getattr(settings, name))
    return env


@dataclass
class Child:
    name: str
    process: subprocess.Popen
    log: Path
    start: int = 0  # where this child's part of the log begins (a log keeps earlier stacks' runs)

    def text(self) -> str:
        """What this child wrote to its log."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


@dataclass
class Stack:
    settings: Settings
    children: list[Child] = field(default_factory=list)

    @property
    def log_dir(self) -> Path:
        return self.settings.data_dir / "logs"

    def _spawn(self, name: str, argv: list[str]) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        # Appended, each start marked: a later stack (a rerun of `farm demo`) must not wipe the
        # logs of the run that failed.
        with open(log, "a") as out:
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {name} started\n")
            out.flush()
            start = out.tell()
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=settings_env(self.settings), start_new_session=True)
        child = Child(name, process, log, start)
        self.children.append(child)
        return child

    def _farm(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "orchestrator.cli", *args]

    def start_worker(self, concurrency: int, name: str = "worker") -> Child:
        return self._spawn(name, self._farm("worker", "--concurrency", str(concurrency)))

    def start_beat(self) -> Child:
        return self._spawn("beat", self._farm("beat"))

    def start_phone(self, serial: str, trust: Path, adb_keys: Path, model: str = "Pixel 7") -> tuple[Child, int]:
        """A virtual phone on a free port of 127.0.0.1, its filesystem kept in
        <data_dir>/phones/<serial> (so a later stack finds what was deployed), trusting the farm's
        build key `trust` and, for ADB, only the host keys in `adb_keys`; returns the port."""
        root = self.settings.data_dir / "phones" / serial
        child = self._spawn(f"phone-{serial}", [
            sys.executable, "-m", "agent.cli", "simulate", "--port", "0", "--serial", serial,
            "--model", model, "--root", str(root), "--trust", str(trust), "--adb-keys", str(adb_keys)])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            match = LISTENING.search(child.text())
            if match:
                return child, int(match.group(2))
            if child.process.poll() is not None:
                break
            time.sleep(0.05)
        raise StackError(f"virtual phone {serial} did not start:\n{child.tail()}")

    def start_hub(self) -> dict:
        """`farm hub` on free ports; returns what it wrote of itself (hub.json: key, ports, URL)."""
        import json

        self.settings.hub_file.unlink(missing_ok=True)
        child = self._spawn("hub", self._farm("hub", "--port", "0", "--https-port", "0"))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                record = json.loads(self.settings.hub_file.read_text())
                if record.get("pid") == child.process.pid:
                    return record
            except (OSError, ValueError):
                pass
            if child.process.poll() is not None:
                break
            time.sleep(0.05)
        raise StackError(f"the hub did not start:\n{child.tail()}")

    def start_tablet(self, serial: str, url: str, ca_pem: Path) -> Child:
        """A virtual tablet (agent/simulator/tablet.py) that opens `url` in a Chromium trusting
        `ca_pem`, its browser profile kept in <data_dir>/tablets/<serial>."""
        root = self.settings.data_dir / "tablets" / serial
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        url_file = root / "enrolment-url"  # the URL holds the device's token: a file, not an argument
        fd = os.open(url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(url + "\n")
        return self._spawn(f"tablet-{serial}", [
            sys.executable, "-m", "agent.cli", "simulate-tablet", "--url-file", str(url_file), "--ca", str(ca_pem),
            "--root", str(root)])

    def wait_worker_ready(self, app, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Round-trip a ping through this host's queue: the worker is consuming."""
        from celery.exceptions import TimeoutError as CeleryTimeout

        from orchestrator.jobs.celery_app import host_queue

        result = app.signature("orchestrator.tasks.ping", args=(1.0,)).apply_async(
            queue=host_queue(self.settings.host_name))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                result.get(timeout=1.0)
                return
            except CeleryTimeout:
                continue
        raise StackError(f"the worker did not answer within {timeout_s:g} s:\n{self._tail('worker')}")

    def _tail(self, name: str) -> str:
        return next((c.tail() for c in self.children if c.name == name), "")

    def check_alive(self) -> None:
        """StackError naming the first child that exited."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise StackError(f"{child.name} exited with code {code}:\n{child.tail()}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child (the group leader alone), wait up to `grace_s`, SIGKILL every group;
        afterwards no process this stack started is running."""
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for child in self.children:
            _signal_group(child.process, signal.SIGKILL)  # the group: prefork children too
            child.process.wait()
        self.children.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Notifier:
    """`farm notifier` beside a worker (what `farm worker` starts): notification deliveries have a
    process and a thread pool of their own, so a receiver that trickles its answer holds one of
    their threads, never a job's slot. Its output goes where the worker's does. It dies with the
    worker (it asks the kernel for SIGTERM when its parent goes, even by SIGKILL), is started
    again with back-off when it exits by itself, and is stopped by `stop()` after the worker's
    own warm shutdown: SIGTERM, a grace of one attempt and a margin, then SIGKILL."""

    def __init__(self, settings: Settings, concurrency: int, loglevel: str = "info"):
        self._argv = [sys.executable, "-m", "orchestrator.cli", "notifier", "--concurrency", str(concurrency),
                      "--loglevel", loglevel, "--beside", str(os.getpid())]
        self._env, self._grace_s = settings_env(settings), settings.notify_timeout_s + 10.0
        self._stopping = threading.Event()
        self.process = self._start()
        threading.Thread(target=self._keep_running, name="notifier-watch", daemon=True).start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self._argv, env=self._env, stdin=subprocess.DEVNULL)

    def _keep_running(self) -> None:
        pause = 1.0
        while True:
            code = self.process.wait()
            if self._stopping.wait(pause):
                return
            print(f"the notifier exited with code {code}; starting it again", file=sys.stderr, flush=True)
            pause = min(NOTIFIER_RESTART_MAX_S, pause * 2)
            self.process = self._start()

    def stop(self) -> int | None:
        """Stop it and return its exit code (None if it had to be killed)."""
        self._stopping.set()
        process = self.process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return process.wait(timeout=self._grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                return None
        return process.returncode


def die_with_parent(parent_pid: int) -> bool:
    """Ask the kernel for SIGTERM when this process's parent exits (Linux), and say whether that
    parent is still `parent_pid` (False: it is gone already, and no signal will come)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1  # noqa: N806  (prctl.h)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == parent_pid


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session: the group id is the leader's pid
    except (ProcessLookupError, PermissionError):
        pass
