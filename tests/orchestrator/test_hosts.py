"""Several hosts through real network boundaries (issue 40), on one farm for the whole module
(tests/hosts): PostgreSQL, Redis, beat and the farm API in a control namespace, and two device
hosts, hA and hB, each a namespace of its own with two virtual phones on its loopback and
`farm worker --host` driving them. Jobs are latency jobs of the tiny model (a few seconds each);
the farm's reliability knobs are the fault suite's (a silent worker is lost after 6 s).

Without root or iproute2 the tests are skipped locally and fail in CI (tests/ci_support.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from ci_support import missing
from hosts import netns
from hosts.farm import BUILD, LATENCY, HostFarm, make_root, remove_root
from sqlalchemy import func, select

from orchestrator import store
from orchestrator.jobs import jobservice
from orchestrator.store.models import Device, DeviceStateChange, Job, JobState, Run, utcnow

pytestmark = pytest.mark.gpu
PHONES = {"hA": ["pa1", "pa2"], "hB": ["pb1", "pb2"]}


@pytest.fixture(scope="module")
def farm():
    problem = netns.unavailable()
    if problem is not None:
        missing(problem, "CI runs the suite as root, with iproute2")
    if shutil.which("redis-server") is None or not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")):
        missing("no redis-server or PostgreSQL server programs", "scripts/ensure-redis.sh and ensure-postgres.sh "
                "install them")
    root = make_root()
    hosts = HostFarm(root, PHONES)
    try:
        hosts.start()
        yield hosts
    finally:
        hosts.stop()
        remove_root(root)


@pytest.fixture(autouse=True)
def healthy(farm):
    """Each test starts on a farm whose workers answer and whose phones are available on their
    hosts, and leaves no process dead that it did not kill itself."""
    farm.wait_ready()
    yield
    assert farm.dead() == [], farm.logs()


# ---- helpers ----------------------------------------------------------------------------------


def suite(farm, name: str, per_device: int, devices: list[str] | str = "all") -> int:
    """A batch of `per_device` latency jobs on each device, launched as a schedule's tick does."""
    entries = [{"kind": "latency", "spec": LATENCY | {"seed": i}} for i in range(per_device)]
    return jobservice.launch_suite(farm.app, name, entries, build=BUILD, devices=devices, max_extra_rounds=0)


def jobs_of(farm, batch_id: int) -> list:
    with farm.Session() as session:
        return session.execute(select(Job.id, Job.state, Job.worker, Job.attempts, Job.worker_losses,
                                      Device.serial).join(Device, Device.id == Job.device_id)
                               .where(Job.batch_id == batch_id).order_by(Job.id)).all()


def until(farm, predicate, what: str, timeout_s: float = 120.0):
    """The first truthy value of `predicate()`, polled every 0.2 s; fails with the logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except store.DatabaseError:  # PostgreSQL is restarting: look again
            value = None
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}\n{farm.logs()}")


def settled(farm, batch_id: int, serials: set[str] | None = None, timeout_s: float = 150.0) -> list:
    """The batch's jobs (on `serials` only, when given) once every one of them has settled."""
    def done():
        rows = [r for r in jobs_of(farm, batch_id) if serials is None or r.serial in serials]
        return rows if rows and all(r.state in store.SETTLED_STATES for r in rows) else None
    return until(farm, done, f"batch {batch_id} settled", timeout_s)


def runs_per_job(farm, batch_id: int) -> dict[int, int]:
    with farm.Session() as session:
        return dict(session.execute(select(Run.job_id, func.count()).join(Job, Job.id == Run.job_id)
                                    .where(Job.batch_id == batch_id).group_by(Run.job_id)).all())


def assert_each_job_once_on_its_host(farm, batch_id: int, rows) -> None:
    """Every job succeeded, was run by the worker of its device's host, and is stored once."""
    assert [(r.id, r.state) for r in rows] == [(r.id, JobState.succeeded) for r in rows], rows
    host_of = {serial: host for host, serials in farm.placement.items() for serial in serials}
    assert {r.id: r.worker for r in rows} == {r.id: f"farm@{host_of[r.serial]}" for r in rows}
    assert runs_per_job(farm, batch_id) == {r.id: 1 for r in rows}


# ---- the scenarios ----------------------------------------------------------------------------


def test_a_schedules_batch_over_two_hosts_runs_each_job_on_its_hosts_worker(farm):
    """A schedule fires (as beat's tick does) over the phones of both hosts: each job is run by
    the worker of the host its phone is plugged into, once; the farm API in ctl says the same."""
    with farm.Session() as session, session.begin():
        schedule = store.create_schedule(session, "hosts nightly", "0 3 * * *", "UTC", {
            "build": BUILD, "devices": "all", "jobs": [{"kind": "latency", "spec": LATENCY}]})
        schedule_id = schedule.id
    batch_id = jobservice.fire_schedule(farm.app, schedule_id, utcnow())
    rows = settled(farm, batch_id)
    host_of = {serial: host for host, serials in farm.placement.items() for serial in serials}
    assert sorted(r.serial for r in rows) == sorted(host_of)
    assert_each_job_once_on_its_host(farm, batch_id, rows)
    listed = farm.api(f"/jobs?batch={batch_id}")
    assert {j["device"]: (j["state"], j["worker"], j["schedule_id"]) for j in listed} == {
        serial: ("succeeded", f"farm@{host}", schedule_id) for serial, host in host_of.items()}


