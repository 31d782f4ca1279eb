"""The farm spread over the namespaces of netns.Star, as a lab would run it on several machines:
PostgreSQL (a private cluster), Redis (append-only), `farm beat` and the farm API (`farm api
serve`) in the control namespace `ctl`; in each device host, virtual phones listening on the
host's own loopback and `farm worker --host NAME --device SERIAL=adb:127.0.0.1:PORT ...` driving
them (queue host.NAME). The test process sits in the root namespace: it reads the store, sends
work and calls the API over its own link to ctl. Settings travel by environment (FARM_*), with
the fault suite's fast reliability knobs, so a lost worker is found in seconds.

The jobs are the tiny random-weight model's (engine.make_model "tiny"), built as build b1 and
deployed by each suite: LATENCY is a latency job of one 64x64 step that takes about a second.
Every process is started in its own process group, so a host's worker dies with its pool and
the agents it started (kill_worker); stop() ends them all and removes the namespaces."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .netns import NETWORK, Star
from .servers import PostgresServer, RedisServer, wait_port

REPO = Path(__file__).resolve().parents[2]
# A lost worker is found after 6 s without a heartbeat, beat reconciles every second and checks
# devices' health every two (what brings a host's phones back after a partition).
RELIABILITY = {"stale_after_s": 6.0, "message_grace_s": 8.0, "reconcile_every_s": 1.0, "health_check_every_s": 2.0}
LATENCY = {"precision": "fp32", "steps": 1, "scheduler": "euler", "height": 64, "width": 64, "warmup": 0,
           "repetitions": 1, "unet_repetitions": 2, "kernel_timings": False, "time_limit_s": 120.0}
BUILD = "b1"
# Inside ctl, a namespace of the run's own: fixed ports, never the machine's servers.
POSTGRES_PORT, REDIS_PORT, API_PORT = 15432, 16379, 18090
LISTENING = "listening on "
READY_TIMEOUT_S = 90.0


class FarmError(RuntimeError):
    """Something of the farm did not start or settle in time; the message quotes the logs."""


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path
    stopped: bool = False  # stopped or killed here on purpose: not a process that died

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class HostFarm:
    """A farm of `phones` ({host: [serial, ...]}) over a Star of namespaces, in `root` (made
    0755: PostgreSQL runs as its own user). start() brings everything up, stop() takes it down."""

    def __init__(self, root: Path, phones: dict[str, list[str]], *, concurrency: int | None = None):
        self.root = root
        self.placement = {host: list(serials) for host, serials in phones.items()}  # where each phone is plugged
        self.concurrency = concurrency
        self.net = Star(list(phones))
        self.processes: dict[str, Process] = {}
        self.ports: dict[str, int] = {}  # serial -> its adbd's port on its host's loopback
        self.token = ""
        self.postgres: PostgresServer | None = None
        self.redis: RedisServer | None = None
        self.engine = None

    # ---- settings ----------------------------------------------------------------------------

    def settings(self, role: str | None = None):
        """The settings of `role` (ctl or a host; None: this process, in the root namespace)."""
        from orchestrator.infra.settings import Settings

        where = "test" if role is None else role
        reach = self.net.ctl_address(None if role in (None, "ctl") else role)
        return Settings(data_dir=self.root / where / "data", config_dir=self.root / where / "config",
                        host_name=role if role not in (None, "ctl") else "ctl",
                        database_url=self.postgres.url_at(reach), broker_url=self.redis.url_at(reach), **RELIABILITY)

    def _folders(self, role: str | None) -> None:
        settings = self.settings(role)
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        settings.config_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        builds = settings.data_dir / "builds"
        if not builds.exists():
            builds.symlink_to(self.root / "builds")  # every host reads the one build store (a shared volume)

    # ---- starting ----------------------------------------------------------------------------

    def start(self) -> HostFarm:
        from agent.bundle import generate_keypair
        from agent.packing import build_bundle
        from engine.make_model import make_model
        from orchestrator import store
        from orchestrator.api import tokens
        from orchestrator.jobs.celery_app import make_celery
        from orchestrator.store import make_engine, make_session_factory, upgrade

        self.net.create()
        ctl = self.net.run_in("ctl")
        self.postgres = PostgresServer(self.root / "postgres", listen="0.0.0.0", port=POSTGRES_PORT, run_in=ctl,
                                       reach=self.net.ctl_address(), trust=f"{NETWORK}.0.0/16")
        self.redis = RedisServer(self.root / "redis", listen="0.0.0.0", port=REDIS_PORT, run_in=ctl,
                                 reach=self.net.ctl_address())
        self.postgres.start()
        self.redis.start()
        (self.root / "builds").mkdir(exist_ok=True)
        for role in [None, "ctl", *self.placement]:
            self._folders(role)
        settings = self.settings()
        upgrade(settings.database_url)
        self.engine = make_engine(settings.database_url)
        self.Session = make_session_factory(self.engine)
        self.app = make_celery(settings)
        key = generate_keypair(self.root / "farm.key", self.root / "farm.pub")
        manifest = build_bundle({"models/tiny": make_model("tiny", 0, self.root / "model")}, self.root / "builds" / BUILD,
                                BUILD, "0.1.0", key)
        with self.Session() as session, session.begin():
            store.create_build(session, manifest)
            _, self.token = tokens.create_token(session, "read", "hosts harness")
        self.spawn("ctl", "beat", ["beat", "-l", "warning"])
        self.spawn("ctl", "api", ["api", "serve", "--host", "0.0.0.0", "--port", str(API_PORT)])
        for host, serials in self.placement.items():
            for serial in serials:
                self.start_phone(host, serial)
        for host in self.placement:
            self.start_worker(host)
        wait_port(self.net.ctl_address(), API_PORT, "the farm API")
        self.wait_ready()
        return self

    def spawn(self, role: str, name: str, farm_args: list[str], argv: list[str] | None = None) -> Process:
        """Start `farm <farm_args>` (or `argv`) in namespace `role` with `role`'s settings, in a process
        group of its own, logging to <root>/logs/<name>.log (appended: a restarted process keeps
        its earlier lines)."""
        from orchestrator.services.stack import settings_env

        logs = self.root / "logs"
        logs.mkdir(exist_ok=True)
        log = logs / f"{name}.log"
        with open(log, "a") as out:
            out.write(f"--- {time.strftime('%H:%M:%S')} {name} started\n")
            out.flush()
            popen = subprocess.Popen([*self.net.run_in(role), *(argv or [sys.executable, "-m", "orchestrator.cli",
                                                                         *farm_args])],
                                     env=settings_env(self.settings(role)), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True)
        self.processes[name] = Process(name, popen, log)
        return self.processes[name]

    def start_phone(self, host: str, serial: str) -> int:
        """A virtual phone plugged into `host`: adbd on that host's loopback, its filesystem in
        <root>/phones/<serial> (it goes where the phone goes), trusting the farm's builds and
        `host`'s ADB key; returns its port."""
        from orchestrator.transports.adb import load_or_create_adb_key

        adb_key = load_or_create_adb_key(self.settings(host).adb_key)
        name = f"phone-{serial}"
        start = self.processes[name].log.stat().st_size if name in self.processes else 0
        process = self.spawn(host, name, [], [
            sys.executable, "-m", "agent.cli", "simulate", "--port", "0", "--serial", serial, "--root",
            str(self.root / "phones" / serial), "--trust", str(self.root / "farm.pub"), "--adb-keys",
            f"{adb_key}.pub"])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            text = process.text()[start:]
            if LISTENING in text:
                self.ports[serial] = int(text.split(LISTENING, 1)[1].split()[0].rsplit(":", 1)[1])
                return self.ports[serial]
            if not process.alive():
                break
            time.sleep(0.05)
        raise FarmError(f"virtual phone {serial} did not start on {host}:\n{process.text()[-3000:]}")

    def start_worker(self, host: str) -> Process:
        """`farm worker --host HOST` with a --device entry for each phone plugged into it."""
        devices = [arg for serial in self.placement[host]
                   for arg in ("--device", f"{serial}=adb:127.0.0.1:{self.ports[serial]}")]
        return self.spawn(host, f"worker-{host}", [
            "worker", "--host", host, "--concurrency", str(self.concurrency or max(1, len(self.placement[host]))),
            "--notify-concurrency", "0", "--loglevel", "info", *devices])

    def kill_worker(self, host: str) -> None:
        """SIGKILL `host`'s worker with its whole process group: its pool and the agents it started."""
        process = self.processes[f"worker-{host}"]
        process.stopped = True
        process.signal_group(signal.SIGKILL)
        process.popen.wait()

    def stop_worker(self, host: str) -> None:
        """Stop `host`'s worker as an operator would (SIGTERM: it finishes or hands back its task)."""
        self._stop(self.processes[f"worker-{host}"])

    def move_phone(self, serial: str, to: str) -> None:
        """Unplug phone `serial` from its host and plug it into `to`: its worker entry moves (the old
        host's worker is started again without it, the new one's with it) and the phone, with its
        filesystem, now answers on `to`'s loopback, trusting `to`'s ADB key."""
        frm = next(host for host, serials in self.placement.items() if serial in serials)
        self.stop_worker(frm)
        self._stop(self.processes[f"phone-{serial}"])
        self.placement[frm].remove(serial)
        self.placement[to].append(serial)
        self.start_phone(to, serial)
        self.stop_worker(to)
        self.start_worker(frm)
        self.start_worker(to)
        self.wait_ready()

    # ---- waiting -----------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every host's worker answers a ping (remote control, through Redis), and every phone is
        available on its host (the health check probed it from there)."""
        from orchestrator import store

        deadline = time.monotonic() + timeout_s
        waiting, error = set(self.placement), None
        while waiting:
            self.check_alive()
            if time.monotonic() > deadline:
                raise FarmError(f"the workers of {sorted(waiting)} did not answer ({error}):\n{self.logs()}")
            try:
                answers = self.app.control.ping(destination=[f"farm@{host}" for host in waiting], timeout=1.0)
            except Exception as exc:  # noqa: BLE001  (Redis restarted: this process's connection went with it)
                error, answers = exc, []
                time.sleep(0.2)
            for answer in answers:
                waiting -= {name.split("@", 1)[1] for name in answer}
        expected = {serial: host for host, serials in self.placement.items() for serial in serials}
        while True:
            with self.Session() as session:
                devices = {d.serial: d for d in store.devices_named(session, expected)}
                seen = {s: (str(d.state), d.host.name if d.host else None) for s, d in devices.items()}
            if all(seen.get(s) == ("available", h) for s, h in expected.items()):
                return
            if time.monotonic() > deadline:
                raise FarmError(f"phones not available on their hosts: {seen}, expected {expected}\n{self.logs()}")
            time.sleep(0.2)

    def check_alive(self) -> None:
        for process in self.processes.values():
            if not process.alive() and not process.stopped:
                raise FarmError(f"{process.name} exited with code {process.popen.returncode}:\n"
                                f"{process.text()[-3000:]}")

    def dead(self) -> list[str]:
        """Processes that exited without being stopped or killed here."""
        return sorted(p.name for p in self.processes.values() if not p.alive() and not p.stopped)

    # ---- reading -----------------------------------------------------------------------------

    def api(self, path: str):
        """GET /v1<path> from the farm API in ctl, as JSON."""
        request = urllib.request.Request(f"http://{self.net.ctl_address()}:{API_PORT}/v1{path}",
                                         headers={"Authorization": f"Bearer {self.token}"})
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # ctl only, never a proxy
        with direct.open(request, timeout=10) as answer:
            return json.loads(answer.read())

    def logs(self, lines: int = 40) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.text().splitlines()[-lines:])
                         for p in self.processes.values())

    # ---- stopping ----------------------------------------------------------------------------

    def _stop(self, process: Process, grace_s: float = 20.0) -> None:
        process.stopped = True
        if process.alive():
            process.popen.send_signal(signal.SIGTERM)
            try:
                process.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        process.signal_group(signal.SIGKILL)
        process.popen.wait()

    def stop(self) -> None:
        """Every process, the servers and the namespaces; safe after a failed start."""
        for process in self.processes.values():
            process.stopped = True
            if process.alive():
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for process in self.processes.values():
            try:
                process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            process.signal_group(signal.SIGKILL)
            process.popen.wait()
        # Nothing of this process may reach for ctl's addresses once its link is gone: the
        # root namespace's default route would carry them off the machine.
        if self.engine is not None:
            self.engine.dispose()
        if hasattr(self, "app"):
            self.app.close()
        for server in (self.redis, self.postgres):
            if server is not None:
                try:
                    server.stop()
                except Exception:  # noqa: BLE001  (never started, or already down)
                    pass
        self.net.remove()


def make_root() -> Path:
    """A folder for one farm that PostgreSQL's own user can enter."""
    root = Path(tempfile.mkdtemp(prefix="farm-hosts-"))
    root.chmod(0o755)
    return root


def remove_root(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
