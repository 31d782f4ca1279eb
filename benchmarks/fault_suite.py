"""The fault suite: the farm's reliability promise (docs/reliability.md) measured under repeated
faults, with real worker processes, a real beat running the reconciler, and real jobs (a tiny
random-weight model, 64x64, one denoising step) on local devices of this machine.

Scenarios:
- kills: the embedded stack (SQLite, the filesystem broker). Worker processes are SIGKILLed
  at random moments (the first one while a build is being pushed to a device; most while a
  job runs on each device and the others wait for it) and come back after a pause.
- broker-restart: Redis (a private redis-server with an append-only file) is stopped mid-run
  and started again on its port; PostgreSQL holds the store.
- db-restart: PostgreSQL (a private cluster made with initdb) is restarted mid-run; Redis is
  the broker.
- push-cut: a deploy of the tiny model's build whose connection is cut (a TCP proxy closes
  both sides) at 2 %, 50 % and 95 % of its bytes, over adb to a virtual phone and over http
  to a network agent; then the deploy is run again on a clean connection. No file may ever
  lie half-written at a final path (a watcher hashes them every 5 ms); the resumed deploy must
  send exactly what the device had not kept (whole files and whole, verified chunks: the
  build lists 64 KiB chunks, --chunk-size), and on the wire the cut and resumed deploys
  together may send at most one chunk (and one more deploy's start) beyond an uncut deploy.
- hosts (`--hosts N`): the farm spread over N device hosts through real network boundaries
  (tests/hosts: network namespaces, PostgreSQL, Redis, beat and the API in a control namespace,
  each host a `farm worker --host` driving its own virtual phones over ADB), latency jobs on
  every phone while, one fault at a time, a random host's worker is SIGKILLed with its process
  group (and started again after a pause) or its link to the control namespace goes down for
  longer than stale_after_s (and comes back). Needs root and iproute2.

For each: jobs lost (not succeeded when everything settled or the deadline passed), jobs
recorded twice (more than one stored run), jobs that ran more than once on a device (allowed:
delivery is at least once), worker or beat processes that exited on their own, and how long after a fault the work it hit came back: for a kill,
from the kill until each job its worker was running started again; for a host cut off, from
its link coming back until each job it was running started again; for a restart, from the
server coming back until the next job settled.

    python benchmarks/fault_suite.py --json docs/benchmarks/fault-suite.json
    python benchmarks/fault_suite.py --small              # what CI runs (tests/orchestrator/test_fault_suite.py)
    python benchmarks/fault_suite.py --scenarios push-cut # the cuts alone (seconds)
    python benchmarks/fault_suite.py --hosts 3            # 3 hosts x 3 phones, 12 kills, 3 partitions (as root)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # net_support (the cutting proxy, the partial-file watcher), hosts

from hosts.servers import PostgresServer, RedisServer  # noqa: E402
from sqlalchemy import func, select  # noqa: E402

from agent.bundle import generate_keypair, provision_public_key  # noqa: E402
from agent.packing import build_bundle  # noqa: E402
from orchestrator import store  # noqa: E402
from orchestrator.infra.settings import Settings  # noqa: E402
from orchestrator.jobs.celery_app import DEFAULT_QUEUE, host_queue, make_celery  # noqa: E402
from orchestrator.jobs.jobservice import launch_suite  # noqa: E402
from orchestrator.services.stack import settings_env  # noqa: E402
from orchestrator.store import make_engine, make_session_factory, upgrade  # noqa: E402
from orchestrator.store.models import Deployment, DeploymentStatus, Host, Job, JobState, Run, utcnow  # noqa: E402
from orchestrator.transports import DeviceOffline  # noqa: E402

HOST = "faulthost"
SPEC = {"precision": "fp32", "steps": 1, "scheduler": "euler", "height": 64, "width": 64, "time_limit_s": 120.0,
        "prompt": "a red bicycle"}
# Faster than the defaults so that a run takes minutes: a dead worker's job is found after 6 s
# without a heartbeat, and beat reconciles every second.
RELIABILITY = {"stale_after_s": 6.0, "message_grace_s": 8.0, "reconcile_every_s": 1.0}
WORKERS = 2


@dataclass
class Farm:
    root: Path
    settings: Settings
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self):
        self.engine = make_engine(self.settings.database_url)
        self.Session = make_session_factory(self.engine)
        self.app = make_celery(self.settings)

    def start(self, name: str) -> None:
        """Start worker `name` (wN) or beat, as the farm starts them."""
        if name == "beat":
            command = [sys.executable, "-m", "orchestrator.cli", "beat", "-l", "warning"]
        else:
            command = [sys.executable, "-m", "celery", "-A", "orchestrator.jobs.celery_app", "worker", "-Q",
                       f"{host_queue(HOST)},{DEFAULT_QUEUE}", "-c", "2", "-n", f"{name}@{HOST}", "--without-gossip",
                       "--without-mingle", "-l", "info"]
        log = open(self.root / f"{name}.log", "a")  # noqa: SIM115  (the child keeps it)
        self.processes[name] = subprocess.Popen(command, env=settings_env(self.settings), stdout=log,
                                                stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        log.close()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """The worker, its pool and the agents it started, at once."""
        process = self.processes[name]
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        process.wait()

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name in self.processes:
            try:
                self.processes[name].wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill(name)
        self.engine.dispose()


def make_farm(root: Path, devices: int, database_url: str | None, broker_url: str | None) -> Farm:
    from engine.make_model import make_model

    settings = Settings(data_dir=root / "data", config_dir=root / "config", host_name=HOST,
                        database_url=database_url, broker_url=broker_url, **RELIABILITY)
    upgrade(settings.database_url)
    model = make_model("tiny", 0, root / "model")
    key = generate_keypair(root / "farm.key", root / "farm.pub")
    manifest = build_bundle({"models/tiny": model}, settings.data_dir / "builds" / "b1", "b1", "0.1.0", key)
    farm = Farm(root, settings)
    with farm.Session() as session, session.begin():
        store.create_build(session, manifest)
        for index in range(devices):
            phone = root / f"phone-{index + 1}"
            provision_public_key(phone, root / "farm.pub")  # nothing installed: the suite's deploy pushes it
            store.upsert_device(session, f"local-{index + 1}", "local", str(phone), host=HOST)
            store.set_device_state(session, store.get_device(session, f"local-{index + 1}").id, "available")
    return farm


class Monitor(threading.Thread):
    """Polls the jobs and remembers, per job, when each attempt was first seen running."""

    def __init__(self, farm: Farm, batch_id: int):
        super().__init__(daemon=True)
        self.farm, self.batch_id = farm, batch_id
        self.started: dict[tuple[int, int], float] = {}  # (job, attempt) -> first seen running
        self.settled_at: list[float] = []
        self.done = threading.Event()
        self.settled: set[int] = set()  # jobs seen settled

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with self.farm.Session() as session:
                    rows = session.execute(select(Job.id, Job.state, Job.attempts).where(
                        Job.batch_id == self.batch_id)).all()
            except Exception:  # noqa: BLE001  (the database is restarting: look again)
                time.sleep(0.2)
                continue
            now = time.monotonic()
            for job_id, state, attempts in rows:
                if state == JobState.running:
                    self.started.setdefault((job_id, attempts), now)
                if state in store.SETTLED_STATES and job_id not in self.settled:
                    self.settled.add(job_id)
                    self.settled_at.append(now)
            time.sleep(0.1)

    def running(self) -> dict[int, tuple[int, str]]:
        """Jobs running now: id -> (attempt, worker)."""
        with self.farm.Session() as session:
            return {j: (a, w) for j, a, w in session.execute(select(Job.id, Job.attempts, Job.worker).where(
                Job.batch_id == self.batch_id, Job.state == JobState.running))}


def _context(farm: Farm, batch_id: int) -> list[str]:
    """What a kill interrupts, by the store's state at that moment."""
    with farm.Session() as session:
        pushing = session.scalar(select(func.count()).select_from(Deployment).where(
            Deployment.batch_id == batch_id, Deployment.status == DeploymentStatus.running))
        waiting = session.scalar(select(func.count()).select_from(Job).where(  # found the device busy
            Job.batch_id == batch_id, Job.state == JobState.queued, Job.due_at <= utcnow()))
        running = session.scalar(select(func.count()).select_from(Job).where(
            Job.batch_id == batch_id, Job.state == JobState.running))
    return (["push"] if pushing else []) + (["jobs waiting for a busy device"] if waiting and running else []) + \
        (["job running"] if running else [])


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "median_s": None, "max_s": None}
    return {"n": len(values), "median_s": round(statistics.median(values), 2), "max_s": round(max(values), 2)}


