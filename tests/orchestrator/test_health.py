"""Device health on SQLite and PostgreSQL: the state machine transition by transition (every
allowed one through apply_device_event, the lease events through the lease statements too,
every refused one), the documented table equal to the code's, the health check's back-off
with explicit clocks, a virtual phone that restarts and comes back available by itself (in
process, and through a real worker and the Celery tasks), busy recorded while a job runs, and
quarantine after the third job in a row that failed for infrastructure reasons."""

from __future__ import annotations

import datetime as dt
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select, update
from worker_farm import Workers, wait

from agent.protocol import JobResult, Manifest, ManifestFile
from agent.simulator import VirtualPhone
from orchestrator import store
from orchestrator.infra.settings import Settings
from orchestrator.jobs import dispatch, health, worker
from orchestrator.jobs.celery_app import DEFAULT_QUEUE, make_celery
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.device_states import DEVICE_TRANSITIONS, DeviceEvent, markdown_table
from orchestrator.store.models import Device, DeviceState, Host, Job, JobState, utcnow
from orchestrator.transports import DeviceOffline
from orchestrator.transports.adb import load_or_create_adb_key

HOST = "testhost"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "devices.md"
SPEC = {"model": "models/tiny", "precision": "fp32", "steps": 1, "scheduler": "euler", "time_limit_s": 120.0}
T0 = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def farm(tmp_path, db_url):
    """A migrated store on each backend, settings and a Celery app on it (no worker: what the
    health check sends stays in the embedded broker's folder)."""
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name=HOST,
                        database_url=db_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    yield SimpleNamespace(settings=settings, Session=make_session_factory(engine), app=make_celery(settings),
                          tmp=tmp_path)
    engine.dispose()


def _device(session, serial: str, state: DeviceState = DeviceState.available, reason: str = "as set",
            address: str = "127.0.0.1:9") -> Device:
    """A device put straight into `state` (as the store holds it), reason `reason`."""
    device = store.upsert_device(session, serial, "adb", address, host=HOST)
    device.state, device.state_reason = state, reason
    session.flush()
    return device


@contextmanager
def _phone(settings: Settings, port: int = 0, root: Path | None = None):
    """A virtual phone that trusts this farm's ADB key, as a paired phone does."""
    key = load_or_create_adb_key(settings.adb_key)
    with VirtualPhone(serial="vphone-heal", root=root, port=port, adb_keys=key.with_name(key.name + ".pub")) as p:
        yield p


# ---- the state machine --------------------------------------------------------------------


def test_every_allowed_transition(farm):
    for n, ((state, event), step) in enumerate(DEVICE_TRANSITIONS.items()):
        with farm.Session() as s, s.begin():
            device = _device(s, f"d{n}", state)
            store.apply_device_event(s, device.id, event, f"because {event}")
        with farm.Session() as s:
            device = store.get_device(s, f"d{n}")
            assert device.state == step.to, (state, event)
            assert device.state_reason == ("as set" if step.ignored else f"because {event}"), (state, event)


def test_every_refused_transition(farm):
    refused = [(state, event) for state in DeviceState for event in DeviceEvent
               if (state, event) not in DEVICE_TRANSITIONS]
    assert len(refused) == len(DeviceState) * len(DeviceEvent) - len(DEVICE_TRANSITIONS) == 9
    for n, (state, event) in enumerate(refused):
        with farm.Session() as s, s.begin():
            device_id = _device(s, f"d{n}", state).id
        with farm.Session() as s, s.begin():
            with pytest.raises(store.InvalidTransition, match=f"device 'd{n}': {event} refused: it is {state}"):
                store.apply_device_event(s, device_id, event, "nope")
        with farm.Session() as s:
            assert (store.get_device(s, device_id).state, store.get_device(s, device_id).state_reason) == (
                state, "as set")
    # The refusals a person meets, in words.
    with farm.Session() as s, s.begin():
        device_id = _device(s, "phone", DeviceState.offline).id
        with pytest.raises(store.InvalidTransition, match="not quarantined, and only a quarantined device is released"):
            store.set_device_state(s, device_id, DeviceState.available, "released", force=True)
        with pytest.raises(store.InvalidTransition, match="busy is recorded by taking its lease"):
            store.set_device_state(s, device_id, DeviceState.busy)
        with pytest.raises(store.InvalidTransition, match="an operator quarantines it"):
            store.set_device_state(s, device_id, DeviceState.quarantined, "no force")