def test_a_host_killed_mid_batch_gets_its_jobs_back_when_it_returns(farm):
    """hA's worker is SIGKILLed with its whole process group while it runs a job: hB's jobs all
    finish while hA is still dead; once hA's worker is back, the jobs it was running run again
    there; every job succeeds and is stored once."""
    batch_id = suite(farm, "hosts: kill", per_device=1)
    hit = until(farm, lambda: [r.id for r in jobs_of(farm, batch_id)
                               if r.state == JobState.running and r.worker == "farm@hA"], "a job running on hA")
    farm.kill_worker("hA")
    on_b = settled(farm, batch_id, set(farm.placement["hB"]))
    assert {r.state for r in on_b} == {JobState.succeeded}, on_b  # without waiting for hA
    assert not farm.processes["worker-hA"].alive()
    on_a = [r for r in jobs_of(farm, batch_id) if r.id in hit]
    assert {r.state for r in on_a} != {JobState.succeeded}, on_a  # what hA was running waits for hA

    farm.start_worker("hA")
    rows = settled(farm, batch_id)
    assert_each_job_once_on_its_host(farm, batch_id, rows)
    again = {r.id: (r.attempts, r.worker_losses) for r in rows if r.id in hit}
    assert all(attempts >= 2 and losses >= 1 for attempts, losses in again.values()), again


def test_a_host_cut_off_from_redis_and_postgresql_recovers_its_jobs_once(farm):
    """hA's link to ctl goes down while it runs a job, for longer than stale_after_s: its phones
    go offline (its host is silent), the job it was running is taken from it; healed, its phones
    come back by themselves and its jobs run again, each succeeding and stored once, the attempt
    that ran during the cut never recorded."""
    batch_id = suite(farm, "hosts: partition", per_device=1)
    hit = until(farm, lambda: [r.id for r in jobs_of(farm, batch_id)
                               if r.state == JobState.running and r.worker == "farm@hA"], "a job running on hA")
    cut_at = utcnow()
    farm.net.cut("hA")
    try:
        offline = until(farm, lambda: states(farm, farm.placement["hA"]) == {"offline"} and reasons(farm, farm.placement["hA"]),
                        "hA's phones offline", timeout_s=60)
        assert all(reason.startswith("its host hA has not been heard from") for reason in offline), offline
        until(farm, lambda: all(r.state != JobState.running for r in jobs_of(farm, batch_id) if r.id in hit),
              "hA's running job taken from it", timeout_s=60)
    finally:
        farm.net.heal("hA")
    rows = settled(farm, batch_id)
    assert_each_job_once_on_its_host(farm, batch_id, rows)
    again = {r.id: (r.attempts, r.worker_losses) for r in rows if r.id in hit}
    assert all(attempts >= 2 and losses >= 1 for attempts, losses in again.values()), again
    until(farm, lambda: states(farm, farm.placement["hA"]) == {"available"}, "hA's phones back", timeout_s=60)
    with farm.Session() as session:
        changes = session.execute(select(Device.serial, DeviceStateChange.to_state).join(
            Device, Device.id == DeviceStateChange.device_id).where(DeviceStateChange.at >= cut_at)
            .order_by(DeviceStateChange.id)).all()
    # (back by a probe, or by the next job that took it: a lease's cycle is not a recorded change)
    assert {serial for serial, to in changes if to == "offline"} == set(farm.placement["hA"]), changes


def test_postgresql_and_redis_restarted_under_load_from_both_hosts(farm):
    """PostgreSQL and Redis both stop for a few seconds while both hosts run jobs, then start
    again on their addresses: every job settles once, succeeded, on its own host's worker, and
    no worker, beat or API process exits."""
    batch_id = suite(farm, "hosts: restarts", per_device=1)
    until(farm, lambda: {r.worker for r in jobs_of(farm, batch_id) if r.state == JobState.running}
          == {"farm@hA", "farm@hB"}, "jobs running on both hosts")
    farm.postgres.stop()
    farm.redis.stop()
    time.sleep(3.0)
    farm.redis.start()
    farm.postgres.start()
    rows = settled(farm, batch_id)
    assert_each_job_once_on_its_host(farm, batch_id, rows)


def test_a_phone_moved_to_another_host_keeps_its_series(farm):
    """pa1 runs a latency job on hA, then is unplugged and plugged into hB (its worker entry
    moves: hA's worker starts again without it, hB's with it, under the same serial): it is the
    same device row, now on hB, with its earlier runs, and its next run, by hB's worker, lands
    in the series its earlier runs are in (one series per metric for it, holding every run)."""
    from orchestrator.analysis.series import list_series

    before = settled(farm, suite(farm, "hosts: before the move", per_device=1, devices=["pa1"]))
    assert [(r.state, r.worker) for r in before] == [(JobState.succeeded, "farm@hA")]
    with farm.Session() as session:
        device_id = store.get_device(session, "pa1").id
    farm.move_phone("pa1", "hB")
    after = settled(farm, suite(farm, "hosts: after the move", per_device=1, devices=["pa1"]))
    assert [(r.state, r.worker) for r in after] == [(JobState.succeeded, "farm@hB")]
    with farm.Session() as session:
        device = store.get_device(session, "pa1")
        assert (device.id, device.host.name) == (device_id, "hB")
        runs = session.scalars(select(Run.job_id).where(Run.device_id == device_id)).all()
        assert {before[0].id, after[0].id} <= set(runs)
        series = list_series(session, device)
    by_metric = {}
    for one in series:
        by_metric.setdefault(one.key.metric, []).append(one.runs)
    assert by_metric and all(counts == [len(runs)] for counts in by_metric.values()), (by_metric, len(runs))

def states(farm, serials: list[str]) -> set[str]:
    with farm.Session() as session:
        return {str(d.state) for d in store.devices_named(session, serials)}


def reasons(farm, serials: list[str]) -> list[str]:
    with farm.Session() as session:
        return [d.state_reason for d in store.devices_named(session, serials)]