def run_scenario(name: str, root: Path, *, jobs: int, devices: int, kills: int, seed: int,
                 timeout_s: float) -> dict:
    rng = random.Random(seed)
    servers: dict[str, RedisServer | PostgresServer] = {}
    if name != "kills":
        servers["redis"] = RedisServer(root / "redis")
        servers["postgres"] = PostgresServer(root / "postgres")
        servers["redis"].start()
        servers["postgres"].start(any_port=True)
    farm = make_farm(root, devices, servers["postgres"].url if servers else None,
                     servers["redis"].url if servers else None)
    per_device = max(1, -(-jobs // devices))
    entries = [{"kind": "generate", "spec": SPEC | {"seed": i}} for i in range(per_device)]
    faults: list[dict] = []
    try:
        for index in range(WORKERS):
            farm.start(f"w{index + 1}")
        farm.start("beat")
        t0 = time.monotonic()
        batch_id = launch_suite(farm.app, f"fault suite: {name}", entries, build="b1", devices="all",
                                max_extra_rounds=0)
        monitor = Monitor(farm, batch_id)
        monitor.start()
        total = per_device * devices

        if name == "kills":
            already_hit: set[tuple[int, int]] = set()
            for index in range(kills):
                if index == 0:  # the first kill lands while a build is being pushed
                    _until(lambda: "push" in _context(farm, batch_id), 60)
                else:
                    time.sleep(rng.uniform(4.0, 12.0))
                victim = f"w{rng.randrange(WORKERS) + 1}"
                context, running = _context(farm, batch_id), monitor.running()
                killed_at = time.monotonic()
                farm.kill(victim)
                # A restarted worker has the dead one's name: an attempt still marked running
                # from an earlier kill (not yet found stale) was not hit again.
                hit = {job: attempt for job, (attempt, worker) in running.items()
                       if worker == f"{victim}@{HOST}" and (job, attempt) not in already_hit}
                already_hit.update(hit.items())
                faults.append({"fault": f"SIGKILL {victim}", "at_s": round(killed_at - t0, 2), "during": context,
                               "jobs_hit": hit, "_at": killed_at})
                time.sleep(rng.uniform(0.5, 2.0))
                farm.start(victim)
        else:
            server = servers["redis" if name == "broker-restart" else "postgres"]
            _until(lambda: len(monitor.settled_at) >= max(1, total // 4), timeout_s / 2)
            down_at = time.monotonic()
            server.stop()
            time.sleep(5.0)
            server.start()
            up_at = time.monotonic()
            faults.append({"fault": f"{'Redis' if name == 'broker-restart' else 'PostgreSQL'} stopped 5 s, started again",
                           "at_s": round(down_at - t0, 2), "during": ["jobs running"], "jobs_hit": {}, "_at": up_at})

        deadline = t0 + timeout_s
        while time.monotonic() < deadline and len(monitor.settled_at) < total:
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        # Processes that exited on their own (a killed worker is replaced by a new process).
        exited = sorted(f"{name} (exit {p.returncode})" for name, p in farm.processes.items() if p.poll() is not None)
        monitor.done.set()
        monitor.join()
        recovery = []
        for fault in faults:
            if fault["fault"].startswith("SIGKILL"):  # each job the dead worker was running
                for job, attempt in fault["jobs_hit"].items():
                    back = monitor.started.get((job, attempt + 1))
                    if back is not None:
                        recovery.append(back - fault["_at"])
            else:
                after = [t for t in monitor.settled_at if t > fault["_at"]]
                if after:
                    recovery.append(min(after) - fault["_at"])
        with farm.Session() as session:
            states = dict(session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id)
                                          .group_by(Job.state)).all())
            runs_per_job = session.execute(select(Run.job_id, func.count()).join(Job, Job.id == Run.job_id).where(
                Job.batch_id == batch_id).group_by(Run.job_id)).all()
            reran = session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id,
                                                                               Job.attempts > 1))
            unhealthy = [f"job {j.id}: {j.state} ({j.error})" for j in session.scalars(select(Job).where(
                Job.batch_id == batch_id, Job.state != JobState.succeeded))]
        for fault in faults:
            fault.pop("_at")
            fault["jobs_hit"] = sorted(fault["jobs_hit"])
        return {
            "scenario": name, "jobs": total, "devices": devices, "faults": faults, "elapsed_s": round(elapsed, 1),
            "states": {str(k): v for k, v in states.items()},
            "lost": total - states.get(JobState.succeeded, 0),
            "recorded_twice": sum(1 for _, n in runs_per_job if n > 1),
            "ran_more_than_once": reran,
            "recovery": _percentiles(recovery),
            "processes_exited": exited,
            "not_succeeded": unhealthy[:20],
        }
    finally:
        farm.stop_all()
        for server in servers.values():
            try:
                server.stop()
            except Exception:  # noqa: BLE001  (already down)
                pass