def test_lease_statements_follow_the_table(farm):
    """acquire/release/expire change the state in their own UPDATE: each state they meet
    ends where the table says, quarantined refuses the lease, a reason survives an ignored
    event and is cleared by a state change."""
    later = utcnow() + dt.timedelta(hours=1)
    for state in DeviceState:
        with farm.Session() as s, s.begin():
            device_id = _device(s, f"take-{state}", state).id
            got = store.acquire_device_lease(s, device_id, "h", 60)
            step = DEVICE_TRANSITIONS.get((state, DeviceEvent.lease_taken))
            assert got == (step is not None), state
            device = store.get_device(s, device_id)
            assert device.state == (step.to if step else state), state
            assert device.state_reason == ("as set" if state in (DeviceState.busy, DeviceState.quarantined) else "")

        with farm.Session() as s, s.begin():
            device_id = _device(s, f"give-{state}", state).id
            s.execute(update(Device).where(Device.id == device_id).values(lease_holder="h", lease_until=later))
            assert store.release_device_lease(s, device_id, "h")
            step = DEVICE_TRANSITIONS[(state, DeviceEvent.lease_released)]
            device = store.get_device(s, device_id)
            assert (device.state, device.lease_holder) == (step.to, None), state
            assert device.state_reason == ("as set" if step.ignored else ""), state

        with farm.Session() as s, s.begin():
            device_id = _device(s, f"expire-{state}", state).id
            s.execute(update(Device).where(Device.id == device_id).values(
                lease_holder="gone", lease_until=utcnow() - dt.timedelta(seconds=1)))
            freed = store.expire_device_leases(s, utcnow())
            assert freed == ([device_id] if state == DeviceState.busy else []), state
            assert store.get_device(s, device_id).state == (
                DeviceState.available if state == DeviceState.busy else state)
    with farm.Session() as s, s.begin():  # a live lease is not expired
        device_id = _device(s, "held").id
        assert store.acquire_device_lease(s, device_id, "h", 60)
        assert store.expire_device_leases(s, utcnow()) == []
        assert store.get_device(s, device_id).state == DeviceState.busy


def test_docs_carry_the_table():
    assert markdown_table() in DOCS.read_text()


# ---- the health check ---------------------------------------------------------------------


def test_backoff_doubles_to_thirty_minutes():
    assert [health.backoff_s(n) for n in range(1, 10)] == [30, 60, 120, 240, 480, 960, 1800, 1800, 1800]


def test_probe_backoff_with_explicit_clocks(farm):
    """Nothing listens on 127.0.0.1:9: each probe fails, and the device is due again after 30 s,
    then 60, 120, ... up to 30 min; a check claims a due device until its next back-off."""
    with farm.Session() as s, s.begin():
        device = _device(s, "gone", DeviceState.available)
        device_id = device.id
    now, waits = T0, []
    for failures in range(1, 9):
        outcome = health.probe(farm.settings, farm.Session, device, now=now)
        assert outcome.state == DeviceState.offline and outcome.error is not None
        with farm.Session() as s:
            row = store.get_device(s, device_id)
            assert row.probe_failures == failures
            waits.append((row.next_probe_at - now).total_seconds())
            assert [d.id for d in store.devices_due_for_probe(s, row.next_probe_at - dt.timedelta(seconds=1))] == []
            assert [d.id for d in store.devices_due_for_probe(s, row.next_probe_at)] == [device_id]
        now = row.next_probe_at
    assert waits == [30, 60, 120, 240, 480, 960, 1800, 1800]

    # The check sends a probe of a due device and claims it for one more back-off.
    report = health.check(farm.app, now=now)
    assert report == {"freed": [], "offline": [], "probed": [device_id]}
    with farm.Session() as s:
        assert store.get_device(s, device_id).next_probe_at == now + dt.timedelta(seconds=1800)
    assert health.check(farm.app, now=now + dt.timedelta(seconds=1))["probed"] == []
    sent = list((farm.settings.broker_dir / "queue").iterdir())
    assert len(sent) == 1 and f"host.{HOST}".encode() in sent[0].read_bytes()


