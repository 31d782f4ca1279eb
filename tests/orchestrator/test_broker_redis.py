"""The farm's Celery app on a Redis broker (production's), with real worker processes: pings and
a real generate job on a local-transport device run through Redis, and a worker whose broker
is killed (SIGKILL) and restarted on the same port reconnects by itself: the job a client
queued during the outage and the jobs queued before the crash (kept by Redis' append-only
file) all run on that same worker process.

Redis comes from $FARM_TEST_REDIS_URL (scripts/ensure-redis.sh) or a private redis-server; the
restart test always starts its own. Without redis-server these tests skip locally and fail in
CI (CI=true), where a missing server is a broken setup."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis
from celery.exceptions import TimeoutError as ResultTimeout
from ci_support import missing
from support import free_port

from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import host_queue, make_celery

REPO = Path(__file__).resolve().parents[2]
PING = "orchestrator.tasks.ping"


def _no_redis(message: str):
    missing(message, "CI needs one: scripts/ensure-redis.sh installs it")


class RedisServer:
    """A private redis-server on 127.0.0.1:`port` with its data in `folder`. Every write is in
    the append-only file before it is acknowledged, so a SIGKILL loses no queued message."""

    def __init__(self, folder: Path, port: int | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            _no_redis("no redis-server on PATH")
        self.binary, self.folder, self.port = binary, folder, port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        folder.mkdir(parents=True, exist_ok=True)

    def start(self) -> RedisServer:
        log = open(self.folder / "redis.log", "a")  # noqa: SIM115  (the child keeps it)
        self.process = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    return self
            except redis.exceptions.RedisError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start:\n{(self.folder / 'redis.log').read_text()[-2000:]}")
                time.sleep(0.05)
            finally:
                client.close()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Worker:
    """`celery -A orchestrator.jobs.celery_app worker` in its own process, configured (as `farm
    worker` is) by FARM_* variables only."""

    def __init__(self, tmp: Path, settings: Settings, queues: list[str], concurrency: int = 1):
        self.name = f"w-{uuid.uuid4().hex[:6]}@{settings.host_name}"
        self.log_path = tmp / f"{self.name}.log"
        env = os.environ | {"FARM_DATA_DIR": str(settings.data_dir), "FARM_CONFIG_DIR": str(settings.config_dir),
                            "FARM_DATABASE_URL": settings.database_url, "FARM_BROKER_URL": settings.broker_url,
                            "FARM_HOST_NAME": settings.host_name}
        log = open(self.log_path, "w")  # noqa: SIM115  (the child keeps it)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "orchestrator.jobs.celery_app", "worker", "-Q", ",".join(queues),
             "-c", str(concurrency), "-n", self.name, "--without-gossip", "--without-mingle", "-l", "info"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        log.close()

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def farm_settings(tmp: Path, broker_url: str) -> Settings:
    # A host name of its own: a shared Redis may serve other runs, whose queues must not mix.
    return Settings(data_dir=tmp / "data", config_dir=tmp / "config", broker_url=broker_url,
                    host_name=f"redis-test-{uuid.uuid4().hex[:8]}")


def drop_results(*holders) -> None:
    """Empty `holders` (lists or dicts of AsyncResults) and collect them while their Redis is up.
    A result object is freed by the garbage collector, and its finalizer unsubscribes from its
    channel; with Redis gone, that can retry the connection 20 times a second apart, inside
    whichever test the collector happens to run in (the [stopped] restart test took 142 s so,
    then failed in CI; 10 s without)."""
    for holder in holders:
        holder.clear()
    gc.collect()


def ping_all(app, queue: str, payloads, timeout_s: float = 20.0) -> list:
    results = [app.signature(PING, args=(p,)).apply_async(queue=queue) for p in payloads]
    return [r.get(timeout=timeout_s) for r in results]


# ---- tasks through Redis ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    url = os.environ.get("FARM_TEST_REDIS_URL")
    if url:
        client = redis.Redis.from_url(url, socket_timeout=3)
        try:
            client.ping()
        except redis.exceptions.RedisError as exc:
            _no_redis(f"FARM_TEST_REDIS_URL={url} is not reachable: {exc}")
        finally:
            client.close()
        yield url
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def farm(tmp_path_factory, redis_url):
    from orchestrator.store import make_engine, make_session_factory, upgrade

    tmp = tmp_path_factory.mktemp("redis-farm")
    settings = farm_settings(tmp, redis_url)
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    worker = Worker(tmp, settings, [host_queue(settings.host_name)], concurrency=2)
    app = make_celery(settings)
    try:
        yield {"app": app, "settings": settings, "worker": worker, "tmp": tmp,
               "Session": make_session_factory(engine)}
    finally:
        worker.stop()
        engine.dispose()


def test_pings_run_through_redis(farm):
    app, queue = farm["app"], host_queue(farm["settings"].host_name)
    assert app.conf.broker_url.startswith("redis://") and app.conf.result_backend.startswith("redis://")
    try:
        assert ping_all(app, queue, range(20), timeout_s=30) == list(range(20))
    except Exception:
        print(farm["worker"].log())
        raise
    # Nothing left behind in the host's queue: every message was consumed and acked.
    client = redis.Redis.from_url(farm["settings"].broker_url)
    assert client.llen(queue) == 0
    client.close()


@pytest.mark.gpu
def test_generate_job_runs_through_redis(farm, tiny_model_dir):
    from sqlalchemy import func, select

    from agent.bundle import generate_keypair, provision_public_key
    from agent.packing import build_bundle
    from orchestrator import store
    from orchestrator.store.models import Deployment, DeploymentStatus, Job, JobState, Run, Sample

    tmp, settings, app, Session = farm["tmp"], farm["settings"], farm["app"], farm["Session"]  # noqa: N806
    key = generate_keypair(tmp / "farm.key", tmp / "farm.pub")
    manifest = build_bundle({"models/tiny": tiny_model_dir}, settings.data_dir / "builds" / "b1", "b1", "0.1.0", key)
    provision_public_key(tmp / "phone", tmp / "farm.pub")
    with Session() as session, session.begin():
        device_id = store.upsert_device(session, "local-1", "local", str(tmp / "phone"), host=settings.host_name).id
        build_id = store.create_build(session, manifest).id

    with Session() as session, session.begin():
        deployment_id = store.create_deployment(session, build_id, device_id).id
    assert app.signature("orchestrator.tasks.deploy", args=(deployment_id, 0)) \
        .apply_async(queue=host_queue(settings.host_name)).get(timeout=60) == deployment_id
    with Session() as session:
        deployment = session.get(Deployment, deployment_id)
        assert deployment.status == DeploymentStatus.succeeded, deployment.error or farm["worker"].log()

    spec = {"model": "models/tiny", "precision": "fp32", "steps": 2, "scheduler": "euler", "time_limit_s": 120.0}
    with Session() as session, session.begin():
        job_id = store.create_job(session, "generate", spec, device_id, build_id).id
    with Session() as session, session.begin():
        seq = store.redispatch_job(session, job_id, store.utcnow(), new_message=True)
    outcome = app.signature("orchestrator.tasks.run_job", args=(job_id, seq)) \
        .apply_async(queue=host_queue(settings.host_name)).get(timeout=90)
    assert outcome == "succeeded", farm["worker"].log()
    with Session() as session:
        job = session.get(Job, job_id)
        assert (job.state, job.attempts, job.worker) == (JobState.succeeded, 1, farm["worker"].name)
        (run,) = session.scalars(select(Run).where(Run.job_id == job_id))
        assert session.scalar(select(func.count()).select_from(Sample).where(Sample.run_id == run.id)) > 0


def test_sent_jobs_subscribe_to_no_result(farm):
    """The farm keeps outcomes in its store, so sending a job must not subscribe the sender to
    the job's result channel on Redis. With Redis down, a send that subscribes retries the
    subscription 20 times a second apart (19 s measured) before it fails; one that does not
    fails in 0.6 s, and the reconciler, which sends every job it finds, goes on."""
    from agent.protocol import Manifest, ManifestFile
    from orchestrator import store
    from orchestrator.jobs import jobservice
    from orchestrator.store.models import Job, JobState

    settings, app, Session = farm["settings"], farm["app"], farm["Session"]  # noqa: N806
    manifest = Manifest(build="no-results", version="0.1.0", created=1_700_000_000.0, source_revision="abc",
                        files=[ManifestFile("engine/a.py", "a" * 64, 10)])
    with Session() as session, session.begin():
        device_id = store.upsert_device(session, "local-results", "local", str(farm["tmp"] / "nowhere"),
                                        host=settings.host_name).id
        job_id = store.create_job(session, "latency", {"model": "models/tiny"}, device_id,
                                  store.create_build(session, manifest).id).id
    client = redis.Redis.from_url(settings.broker_url, socket_timeout=3)
    try:
        def subscribes() -> int:
            return client.info("commandstats").get("cmdstat_subscribe", {}).get("calls", 0)

        before = subscribes()
        assert jobservice.send_jobs(app, [job_id], strict=True) == [job_id]
        assert subscribes() == before, "sending the job subscribed to its result"
        # The worker took it (the device has no build, so the job ends there; what matters is
        # that it was delivered and ran without anyone listening for a result).
        deadline = time.monotonic() + 30
        while True:
            with Session() as session:
                job = session.get(Job, job_id)
                if job.state not in (JobState.queued, JobState.running):
                    break
            assert time.monotonic() < deadline, f"job {job_id} is still {job.state}\n{farm['worker'].log()}"
            time.sleep(0.2)
        assert job.attempts == 1
    finally:
        client.close()


# ---- the broker dies and comes back ---------------------------------------------------------


def test_worker_reconnects_after_redis_is_killed_and_queued_jobs_run(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    settings = farm_settings(tmp_path, server.url)
    queue, held = host_queue(settings.host_name), f"{host_queue(settings.host_name)}.held"
    worker = Worker(tmp_path, settings, [queue])
    app = make_celery(settings)
    client = redis.Redis.from_url(server.url, socket_timeout=2)
    held_results: list = []
    sent: dict = {}
    try:
        # 1. The worker runs pings through the live broker.
        assert ping_all(app, queue, range(5)) == list(range(5)), worker.log()

        # 2. Work queued before the crash, to a queue no worker consumes yet.
        held_results += [app.signature(PING, args=(p,)).apply_async(queue=held) for p in (100, 101, 102)]
        assert client.llen(held) == 3

        # 3. The broker dies. A client sending now cannot queue anything: its publish retries
        #    until the broker is back (kombu's retry policy), so send from a thread.
        server.kill()

        def send_during_outage():
            policy = {"max_retries": 200, "interval_start": 0.1, "interval_step": 0.1, "interval_max": 0.25}
            try:
                # Sent as the farm sends jobs: no result subscription (orchestrator.jobs.dispatch.publish).
                sent["result"] = app.signature(PING, args=(200,)).apply_async(queue=queue, retry=True,
                                                                              retry_policy=policy,
                                                                              ignore_result=True)
            except Exception as exc:  # noqa: BLE001  (reported below)
                sent["error"] = exc
            sent["at"] = time.monotonic()

        sender = threading.Thread(target=send_during_outage, daemon=True)
        sender.start()
        time.sleep(1.5)
        assert sender.is_alive() and not sent, f"a publish completed with the broker down: {sent}"

        # 4. Redis comes back on the same port and replays its append-only file.
        restarted_at = time.monotonic()
        server.start()
        sender.join(timeout=15)
        assert "result" in sent, f"the client never queued its job after the restart: {sent.get('error')}"
        assert sent["at"] >= restarted_at
        assert client.llen(held) == 3, "the messages queued before the crash did not survive it"

        # 5. The same worker process reconnects by itself and runs the job sent during the outage.
        ran = f"{PING}[{sent['result'].id}] succeeded"
        deadline = time.monotonic() + 30
        while ran not in worker.log_path.read_text():
            assert time.monotonic() < deadline, f"the job sent during the outage never ran\n{worker.log()}"
            time.sleep(0.1)
        assert worker.process.poll() is None, "the worker exited instead of reconnecting"
        assert "Connection to broker lost" in worker.log_path.read_text(), "the worker never lost the broker"

        # 6. Its control channel is back too: told to consume the held queue, it runs the jobs
        #    that were queued before the crash.
        replies = app.control.add_consumer(held, destination=[worker.name], reply=True, timeout=5)
        assert replies and worker.name in replies[0], replies
        assert [r.get(timeout=20) for r in held_results] == [100, 101, 102], worker.log()
        assert client.llen(held) == 0 and client.llen(queue) == 0
        assert ping_all(app, queue, range(5)) == list(range(5))
    finally:
        drop_results(held_results, sent)
        client.close()
        worker.stop()
        server.stop()


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_worker_holding_an_unacknowledged_message_survives_a_redis_restart(tmp_path, how):
    """A worker holds every ETA message it has taken unacknowledged (a busy device's retries are
    ETA messages). When the broker goes and comes back, the worker must reconnect and keep them;
    celery 5.7.0's worker tried to put them back while closing the dead connection and died there
    ("Unrecoverable error: AttributeError: 'NoneType' object has no attribute 'hostname'"),
    leaving the host with no worker at all."""
    server = RedisServer(tmp_path / "redis").start()
    settings = farm_settings(tmp_path, server.url)
    queue = host_queue(settings.host_name)
    worker = Worker(tmp_path, settings, [queue])
    app = make_celery(settings)
    kept: list = []
    try:
        assert ping_all(app, queue, [1]) == [1], worker.log()
        kept.append(app.signature(PING, args=(7,)).apply_async(queue=queue, countdown=3600))
        later_id = kept[0].id
        deadline = time.monotonic() + 20
        while f"{later_id}] received" not in worker.log_path.read_text():
            assert time.monotonic() < deadline, f"the worker never took the ETA message\n{worker.log()}"
            time.sleep(0.1)

        server.stop() if how == "stopped" else server.kill()
        time.sleep(2.0)
        server.start()

        try:
            answers = ping_all(app, queue, [2, 3], timeout_s=40)
        except ResultTimeout:
            answers = None
        assert worker.process.poll() is None, f"the worker exited\n{worker.log()}"
        assert answers == [2, 3], worker.log()
        assert "Unrecoverable error" not in worker.log_path.read_text(), worker.log()

        # The message it held is not lost: a warm shutdown puts it back on its queue.
        worker.stop()
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        try:
            queued = [m for m in client.lrange(queue, 0, -1) if later_id.encode() in m]
            held = [m for m in client.hvals("unacked") if later_id.encode() in m]
        finally:
            client.close()
        assert queued or held, "the ETA message the worker held is gone from Redis"
    finally:
        drop_results(kept)
        worker.stop()
        server.stop()