def run_hosts(root: Path, *, hosts: int, devices: int, jobs: int, kills: int, partitions: int, seed: int,
              timeout_s: float) -> dict:
    """The hosts scenario: latency jobs on `devices` phones of each of `hosts` device hosts
    while `kills` worker kills and `partitions` cuts of a host's link land, one at a time, in a
    random order, on random hosts."""
    from hosts.farm import BUILD, LATENCY, HostFarm
    from hosts.farm import RELIABILITY as HOST_RELIABILITY

    from orchestrator.store.models import Device, DeviceStateChange

    rng = random.Random(seed)
    names = [f"h{chr(ord('A') + i)}" for i in range(hosts)]
    farm = HostFarm(root, {host: [f"{host}-p{j + 1}" for j in range(devices)] for host in names})
    per_device = max(1, -(-jobs // (hosts * devices)))
    faults: list[dict] = []
    try:
        farm.start()
        t0 = time.monotonic()
        entries = [{"kind": "latency", "spec": LATENCY | {"seed": i}} for i in range(per_device)]
        batch_id = launch_suite(farm.app, "fault suite: hosts", entries, build=BUILD, devices="all", max_extra_rounds=0)
        monitor = Monitor(farm, batch_id)
        monitor.start()
        total = per_device * hosts * devices
        plan = ["kill"] * kills + ["cut"] * partitions
        rng.shuffle(plan)
        already_hit: set[tuple[int, int]] = set()
        for fault in plan:
            if faults:  # the next fault lands once what the last one hit runs again (recoveries do not overlap)
                _until(lambda hit=faults[-1]["jobs_hit"]: all(
                    (job, attempt + 1) in monitor.started or job in monitor.settled for job, attempt in hit.items()),
                    120)
            time.sleep(rng.uniform(3.0, 8.0))
            victim = rng.choice(names)
            running = monitor.running()
            # A restarted worker has the dead one's name: an attempt still marked running from
            # an earlier fault (not yet found stale) was not hit again.
            hit = {job: attempt for job, (attempt, worker) in running.items()
                   if worker == f"farm@{victim}" and (job, attempt) not in already_hit}
            already_hit.update(hit.items())
            at = time.monotonic()
            if fault == "kill":
                farm.kill_worker(victim)
                down_s = rng.uniform(1.0, 5.0)
                time.sleep(down_s)
                farm.start_worker(victim)
                faults.append({"fault": f"SIGKILL {victim}'s worker, back after {down_s:.1f} s", "kind": "kill",
                               "host": victim, "at_s": round(at - t0, 2), "jobs_hit": hit, "_at": at})
            else:
                cut_s = HOST_RELIABILITY["stale_after_s"] + rng.uniform(2.0, 6.0)
                farm.net.cut(victim)
                time.sleep(cut_s)
                farm.net.heal(victim)
                faults.append({"fault": f"{victim} cut off for {cut_s:.1f} s", "kind": "cut", "host": victim,
                               "at_s": round(at - t0, 2), "jobs_hit": hit, "_at": time.monotonic()})
            if len(monitor.settled_at) >= total:
                print(f"warning: the batch settled before the last fault ({len(faults)} of {len(plan)} done): "
                      "more --jobs", flush=True)
                break

        deadline = t0 + timeout_s
        while time.monotonic() < deadline and len(monitor.settled_at) < total:
            time.sleep(0.5)
        elapsed = time.monotonic() - t0
        monitor.done.set()
        monitor.join()
        with farm.Session() as session:
            host_of = dict(session.execute(select(Job.id, Host.name).join(Device, Device.id == Job.device_id)
                                           .join(Host, Host.id == Device.host_id).where(Job.batch_id == batch_id)).all())
        recovery: dict[str, list[float]] = {"kill": [], "cut": []}
        for fault in faults:
            fault["recovered_s"], fault["host_jobs_started_first"] = {}, {}
            for job, attempt in fault["jobs_hit"].items():
                back = monitor.started.get((job, attempt + 1))
                if back is not None:
                    recovery[fault["kind"]].append(back - fault["_at"])
                    fault["recovered_s"][job] = round(back - fault["_at"], 2)
                    # What its host ran before it came back: its phones share one GPU, and timed
                    # jobs take it in turn.
                    fault["host_jobs_started_first"][job] = sum(
                        1 for (other, _), at in monitor.started.items()
                        if other != job and host_of.get(other) == fault["host"] and fault["_at"] < at < back)
        with farm.Session() as session:
            states = dict(session.execute(select(Job.state, func.count()).where(Job.batch_id == batch_id)
                                          .group_by(Job.state)).all())
            runs_per_job = session.execute(select(Run.job_id, func.count()).join(Job, Job.id == Run.job_id).where(
                Job.batch_id == batch_id).group_by(Run.job_id)).all()
            reran = session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch_id,
                                                                               Job.attempts > 1))
            wrong_host = session.scalar(select(func.count()).select_from(Job).join(Device, Device.id == Job.device_id)
                                        .where(Job.batch_id == batch_id, Job.state == JobState.succeeded,
                                               Job.worker != func.concat("farm@", select(Host.name).where(
                                                   Host.id == Device.host_id).scalar_subquery())))
            offline = session.scalar(select(func.count()).select_from(DeviceStateChange).where(
                DeviceStateChange.to_state == "offline", DeviceStateChange.reason.like("its host % not been heard%")))
            unavailable = [f"{d.serial}: {d.state}" for d in session.scalars(select(Device))
                           if d.state != "available"]
            unhealthy = [f"job {j.id}: {j.state} ({j.error})" for j in session.scalars(select(Job).where(
                Job.batch_id == batch_id, Job.state != JobState.succeeded))]
        for fault in faults:
            fault.pop("_at")
            fault["jobs_hit"] = sorted(fault["jobs_hit"])
        return {
            "scenario": "hosts", "hosts": hosts, "jobs": total, "devices": hosts * devices, "faults": faults,
            "kills": sum(f["kind"] == "kill" for f in faults), "partitions": sum(f["kind"] == "cut" for f in faults),
            "elapsed_s": round(elapsed, 1), "states": {str(k): v for k, v in states.items()},
            "lost": total - states.get(JobState.succeeded, 0),
            "recorded_twice": sum(1 for _, n in runs_per_job if n > 1),
            "ran_more_than_once": reran, "run_on_another_host": wrong_host,
            "recovery": _percentiles(recovery["kill"] + recovery["cut"]),
            "recovery_kills": _percentiles(recovery["kill"]), "recovery_partitions": _percentiles(recovery["cut"]),
            "devices_taken_offline_with_their_host": offline, "devices_not_available_at_end": unavailable,
            "processes_exited": farm.dead(), "not_succeeded": unhealthy[:20],
        }
    finally:
        farm.stop()