def test_check_skips_quarantined_leased_and_reachable_devices(farm):
    with farm.Session() as s, s.begin():
        due_offline = _device(s, "a-offline", DeviceState.offline).id
        due_unauthorized = _device(s, "b-unauthorized", DeviceState.unauthorized).id
        later = _device(s, "c-later", DeviceState.offline)
        later.next_probe_at = T0 + dt.timedelta(minutes=5)
        _device(s, "d-quarantined", DeviceState.quarantined)
        _device(s, "e-available", DeviceState.available)
        leased = _device(s, "f-leased", DeviceState.offline).id
        stale_busy = _device(s, "g-stale-busy", DeviceState.busy).id
        s.execute(update(Device).where(Device.id == leased).values(lease_holder="job", lease_until=T0 + dt.timedelta(minutes=1)))
        s.execute(update(Device).where(Device.id == stale_busy).values(lease_holder="dead", lease_until=T0 - dt.timedelta(minutes=1)))
    assert health.check(farm.app, now=T0) == {"freed": [stale_busy], "offline": [],
                                              "probed": [due_offline, due_unauthorized]}
    with farm.Session() as s:
        assert store.get_device(s, stale_busy).state == DeviceState.available
    # A probe sent before the device changed is skipped when it arrives.
    with farm.Session() as s, s.begin():
        store.set_device_state(s, due_offline, DeviceState.quarantined, "flaky", force=True)
    assert health.probe_device(farm.app, due_offline, now=T0) == "skipped"
    assert health.probe_device(farm.app, leased, now=T0) == "skipped"


def test_a_silent_hosts_devices_go_offline_and_are_probed_once_it_is_heard_again(farm):
    """A host whose workers have not stamped it for stale_after_s (dead, or cut off from the
    store): its available, busy and unauthorized devices go offline, saying why, and none is
    probed while it stays silent (no worker there would take the probe); once its heartbeat
    lands again, each is probed on its host at the next check. Another host's due device is
    probed all along."""
    with farm.Session() as s, s.begin():
        idle = _device(s, "a-idle", DeviceState.available).id
        busy = _device(s, "b-busy").id
        assert store.acquire_device_lease(s, busy, "job1:x", 60)  # a job of that host holds it
        refused = _device(s, "c-unauthorized", DeviceState.unauthorized).id
        quarantined = _device(s, "d-quarantined", DeviceState.quarantined).id
        elsewhere = store.upsert_device(s, "e-elsewhere", "adb", "127.0.0.1:9", host="otherhost").id  # offline, due
        s.execute(update(Host).where(Host.name == HOST).values(last_seen=utcnow() - dt.timedelta(seconds=61)))
    assert health.check(farm.app) == {"freed": [], "offline": [idle, busy, refused], "probed": [elsewhere]}
    with farm.Session() as s:
        rows = {d.id: d for d in store.all_devices(s)}
        assert {rows[i].state for i in (idle, busy, refused)} == {DeviceState.offline}
        assert rows[idle].state_reason.startswith(f"its host {HOST} has not been heard from for 6")
        assert rows[quarantined].state == DeviceState.quarantined
    assert health.check(farm.app) == {"freed": [], "offline": [], "probed": []}  # still silent: nothing sent

    health.HostHeartbeat(farm.settings, [HOST]).beat()  # what a worker consuming host.<HOST> does
    # (the busy one still has its job's lease: its job's outcome, or the reconciler, gives it back)
    assert health.check(farm.app) == {"freed": [], "offline": [], "probed": [idle, refused]}


