"""The heartbeat of a running job stops the job on its device once the job may no longer be its
worker's: its beats say so, its lease went to another holder, or the store stayed out of reach
until the lease could run out (tests/orchestrator/test_reliability.py does the first two end to
end, with real workers)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from orchestrator.jobs import worker


class _Store:
    """What the heartbeat's transactions meet: reachable or not, the job ours or not, the lease held or not."""

    def __init__(self):
        self.reachable, self.ours, self.held = True, True, True

    @contextlib.contextmanager
    def session_for(self, app):
        if not self.reachable:
            raise ConnectionError("the store is unreachable")
        yield _Session()


class _Session:
    @contextlib.contextmanager
    def begin(self):
        yield self


@pytest.fixture
def beat(monkeypatch):
    fake = _Store()
    monkeypatch.setattr(worker, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(worker, "LEASE_S", 0.6)
    monkeypatch.setattr(worker, "session_for", fake.session_for)
    monkeypatch.setattr(worker.store, "acquire_device_lease", lambda *a, **kw: fake.held)
    stops: list[str] = []
    stopped = threading.Event()

    def on_lost(reason: str) -> None:
        stops.append(reason)
        stopped.set()

    heartbeat = worker._Heartbeat(None, lambda session: fake.ours, 1, "holder", "job1", on_lost=on_lost)
    with heartbeat:
        yield fake, heartbeat, stops, stopped


def test_a_store_out_of_reach_stops_the_job_before_the_lease_can_run_out(beat):
    fake, heartbeat, stops, stopped = beat
    time.sleep(0.3)
    assert stops == []  # renewals land: nothing stopped
    fake.reachable = False
    cut = time.monotonic()
    assert stopped.wait(5)
    waited = time.monotonic() - cut
    assert waited < worker.LEASE_S, f"stopped {waited:.2f} s after the cut, past the {worker.LEASE_S} s lease"
    assert len(stops) == 1 and "could not renew the device's lease" in stops[0]
    time.sleep(0.3)
    assert len(stops) == 1  # once


@pytest.mark.parametrize(("what", "reason"), [("ours", "no longer this worker's"), ("held", "lost the device's lease")])
def test_a_job_no_longer_its_workers_is_stopped_once(beat, what, reason):
    fake, heartbeat, stops, stopped = beat
    setattr(fake, what, False)
    assert stopped.wait(5)
    time.sleep(0.2)
    assert len(stops) == 1 and reason in stops[0] and heartbeat.lost == stops[0]


def test_without_on_lost_a_heartbeat_only_renews(monkeypatch):
    fake = _Store()
    monkeypatch.setattr(worker, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(worker, "session_for", fake.session_for)
    monkeypatch.setattr(worker.store, "acquire_device_lease", lambda *a, **kw: False)
    with worker._Heartbeat(None, lambda session: None, 1, "holder", "deploy1") as heartbeat:
        time.sleep(0.3)
    assert heartbeat.lost is None