# Where the cuts land in the tiny model's build (files in manifest order): inside the text
# encoder's weights, inside the UNet's, inside the VAE's (the last large file).
CUT_AT = (0.02, 0.5, 0.95)
# The push-cut build's chunks: the tiny model's 5.7 MB scaled down as the model is (a real
# build's 4 MiB chunks against its 1.7 GB UNet), so that its large files have tens of chunks.
PUSH_CUT_CHUNK = 64 << 10


def kept_on_device(root: Path, manifest) -> int:
    """Bytes of the build a deploy left on the device that a resumed one need not send: files
    staged whole, and of each partial upload (with the chunk files beside it that wait to be
    appended) its run of whole chunks that hash as the manifest lists. Read only."""
    import fcntl
    import hashlib

    staging, resume = root / "incoming" / manifest.build / "files", root / "incoming" / ".resume"
    kept = 0
    for f in {f.sha256: f for f in manifest.files}.values():
        whole = [staging / g.path for g in manifest.files if g.sha256 == f.sha256]
        if any(p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() == f.sha256 for p in whole):
            kept += f.size
            continue
        data = b""
        if (resume / f.sha256).is_file():
            with open(resume / f.sha256, "rb") as partial:
                fcntl.flock(partial.fileno(), fcntl.LOCK_SH)  # an upload still appending is waited for
                data = partial.read()
        pieces = [data[i:i + manifest.chunk_size] for i in range(0, len(data), manifest.chunk_size)]
        for k, digest in enumerate(f.chunks):
            piece = pieces[k] if k < len(pieces) else (resume / f"{f.sha256}.{k}").read_bytes() \
                if (resume / f"{f.sha256}.{k}").is_file() else b""
            if hashlib.sha256(piece).hexdigest() != digest:
                break
            kept += len(piece)
    return kept