def test_a_probe_leaves_a_busy_device_to_its_holder(farm):
    with farm.Session() as s, s.begin():
        device = _device(s, "held", DeviceState.available)
        assert store.acquire_device_lease(s, device.id, "job1:x", 60)
    outcome = health.probe(farm.settings, farm.Session, device, now=T0)  # nothing answers at :9
    assert outcome.error is not None and outcome.state == DeviceState.busy
    with farm.Session() as s:
        row = store.get_device(s, device.id)
        assert (row.state, row.state_reason, row.probe_failures, row.lease_holder) == (
            DeviceState.busy, "", 0, "job1:x")


def test_phone_that_restarts_comes_back_available_by_itself(farm):
    root = farm.tmp / "phone"
    with _phone(farm.settings, root=root) as phone:
        port = phone.port
        with farm.Session() as s, s.begin():
            device = store.upsert_device(s, "vphone-heal", "adb", f"127.0.0.1:{port}", host=HOST)
        assert health.probe(farm.settings, farm.Session, device, now=T0).state == DeviceState.available
    # The phone is gone: the next probe records it offline, due again in 30 s.
    outcome = health.probe(farm.settings, farm.Session, device, now=T0)
    assert outcome.state == DeviceState.offline
    assert health.check(farm.app, now=T0 + dt.timedelta(seconds=10))["probed"] == []

    with _phone(farm.settings, port=port, root=root):  # it restarts on the same address
        assert health.check(farm.app, now=T0 + dt.timedelta(seconds=30))["probed"] == [device.id]
        # What the probe task does on the device's host:
        assert health.probe_device(farm.app, device.id, now=T0 + dt.timedelta(seconds=30)) == "available"
    with farm.Session() as s:
        row = store.get_device(s, device.id)
        assert (row.state, row.state_reason, row.probe_failures, row.next_probe_at) == (
            DeviceState.available, "", 0, None)
        assert row.model == "Virtual Pixel 7"


def test_health_check_task_brings_a_phone_back_through_a_worker(tmp_path):
    """The same through beat's task on a real worker: health_check on the farm queue sends
    probe_device to the host queue, whose worker finds the restarted phone."""
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name=HOST)
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    farm = {"Session": make_session_factory(engine), "tmp": tmp_path}
    app = make_celery(settings)
    assert app.conf.beat_schedule["health-check"] == {
        "task": "orchestrator.tasks.health_check", "schedule": 180.0, "options": {"queue": DEFAULT_QUEUE}}
    workers = Workers(tmp_path, settings)
    root = tmp_path / "phone"
    try:
        with _phone(settings, root=root) as phone:
            port = phone.port
            with farm["Session"]() as s, s.begin():
                device = store.upsert_device(s, "vphone-heal", "adb", f"127.0.0.1:{port}", host=HOST)
        # Found offline a minute ago: due now.
        assert health.probe(settings, farm["Session"], device, now=utcnow() - dt.timedelta(seconds=60)).state \
            == DeviceState.offline
        started = utcnow()
        workers.start("worker")
        # The worker stamps its host as heard while it runs (health.HostHeartbeat).
        wait(farm, lambda s: s.scalar(select(Host.last_seen).where(Host.name == HOST)) > started, "the host heard")
        with _phone(settings, port=port, root=root):
            app.signature("orchestrator.tasks.health_check").apply_async(queue=DEFAULT_QUEUE, ignore_result=True)
            row = wait(farm, lambda s: (d := store.get_device(s, device.id)).state == DeviceState.available and d,
                       "the phone back available")
        assert row.probe_failures == 0 and row.next_probe_at is None
    finally:
        workers.stop()
        engine.dispose()


# ---- jobs: busy while running, quarantine after infrastructure failures ------------------


class ScriptedTransport:
    """Stands in for a device: each run() takes the next outcome, "ok" or "offline", and notes
    the device's state as the store had it while the job ran."""

    def __init__(self, outcomes: list[str], Session, device_id: int):  # noqa: N803
        self.outcomes, self.Session, self.device_id, self.seen = outcomes, Session, device_id, []

    def __call__(self, device, settings):  # make_transport's signature
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def run(self, spec, out_dir, progress=None):
        with self.Session() as s:
            self.seen.append(store.get_device(s, self.device_id).state)
        if self.outcomes.pop(0) == "offline":
            raise DeviceOffline("fake-1", "connection refused")
        return JobResult(job_id=spec.job_id, kind=spec.kind, status="succeeded")


