"""The SQL store on SQLite and PostgreSQL: the migration creates exactly the models' schema,
device leases are exclusive under concurrency, job creation is idempotent, job transitions
follow the rules, results round-trip, stale jobs are found, device health is recorded."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import multiprocessing
import threading
import time

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select, text, update
from sqlalchemy.exc import IntegrityError

from agent.protocol import (
    Artifact,
    Cooldown,
    DeviceInfo,
    JobResult,
    JobSpec,
    KernelTiming,
    Manifest,
    ManifestFile,
    Sample,
    ThermalReading,
)
from orchestrator import store
from orchestrator.store import (
    SchemaMismatch,
    check,
    make_engine,
    make_session_factory,
    migrate,
    upgrade,
)
from orchestrator.store.models import (
    Base,
    DeploymentStatus,
    Device,
    DeviceState,
    Job,
    JobState,
    Run,
    utcnow,
)
from orchestrator.store.models import Sample as SampleRow

ADAPTER = {"vendor": "qualcomm", "architecture": "adreno-7xx", "device": "Adreno (TM) 740",
           "description": "Qualcomm Technologies Inc. Adreno Vulkan Driver", "backend": "Vulkan"}


def _info(serial="R5CW1234", **kw) -> DeviceInfo:
    return DeviceInfo(serial=serial, model="SM-S918B", manufacturer="samsung", os="android",
                      os_version="14", adapter=ADAPTER, **kw)


def _device(session, serial="R5CW1234", **info) -> Device:
    device = store.upsert_device(session, serial, "adb", "127.0.0.1:5555", info=_info(serial, **info), host="lab-1")
    store.set_device_state(session, device.id, DeviceState.available)
    return device


def _manifest(build="b-0001") -> Manifest:
    return Manifest(build=build, version="0.1.0", created=1_700_000_000.0, source_revision="abc123",
                    files=[ManifestFile("engine/a.py", "a" * 64, 10), ManifestFile("unet/w.bin", "b" * 64, 1 << 33)])


# ---- schema -------------------------------------------------------------------------------


def test_upgrade_from_empty_creates_exactly_the_models_schema(db_url):
    with pytest.raises(SchemaMismatch, match="farm db upgrade"):
        check(db_url)
    upgrade(db_url)
    check(db_url)
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                    Base.metadata)
            assert diff == []
            tables = set(inspect(conn).get_table_names())
        assert tables == set(Base.metadata.tables) | {"alembic_version"}
        command.check(migrate.alembic_config(db_url))  # alembic's own "nothing to autogenerate"
        # Enum columns are guarded by CHECK constraints on both backends.
        insert = ("INSERT INTO devices (serial, transport, address, model, manufacturer, os, os_version, "
                  "gpu_vendor, gpu_architecture, gpu_device, gpu_driver, gpu_backend, virtual, state, "
                  "state_reason, created_at) VALUES (:serial, 'adb', '', '', '', '', '', '', '', '', '', '', "
                  "false, :state, '', CURRENT_TIMESTAMP)")
        with engine.begin() as conn:
            conn.execute(text(insert), {"serial": "s1", "state": "available"})
        with pytest.raises(IntegrityError, match="ck_devices_state"), engine.begin() as conn:
            conn.execute(text(insert), {"serial": "s2", "state": "on-fire"})
    finally:
        engine.dispose()
    command.downgrade(migrate.alembic_config(db_url), "base")
    upgrade(db_url)
    check(db_url)
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'f00dfeed'"))
        with pytest.raises(SchemaMismatch, match="f00dfeed.*newer devicefarm"):
            check(engine)
    finally:
        engine.dispose()


# ---- devices ------------------------------------------------------------------------------


def test_device_upsert_and_states(Session):
    with Session() as s:
        device = store.upsert_device(s, "R5CW1234", "adb", "127.0.0.1:5555", info=_info(), host="lab-1")
        assert device.state == DeviceState.offline  # until something reports it reachable
        s.commit()
    with Session() as s:
        device = store.get_device(s, "R5CW1234")
        assert (device.gpu_vendor, device.gpu_architecture, device.gpu_device) == (
            "qualcomm", "adreno-7xx", "Adreno (TM) 740")
        assert device.info["adapter"]["backend"] == "Vulkan" and device.host.name == "lab-1"
        assert device.last_seen.tzinfo is not None and utcnow() - device.last_seen < dt.timedelta(minutes=1)
        # again: same row, address updated
        again = store.upsert_device(s, "R5CW1234", "adb", "10.0.0.7:5555")
        assert again.id == device.id and again.address == "10.0.0.7:5555"

        store.set_device_state(s, device.id, store.TRANSPORT_STATES["unauthorized"], "RSA key not accepted")
        assert (device.state, device.state_reason) == (DeviceState.unauthorized, "RSA key not accepted")
        store.set_device_state(s, device.id, "quarantined", "reboots under load", force=True)
        store.set_device_state(s, device.id, DeviceState.available)  # a poll must not un-quarantine
        assert device.state == DeviceState.quarantined and device.state_reason == "reboots under load"
        assert not store.acquire_device_lease(s, device.id, "w1", 60)
        store.set_device_state(s, device.id, DeviceState.available, "released", force=True)
        assert device.state == DeviceState.available
        s.commit()
        with pytest.raises(store.StoreError, match="no device 'nope'"):
            store.get_device(s, "nope")
        with pytest.raises(ValueError):
            store.set_device_state(s, device.id, "on-fire")


def test_lease_acquire_renew_release_expire(Session):
    with Session() as s:
        device_id = _device(s).id
        s.commit()
    with Session() as a, Session() as b:
        assert store.acquire_device_lease(a, device_id, "worker-a", 60)
        a.commit()
        assert not store.acquire_device_lease(b, device_id, "worker-b", 60)
        b.commit()
        assert store.acquire_device_lease(a, device_id, "worker-a", 60)  # renewal
        a.commit()
        assert not store.release_device_lease(b, device_id, "worker-b")
        b.commit()
        assert store.release_device_lease(a, device_id, "worker-a")
        a.commit()
        assert store.acquire_device_lease(b, device_id, "worker-b", 0.05)
        b.commit()
        time.sleep(0.1)  # expired: anyone may take it
        assert store.acquire_device_lease(a, device_id, "worker-a", 60)
        a.commit()
        device = a.get(Device, device_id)
        assert device.lease_holder == "worker-a" and device.lease_until > utcnow()


def test_lease_is_exclusive_under_concurrency(Session):
    with Session() as s:
        device_id = _device(s).id
        s.commit()
    n_threads, attempts = 8, 40
    holding, max_holding, acquired, errors = [0], [0], [0], []
    guard = threading.Lock()
    start = threading.Barrier(n_threads)

    def worker(name):
        try:
            start.wait()
            for _ in range(attempts):
                with Session() as s:
                    got = store.acquire_device_lease(s, device_id, name, 30)
                    s.commit()
                if not got:
                    continue
                with guard:
                    holding[0] += 1
                    max_holding[0] = max(max_holding[0], holding[0])
                    acquired[0] += 1
                time.sleep(0.001)
                with guard:
                    holding[0] -= 1
                with Session() as s:
                    assert store.release_device_lease(s, device_id, name)
                    s.commit()
        except Exception as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert max_holding[0] == 1  # never two holders at once
    assert acquired[0] > n_threads  # and the lease did change hands


def _group(session, serials: list[str], group: str = "gpu-0") -> list[int]:
    """Devices of one adapter group, registered as discovery registers them."""
    return [_device(session, serial, adapter_id=group).id for serial in serials]


def test_adapter_group_lease_rules(Session):
    """Devices that share a GPU: a timed holder needs the whole group free; while it holds a
    device, no other device of the group can be taken; untimed holders share the group."""
    with Session() as s:
        phone, other, host = _group(s, ["vphone-1", "vphone-2", "host-gpu"])
        alone = _device(s, "own-gpu").id  # no adapter group: never blocked by the group
        s.commit()
        assert s.get(Device, phone).adapter_group == "gpu-0" and s.get(Device, alone).adapter_group is None
    with Session() as s:
        assert store.acquire_device_lease(s, phone, "gen-1", 60)  # untimed
        assert store.acquire_device_lease(s, other, "gen-2", 60)  # untimed beside untimed: yes
        assert not store.acquire_device_lease(s, host, "lat-1", 60, timed=True)  # timed beside them: no
        assert store.acquire_device_lease(s, alone, "lat-2", 60, timed=True)  # another GPU: yes
        s.commit()
        assert store.adapter_group_of(s, phone) == [phone, other, host] and store.adapter_group_of(s, alone) == [alone]
    with Session() as s:
        assert store.release_device_lease(s, phone, "gen-1") and store.release_device_lease(s, other, "gen-2")
        assert store.acquire_device_lease(s, host, "lat-1", 60, timed=True)  # the group is free now
        assert store.acquire_device_lease(s, host, "lat-1", 60, timed=True)  # renewal
        assert not store.acquire_device_lease(s, phone, "gen-3", 60)  # nothing starts beside a timed job
        assert not store.acquire_device_lease(s, other, "lat-3", 60, timed=True)
        s.commit()
        assert s.get(Device, host).lease_timed
    with Session() as s:
        assert store.release_device_lease(s, host, "lat-1")
        assert not s.get(Device, host).lease_timed
        assert store.acquire_device_lease(s, phone, "gen-3", 0.05)
        s.commit()
    time.sleep(0.1)  # an expired lease blocks no one
    with Session() as s:
        assert store.acquire_device_lease(s, host, "lat-4", 60, timed=True)
        s.commit()


def test_adapter_group_never_runs_a_timed_holder_beside_another_under_concurrency(Session):
    """Threads taking leases on three devices of one group, half of them timed: at no moment
    does a timed holder share the group with any other holder."""
    with Session() as s:
        ids = _group(s, ["g-1", "g-2", "g-3"], group="gpu-race")
        s.commit()
    holders: dict[str, bool] = {}  # holder -> timed, while held
    violations, acquired, errors = [], [0], []
    guard = threading.Lock()
    start = threading.Barrier(6)

    def worker(index: int):
        device_id, timed, name = ids[index % 3], index % 2 == 0, f"t{index}"
        try:
            start.wait()
            for _ in range(30):
                with Session() as s:
                    got = store.acquire_device_lease(s, device_id, name, 30, timed=timed)
                    s.commit()
                if not got:
                    continue
                with guard:
                    if holders and (timed or any(holders.values())):
                        violations.append((name, dict(holders)))
                    holders[name] = timed
                    acquired[0] += 1
                time.sleep(0.002)
                with guard:
                    del holders[name]
                with Session() as s:
                    assert store.release_device_lease(s, device_id, name)
                    s.commit()
        except Exception as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert violations == []
    assert acquired[0] > 6


def _lease_worker(url: str, device_id: int, name: str, wanted: int) -> list[tuple[float, float]]:
    """In a separate process: take the lease until it was held `wanted` times (or 30 s
    passed); the times it was held. Tries are counted by success, not by attempt: on two
    cores a holder preempted for a few ms would otherwise let the others spend all their
    attempts on a held lease."""
    engine = make_engine(url)
    Session = make_session_factory(engine)  # noqa: N806
    held = []
    deadline = time.monotonic() + 30
    try:
        while len(held) < wanted and time.monotonic() < deadline:
            with Session() as s:
                got = store.acquire_device_lease(s, device_id, name, 30)
                s.commit()
            if not got:
                time.sleep(0.001)
                continue
            begin = time.monotonic()  # system-wide clock: comparable across processes
            time.sleep(0.002)
            held.append((begin, time.monotonic()))
            with Session() as s:
                store.release_device_lease(s, device_id, name)
                s.commit()
    finally:
        engine.dispose()
    return held


def test_lease_is_exclusive_across_processes(db_url, Session):
    with Session() as s:
        device_id = _device(s).id
        s.commit()
    with multiprocessing.get_context("spawn").Pool(6) as pool:
        spans = pool.starmap(_lease_worker, [(db_url, device_id, f"p{i}", 5) for i in range(6)])
    assert [len(worker) for worker in spans] == [5] * 6  # every process held it, none starved
    intervals = sorted(span for worker in spans for span in worker)
    overlaps = sum(1 for (_, end), (begin, _) in zip(intervals, intervals[1:], strict=False) if begin < end)
    assert overlaps == 0


# ---- builds and deployments ---------------------------------------------------------------


def test_create_build_is_idempotent_and_deployment_recorded(Session):
    with Session() as s:
        device = _device(s)
        build = store.create_build(s, _manifest())
        assert store.create_build(s, _manifest()).id == build.id
        s.commit()
        assert [(f.path, f.size) for f in build.files] == [("engine/a.py", 10), ("unet/w.bin", 1 << 33)]
        assert build.manifest_sha256 == store.manifest_sha256(_manifest()) and build.created.tzinfo
        other = _manifest()
        other.version = "0.2.0"
        with pytest.raises(store.StoreError, match="already exists with another manifest"):
            store.create_build(s, other)
        dep = store.record_deployment(s, build.id, device.id, DeploymentStatus.running)
        dep = store.record_deployment(s, build.id, device.id, "succeeded", bytes_sent=123, files_sent=1,
                                      files_skipped=1, duration_s=2.5, deployment_id=dep.id)
        s.commit()
        assert (dep.status, dep.bytes_sent, dep.finished_at is not None) == ("succeeded", 123, True)


def test_migration_0022_names_the_engine_host_and_each_stored_jobs_executor(db_url):
    """Down to 0021 a device's engine host is its `runtime` column and a stored spec names only
    an executor other than native, as the former engine_runtime; back up, every stored spec names
    its executor (browser for a browser device's jobs, whatever they said) and reads back as a
    JobSpec."""
    config = migrate.alembic_config(db_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    sessions = make_session_factory(engine)
    try:
        with sessions() as s, s.begin():
            chrome = store.upsert_device(s, "chrome-phone", "adb", "127.0.0.1:5991", engine_host="browser")
            agent = store.upsert_device(s, "agent-phone", "adb", "127.0.0.1:5992")
            for device, spec in ((chrome, {"model": "models/tiny", "steps": 2}), (agent, {"model": "models/tiny"}),
                                 (agent, {"model": "models/tiny", "executor": "plan"})):
                store.create_job(s, "latency", spec, device.id)
        command.downgrade(config, "0021")
        with engine.begin() as conn:
            assert dict(conn.execute(text("SELECT serial, runtime FROM devices")).all()) == \
                {"chrome-phone": "browser", "agent-phone": "python"}
            old = [json.loads(v) if isinstance(v, str) else v for v in conn.scalars(text("SELECT spec FROM jobs ORDER BY id"))]
            assert [(o.get("engine_runtime"), "executor" in o) for o in old] == [("browser", False), (None, False), ("plan", False)]
            # a browser device's job stored before its executor was: told so only when it ran
            conn.execute(text("UPDATE jobs SET spec = :spec WHERE id = 1"),
                         {"spec": json.dumps({"model": "models/tiny", "steps": 2})})
        command.upgrade(config, "head")
        with sessions() as s:
            specs = [store.job_spec(j) for j in s.scalars(select(Job).order_by(Job.id))]
            assert {d.serial: d.engine_host for d in s.scalars(select(Device))} == \
                {"chrome-phone": "browser", "agent-phone": "python"}
        assert [(sp.executor, sp.steps) for sp in specs] == [("browser", 2), ("native", 20), ("plan", 20)]
    finally:
        engine.dispose()


# ---- jobs ---------------------------------------------------------------------------------

MODEL = {"model": "models/tiny"}  # the least a job's spec names


def test_a_job_spec_reads_back_as_submitted_with_its_executor_resolved(Session):
    """The spec is validated once, at submission, and stored whole: read back from the store it
    equals the JobSpec submitted, named for its job, with its build and its executor (a browser
    device's jobs run on its page) filled in; a bad field is refused before anything is stored."""
    with Session() as s:
        device_id = _device(s).id
        browser_id = store.upsert_device(s, "pixel-chrome", "adb", "127.0.0.1:5991", engine_host="browser").id
        build = store.create_build(s, Manifest(build="b-typed", version="1", created=0.0,
                                               files=[ManifestFile("models/tiny/model_index.json", "0" * 64, 2)]))
        submitted = JobSpec(job_id="ignored", kind="latency", model="models/tiny", precision="fp32", height=64, width=64,
                            steps=3, cooldown=Cooldown(max_celsius=45.0), gpu_budget_bytes=2**30, executor="plan")
        job = store.create_job(s, "latency", submitted, device_id, build.id)
        s.commit()
        job_id = job.id
        on_page = store.create_job(s, "generate", {"model": "models/tiny", "steps": 2}, browser_id, build.id)
        s.commit()
        with pytest.raises(store.StoreError, match="steps must be at least 1"):
            store.create_job(s, "generate", {"model": "models/tiny", "steps": 0}, device_id)
        with pytest.raises(store.StoreError, match="browser executor, not 'plan'"):
            store.create_job(s, "generate", {"model": "models/tiny", "executor": "plan"}, browser_id)
    with Session() as s:
        read = store.job_spec(s.get(Job, job_id))
        assert read == dataclasses.replace(submitted, job_id=f"job{job_id}", build="b-typed")
        assert store.job_spec(s.get(Job, job_id), attempt=2).job_id == f"job{job_id}-a2"
        page = store.job_spec(s.get(Job, on_page.id))
        assert (page.executor, page.kind, page.steps, page.build) == ("browser", "generate", 2, "b-typed")
        assert s.scalar(select(func.count()).select_from(Job)) == 2


def test_job_creation_is_idempotent(Session):
    with Session() as s:
        device_id = _device(s).id
        spec = JobSpec(job_id="j1", kind="latency", model="models/tiny")
        job = store.create_job(s, "latency", spec, device_id, idempotency_key="nightly/2026-11-21/R5CW1234")
        again = store.create_job(s, "latency", spec, device_id, idempotency_key="nightly/2026-11-21/R5CW1234")
        assert again.id == job.id and job.spec["model"] == "models/tiny" and job.state == JobState.queued
        s.commit()

    # Racing creators with one key (a schedule firing on two beats) make one job.
    results, errors = [], []
    start = threading.Barrier(6)

    def create():
        try:
            start.wait()
            with Session() as s:
                results.append(store.create_job(s, "generate", MODEL, device_id, idempotency_key="race").id)
                s.commit()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(results)) == 1
    with Session() as s:
        assert s.scalar(select(func.count()).select_from(Job).where(Job.idempotency_key == "race")) == 1
        assert store.create_job(s, "tune", MODEL, device_id).id != store.create_job(s, "tune", MODEL, device_id).id


def test_job_transition_rules(Session):
    with Session() as s:
        device_id = _device(s).id
        job = store.create_job(s, "latency", MODEL, device_id)
        with pytest.raises(store.InvalidTransition, match="from queued to succeeded"):
            store.transition_job(s, job.id, JobState.succeeded)
        job = store.transition_job(s, job.id, "running", worker="lab-1/w1")
        assert (job.attempts, job.worker, job.started_at.tzinfo is not None) == (1, "lab-1/w1", True)
        job = store.transition_job(s, job.id, "infra_failed", error="device offline")
        job = store.transition_job(s, job.id, "queued")
        job = store.transition_job(s, job.id, "running")
        assert job.attempts == 2 and job.error is None
        job = store.transition_job(s, job.id, "succeeded", log_tail="done")
        assert job.finished_at is not None and job.log_tail == "done"
        for target in JobState:
            with pytest.raises(store.InvalidTransition):
                store.transition_job(s, job.id, target)
        cancelled = store.create_job(s, "tune", MODEL, device_id)
        store.transition_job(s, cancelled.id, "cancelled")
        with pytest.raises(store.InvalidTransition):
            store.transition_job(s, cancelled.id, "running")
        with pytest.raises(store.StoreError, match="no job 999999"):
            store.transition_job(s, 999999, "running")
        racy = store.create_job(s, "latency", MODEL, device_id)
        s.commit()
        racy_id = racy.id

    # Workers racing to start the same job: exactly one wins, on every backend.
    winners, errors = [], []
    barrier = threading.Barrier(4)

    def start(name):
        try:
            barrier.wait()
            with Session() as s:
                try:
                    store.transition_job(s, racy_id, "running", worker=name)
                    s.commit()
                    winners.append(name)
                except store.InvalidTransition:
                    s.rollback()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(winners) == 1
    with Session() as s:
        job = s.get(Job, racy_id)
        assert (job.worker, job.attempts) == (winners[0], 1)


def test_find_stale_running_jobs(Session):
    with Session() as s:
        device_id = _device(s).id
        stale, fresh, queued = (store.create_job(s, "latency", MODEL, device_id) for _ in range(3))
        store.transition_job(s, stale.id, "running")
        store.transition_job(s, fresh.id, "running")
        s.execute(update(Job).where(Job.id == stale.id).values(heartbeat_at=utcnow() - dt.timedelta(minutes=10)))
        s.commit()
        found = store.find_stale_running_jobs(s, dt.timedelta(minutes=5))
        assert [j.id for j in found] == [stale.id]
        store.heartbeat_job(s, stale.id)
        s.commit()
        assert store.find_stale_running_jobs(s, dt.timedelta(minutes=5)) == []


# ---- results ------------------------------------------------------------------------------


def test_record_result_round_trip(Session):
    with Session() as s:
        device_id = _device(s).id
        build = store.create_build(s, _manifest())
        spec = JobSpec(job_id="j7", kind="generate", model="models/tiny", prompt="a red fox", seed=42)
        job = store.create_job(s, "generate", spec, device_id, build.id)
        store.transition_job(s, job.id, "running")
        result = JobResult(
            job_id="j7", kind="generate", status="succeeded", started_at=1_700_000_100.5,
            finished_at=1_700_000_112.25, device="Adreno (TM) 740",
            engine={"profile": "adreno-7xx", "precision": "fp16"},
            samples=[Sample("unet_step_ms", 450.0 + i, "ms", i) for i in range(5)]
            + [Sample("peak_gpu_bytes", 1.9e9, "bytes")],
            kernel_timings=[KernelTiming("attention/flash", 32, 120.5, 0), KernelTiming("conv2d", 64, 210.0, 0)],
            thermal=[ThermalReading("before", "gpu", 38.5), ThermalReading("after", "gpu", 51.0)],
            cooldown_wait_s=12.0,
            artifacts=[Artifact("image.png", "c" * 64, 4096, "image"), Artifact("job.log", "d" * 64, 10, "log")],
            log_tail="ok",
        )
        run = store.record_result(s, job.id, result)
        store.transition_job(s, job.id, "succeeded")
        assert store.record_result(s, job.id, result).id == run.id  # a redelivered task writes nothing
        s.commit()
        run_id = run.id

    with Session() as s:
        run = s.get(Run, run_id)
        assert (run.attempt, run.status, run.device_id, run.build_id) == (1, "succeeded", device_id, build.id)
        assert run.started_at == dt.datetime(2023, 11, 14, 22, 15, 0, 500000, tzinfo=dt.UTC)
        assert run.engine == {"profile": "adreno-7xx", "precision": "fp16"} and run.cooldown_wait_s == 12.0
        assert sorted((x.metric, x.value, x.unit, x.repetition) for x in run.samples) == sorted(
            [("unet_step_ms", 450.0 + i, "ms", i) for i in range(5)] + [("peak_gpu_bytes", 1.9e9, "bytes", 0)])
        assert sorted((k.kernel, k.calls, k.total_ms) for k in run.kernel_timings) == [
            ("attention/flash", 32, 120.5), ("conv2d", 64, 210.0)]
        assert sorted((t.phase, t.zone, t.celsius) for t in run.thermal) == [
            ("after", "gpu", 51.0), ("before", "gpu", 38.5)]
        assert [(i.path, i.sha256, i.prompt, i.seed) for i in run.images] == [("image.png", "c" * 64, "a red fox", 42)]
        assert [a["path"] for a in run.artifacts] == ["image.png", "job.log"]
        assert s.get(Job, run.job_id).state == JobState.succeeded
        # the series query the dashboards use: one metric on one device, by build
        values = s.scalars(
            select(SampleRow.value).join(Run).where(SampleRow.metric == "unet_step_ms", Run.device_id == device_id)
        ).all()
        assert sorted(values) == [450.0, 451.0, 452.0, 453.0, 454.0]


def test_sqlite_engine_settings(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'sub' / 'farm.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000
    finally:
        engine.dispose()
    assert make_session_factory(engine).kw["expire_on_commit"] is False


def test_a_session_gone_quiet_inside_a_transaction_releases_its_row_locks(pg_server_url):
    """A worker cut off from PostgreSQL between two statements of a transaction (its link down
    after its UPDATE's answer left the server) leaves the server holding that transaction's row
    locks: every other worker's reconciler and health check that touches those rows waits on them
    (a CI run of the two-host partition test saw both of the other host's pool slots stuck so).
    The worker's and the API's engines have the server end such a session after
    Settings.idle_transaction_s, and the other writer gets the row. An engine without the limit
    (what they had) keeps the lock past 3 s."""
    from sqlalchemy.exc import DBAPIError, OperationalError

    from orchestrator.infra.settings import IDLE_TRANSACTION_MIN_S, Settings

    assert Settings(stale_after_s=6.0).idle_transaction_s == IDLE_TRANSACTION_MIN_S
    assert Settings(stale_after_s=120.0).idle_transaction_s == 120.0

    def held_past(holder_engine, wait_s: float) -> bool:
        """Whether another session still finds a row locked `wait_s` after its holder went quiet."""
        other = make_engine(pg_server_url)
        table = f"quiet_{time.monotonic_ns()}"
        try:
            with other.begin() as conn:
                conn.exec_driver_sql(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
                conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 0)")
            holder = holder_engine.connect()
            try:
                holder.begin()
                holder.exec_driver_sql(f"UPDATE {table} SET v = 1 WHERE id = 1")  # and then nothing
                time.sleep(wait_s)
                with other.begin() as conn:
                    conn.exec_driver_sql("SET LOCAL lock_timeout = '1s'")
                    conn.exec_driver_sql(f"UPDATE {table} SET v = 2 WHERE id = 1")
                return False
            except OperationalError as exc:
                assert "lock timeout" in str(exc), exc
                return True
            finally:
                try:
                    holder.close()
                except DBAPIError:  # the server ended it
                    pass
        finally:
            with other.begin() as conn:
                conn.exec_driver_sql(f"DROP TABLE {table}")
            other.dispose()

    quiet = make_engine(pg_server_url, idle_transaction_s=1.0)
    plain = make_engine(pg_server_url)
    try:
        assert held_past(plain, 3.0)
        assert not held_past(quiet, 3.0)
        with pytest.raises(DBAPIError, match="idle-in-transaction"), quiet.connect() as conn:
            conn.begin()
            conn.exec_driver_sql("SELECT 1")
            time.sleep(2.0)
            conn.exec_driver_sql("SELECT 1")  # the server ended this session
    finally:
        quiet.dispose()
        plain.dispose()


def _write_without_waiting(url: str) -> None:
    """A write transaction that gives up after 0.2 s instead of the store's 30 s busy timeout."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            conn.connection.dbapi_connection.execute("PRAGMA busy_timeout=200")  # no SQLAlchemy transaction
            with conn.begin():
                conn.exec_driver_sql("UPDATE alembic_version SET version_num = version_num")
    finally:
        engine.dispose()


def test_a_read_snapshot_holds_no_write_lock_where_an_ordinary_transaction_does(tmp_path):
    from sqlalchemy.exc import OperationalError

    from orchestrator.store.session import read_snapshot

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        with make_session_factory(engine)() as session, session.begin():
            read_snapshot(session)
            session.execute(select(Device)).all()
            _write_without_waiting(url)  # a worker recording a result goes on
        with make_session_factory(engine)() as session, session.begin():
            session.execute(select(Device)).all()
            with pytest.raises(OperationalError, match="locked"):
                _write_without_waiting(url)
    finally:
        engine.dispose()


def test_an_analysis_scans_history_in_a_snapshot_other_writers_do_not_wait_for(tmp_path, monkeypatch):
    """A batch's analysis scans each of its devices' whole history for change points: 17.9 s of
    a 19.5 s analysis kept every writer waiting on SQLite (benchmarks/analysis_lock.py, 5
    devices, a year of nightly builds), past the busy timeout for a larger farm."""
    from orchestrator.analysis import changepoints
    from orchestrator.infra.settings import Settings
    from orchestrator.jobs import batch_analysis
    from orchestrator.jobs.celery_app import make_celery

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    upgrade(url)
    engine = make_engine(url)
    with make_session_factory(engine)() as s, s.begin():
        device = _device(s)
        build = store.create_build(s, _manifest())
        batch = store.create_batch(s, "nightly", build_id=build.id)
        store.create_job(s, "latency", {"model": "m", "precision": "fp32"}, device.id, build.id, batch_id=batch.id)
        batch_id = batch.id
    engine.dispose()
    scanned = []

    def scan(session, device, metric=None):
        _write_without_waiting(url)  # raises "database is locked" if the scan held the write lock
        scanned.append(device.serial)
        return []

    monkeypatch.setattr(changepoints, "find_change_points", scan)
    batch_analysis.analyze(make_celery(Settings(database_url=url, data_dir=tmp_path / "data")), batch_id)
    assert scanned == ["R5CW1234"]