def run_push_cuts(root: Path, chunk_size: int = PUSH_CUT_CHUNK) -> dict:
    """Cut a deploy at each fraction of CUT_AT over adb and over http, then resume it; beside
    each transport's cuts, one uncut deploy of the same build measures what a deploy costs on
    the wire, so what the cut made go twice is (cut + resumed) - uncut."""
    from net_support import PartialWatcher, Proxy

    from agent.serve import make_server
    from agent.simulator import VirtualPhone
    from engine.make_model import make_model
    from orchestrator.transports.adb import DEFAULT_ROOT, AdbTransport, load_or_create_adb_key
    from orchestrator.transports.http import HttpTransport

    key = generate_keypair(root / "farm.key", root / "farm.pub")
    manifest = build_bundle({"models/tiny": make_model("tiny", 0, root / "model")}, root / "bundle", "b1", "0.1.0",
                            key, chunk_size=chunk_size)
    total = sum({f.sha256: f.size for f in manifest.files}.values())
    # What one more deploy's start may add on the wire: the signed manifest again (http also
    # posts it to /v1/store/missing) and the questions of what is there.
    start = 2 * (root / "bundle" / "manifest.json").stat().st_size + (8 << 10)
    adb_key = load_or_create_adb_key(root / "keys" / "adbkey")
    cuts, uncut = [], {}
    for transport_kind in ("adb", "http"):
        for fraction in (None, *CUT_AT):
            case = root / f"{transport_kind}-{'uncut' if fraction is None else int(fraction * 100)}"
            if transport_kind == "adb":
                phone = VirtualPhone(serial=case.name, root=case / "phone", adb_keys=adb_key.with_name("adbkey.pub"))
                phone.start()
                device_root = phone.root / "fs" / DEFAULT_ROOT.lstrip("/")
                port, stop = phone.port, phone.stop

                def connect(p: int) -> AdbTransport:
                    return AdbTransport("127.0.0.1", p, key_path=adb_key)
            else:
                device_root = case / "agent"
                server = make_server(device_root, "fault-suite-token", host="127.0.0.1", port=0, quiet=True)
                threading.Thread(target=server.serve_forever, daemon=True).start()
                port = int(server.url.rsplit(":", 1)[1])

                def stop(server=server) -> None:
                    server.shutdown()
                    server.server_close()

                def connect(p: int) -> HttpTransport:
                    return HttpTransport(f"http://127.0.0.1:{p}", "fault-suite-token")
            provision_public_key(device_root, root / "farm.pub")
            proxy = Proxy(port, cut_after=None if fraction is None else int(total * fraction))
            clean_proxy = Proxy(port)
            error = None
            try:
                with PartialWatcher(device_root, manifest) as seen:
                    if fraction is None:
                        with connect(proxy.port) as clean:
                            clean.send_bundle(root / "bundle")
                        uncut[transport_kind] = proxy.forwarded
                        continue
                    with connect(proxy.port) as cut:
                        try:
                            cut.send_bundle(root / "bundle")
                        except DeviceOffline as exc:
                            error = exc.detail
                    kept = _settled(lambda root=device_root: kept_on_device(root, manifest))
                    installed_early = (device_root / "builds").exists()
                    t0 = time.monotonic()
                    with connect(clean_proxy.port) as clean:
                        report = clean.send_bundle(root / "bundle")
                    resumed_s = time.monotonic() - t0
                    with connect(port) as check:
                        intact = check.installed_manifest_is((root / "bundle" / "manifest.json").read_bytes(), manifest)
            finally:
                proxy.close()
                clean_proxy.close()
                stop()
            cuts.append({"transport": transport_kind, "chunk_size": chunk_size,
                         "cut_after_bytes": int(total * fraction), "wire_bytes_before_cut": proxy.forwarded,
                         "bytes_total": total, "cut_error": error, "installed_before_resume": installed_early,
                         "kept_bytes": kept, "resume_bytes_sent": report.bytes_sent,
                         "resume_wire_bytes": clean_proxy.forwarded, "uncut_wire_bytes": uncut[transport_kind],
                         "resent_wire_bytes": proxy.forwarded + clean_proxy.forwarded - uncut[transport_kind],
                         "resume_s": round(resumed_s, 2), "partial_files_seen": len(seen),
                         "installed": report.installed and intact})
    return {"scenario": "push-cut", "bytes_total": total, "chunk_size": chunk_size, "start_bytes": start,
            "cuts": cuts,
            "ok": all(c["cut_error"] and not c["installed_before_resume"] and c["installed"] and
                      c["kept_bytes"] + c["resume_bytes_sent"] == total and c["partial_files_seen"] == 0 and
                      c["resent_wire_bytes"] <= chunk_size + start for c in cuts)}