def _run_to_the_end(farm, job_id: int) -> str:
    """run_attempt until the job settles (the attempts a worker would make after each requeue)."""
    while (outcome := worker.run_attempt(farm.app, job_id, worker="test")) == "requeued":
        pass
    return outcome


def test_busy_while_a_job_runs_and_quarantine_after_three_infra_failures_in_a_row(farm, monkeypatch):
    manifest = Manifest(build="b-health", version="0.1.0", created=1_700_000_000.0, source_revision="abc",
                        files=[ManifestFile("engine/a.py", "a" * 64, 10)])
    with farm.Session() as s, s.begin():
        build_id = store.create_build(s, manifest).id
        device_id = _device(s, "fake-1", DeviceState.available, "").id
    fail_job = ["offline"] * dispatch.MAX_ATTEMPTS  # one job that fails every attempt
    transport = ScriptedTransport(fail_job * 2 + ["ok"] + fail_job * 3, farm.Session, device_id)
    monkeypatch.setattr(worker, "make_transport", transport)

    def new_job() -> int:
        with farm.Session() as s, s.begin():
            return store.create_job(s, "generate", SPEC, device_id, build_id).id

    def device() -> Device:
        with farm.Session() as s:
            return store.get_device(s, device_id)

    # Two jobs end infra_failed: counted, the device offline, not quarantined.
    assert [_run_to_the_end(farm, new_job()) for _ in range(2)] == ["infra_failed"] * 2
    assert (device().state, device().infra_failures_in_row) == (DeviceState.offline, 2)
    # A job that runs: busy while it ran, available after, the count starts again.
    assert _run_to_the_end(farm, new_job()) == "succeeded"
    assert transport.seen[-1] == DeviceState.busy
    assert (device().state, device().infra_failures_in_row, device().lease_holder) == (DeviceState.available, 0, None)
    # Three in a row: quarantined, with the reason.
    assert [_run_to_the_end(farm, new_job()) for _ in range(2)] == ["infra_failed"] * 2
    assert device().state == DeviceState.offline
    assert _run_to_the_end(farm, new_job()) == "infra_failed"
    assert transport.seen == [DeviceState.busy] * len(transport.seen) and len(transport.seen) == 16
    quarantined = device()
    assert (quarantined.state, quarantined.infra_failures_in_row) == (DeviceState.quarantined, 3)
    assert quarantined.state_reason == ("3 jobs in a row failed for infrastructure reasons; "
                                        "last: fake-1: connection refused")
    # A quarantined device runs nothing and counts nothing; the operator's release starts afresh.
    job_id = new_job()
    assert worker.run_attempt(farm.app, job_id, worker="test") == "infra_failed"
    with farm.Session() as s:
        assert "is quarantined (3 jobs in a row" in s.get(Job, job_id).error
    assert len(transport.seen) == 16 and device().infra_failures_in_row == 3
    with farm.Session() as s, s.begin():
        store.set_device_state(s, device_id, DeviceState.available, "released by operator", force=True)
    assert (device().state, device().infra_failures_in_row) == (DeviceState.available, 0)


def test_count_job_outcome_counts_only_final_outcomes(farm):
    with farm.Session() as s, s.begin():
        device_id = _device(s, "p1").id
        counts = [store.count_job_outcome(s, device_id, outcome, "boom") for outcome in (
            JobState.infra_failed, "requeued", JobState.infra_failed, JobState.failed, JobState.infra_failed,
            JobState.infra_failed)]
        assert counts == [1, 1, 2, 0, 1, 2]
        assert store.get_device(s, device_id).state == DeviceState.available
        assert store.count_job_outcome(s, device_id, JobState.infra_failed, "") == 3
        device = store.get_device(s, device_id)
        assert (device.state, device.state_reason) == (
            DeviceState.quarantined, "3 jobs in a row failed for infrastructure reasons; last: no error recorded")