def _settled(measure, quiet_s: float = 0.3, timeout_s: float = 30.0):
    """`measure()` once it has given the same answer for `quiet_s`: what a device still does
    with the bytes that reached it before a cut (the socket kept them) is done by then."""
    value, since, deadline = measure(), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.05)
        now = measure()
        if now != value:
            value, since = now, time.monotonic()
    return value


def _until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception:  # noqa: BLE001  (a restarting server: look again)
            pass
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="kills,broker-restart,db-restart,push-cut")
    parser.add_argument("--jobs", type=int, default=102, help="jobs per scenario (spread over the devices)")
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--kills", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per scenario")
    parser.add_argument("--small", action="store_true", help="CI's size: 9 jobs, 3 kills")
    parser.add_argument("--hosts", type=int, help="run the hosts scenario alone, over this many device hosts "
                        "(each with --devices phones; --jobs in all, --kills and --partitions faults; as root)")
    parser.add_argument("--partitions", type=int, default=3, help="hosts: cuts of a host's link to ctl")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep", type=Path, help="keep each scenario's folder (logs, store) under this folder")
    parser.add_argument("--chunk-size", type=int, default=PUSH_CUT_CHUNK,
                        help="push-cut: the build's chunk size in bytes (a divisor or multiple of 1 MiB)")
    args = parser.parse_args(argv)
    if args.small:
        args.jobs, args.kills, args.timeout = 9, 3, 400.0
    if args.hosts:
        args.scenarios = "hosts"
        if "--jobs" not in (argv if argv is not None else sys.argv):
            args.jobs = 200
        if "--timeout" not in (argv if argv is not None else sys.argv):
            args.timeout = 3600.0
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp())
    results = []
    for name in args.scenarios.split(","):
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"fault-{name}-", dir=args.keep))
        os.chmod(root, 0o755)  # a private PostgreSQL runs as another user
        where = f"{args.hosts} hosts x {args.devices} phones" if name == "hosts" else f"{args.devices} devices"
        print(f"-- {name}: {args.jobs} jobs on {where} ({root})", flush=True)
        try:
            if name == "push-cut":
                result = run_push_cuts(root, args.chunk_size)
            elif name == "hosts":
                result = run_hosts(root, hosts=args.hosts or 3, devices=args.devices, jobs=args.jobs, kills=args.kills,
                                   partitions=args.partitions, seed=args.seed, timeout_s=args.timeout)
            else:
                result = run_scenario(name, root, jobs=args.jobs, devices=args.devices, kills=args.kills,
                                      seed=args.seed, timeout_s=args.timeout)
        finally:
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("faults", "cuts")}), flush=True)
    jobs = [r for r in results if r["scenario"] != "push-cut"]
    if jobs:
        print()
        print(f"{'scenario':<16}{'jobs':>6}{'faults':>8}{'lost':>6}{'twice':>7}{'reran':>7}"
              f"{'recovery median':>17}{'max':>8}{'elapsed':>9}")
    for r in jobs:
        rec = r["recovery"]
        print(f"{r['scenario']:<16}{r['jobs']:>6}{len(r['faults']):>8}{r['lost']:>6}{r['recorded_twice']:>7}"
              f"{r['ran_more_than_once']:>7}{_s(rec['median_s']):>17}{_s(rec['max_s']):>8}{r['elapsed_s']:>8.0f}s")
    for r in results:
        if r["scenario"] == "hosts":
            kills, cuts = r["recovery_kills"], r["recovery_partitions"]
            print(f"hosts: {r['hosts']} x {r['devices'] // r['hosts']} phones; {r['kills']} kills (recovery median "
                  f"{_s(kills['median_s'])}, max {_s(kills['max_s'])}), {r['partitions']} partitions (median "
                  f"{_s(cuts['median_s'])}, max {_s(cuts['max_s'])}); phones taken offline with their host "
                  f"{r['devices_taken_offline_with_their_host']}, jobs run on another host {r['run_on_another_host']}")
        if r["scenario"] == "push-cut":
            print()
            print(f"push cut, chunks of {r['chunk_size']} bytes; a deploy's start is at most {r['start_bytes']}")
            print(f"{'transport':<10}{'cut after':>11}{'kept':>10}{'resume sent':>13}{'wire: cut':>11}"
                  f"{'resumed':>10}{'uncut':>10}{'twice':>8}{'partial seen':>14}{'installed':>11}")
            for c in r["cuts"]:
                print(f"{c['transport']:<10}{c['cut_after_bytes']:>11}{c['kept_bytes']:>10}{c['resume_bytes_sent']:>13}"
                      f"{c['wire_bytes_before_cut']:>11}{c['resume_wire_bytes']:>10}{c['uncut_wire_bytes']:>10}"
                      f"{c['resent_wire_bytes']:>8}{c['partial_files_seen']:>14}{str(c['installed']):>11}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from hosts.farm import RELIABILITY as HOST_RELIABILITY

        settings = HOST_RELIABILITY if args.hosts else RELIABILITY
        args.json.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "cpu": _cpu_model(),
                                                     "python": platform.python_version()},
                                         "settings": settings,
                                         "workers": "one per host, a pool process per phone" if args.hosts else WORKERS,
                                         "results": results},
                                        indent=2) + "\n")
    return 0 if all(r["ok"] if r["scenario"] == "push-cut" else
                    r["lost"] == 0 and r["recorded_twice"] == 0 and not r["processes_exited"]
                    and not r.get("run_on_another_host") for r in results) else 1


def _cpu_model() -> str:
    try:
        return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


if __name__ == "__main__":
    sys.exit(main())
