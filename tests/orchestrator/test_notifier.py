"""Notifications have a process and a queue of their own: `farm worker` starts `farm notifier`
beside it, and a receiver that holds every attempt open (accepts, never answers) holds the
notifier's threads, never a slot of the worker that runs jobs. The notifier stops with the
worker, and dies with it when the worker is SIGKILLed."""

from __future__ import annotations

import os
import signal
import time

from processes import processes_with
from support import RawReceiver

from orchestrator.infra.settings import Settings
from orchestrator.jobs import notify
from orchestrator.jobs.celery_app import DEFAULT_QUEUE, host_queue, make_celery
from orchestrator.services.stack import Stack
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store import notifications as store
from orchestrator.store.models import Delivery

HOST = "notehost"
TIMEOUT_S = 40.0  # an attempt may take this long: far past what the job's ping waits


def _ping(app, queue: str) -> float:
    started = time.monotonic()
    app.signature("orchestrator.tasks.ping", args=(1.0,)).apply_async(queue=queue).get(timeout=15)
    return time.monotonic() - started


def test_a_receiver_that_never_answers_holds_no_job_slot_and_the_notifier_goes_with_its_worker(
        tmp_path, monkeypatch):
    marker = f"NOTIFIER_MARKER={tmp_path}"
    monkeypatch.setenv("NOTIFIER_MARKER", str(tmp_path))
    monkeypatch.setenv("FARM_NOTIFY_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setenv("FARM_NOTIFY_PRIVATE_TARGETS", "true")  # the receiver is on 127.0.0.1
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name=HOST,
                        notify_timeout_s=TIMEOUT_S, notify_private_targets=True)
    upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    Session = make_session_factory(engine)  # noqa: N806
    receiver = RawReceiver(lambda conn: receiver.closed.wait())  # accepts, reads the request, never answers
    with Session() as s, s.begin():
        store.add_subscription(s, "webhook", receiver.url, secret="k")
        ids = [i for n in range(3) for i in store.record_event(s, {**notify.sample_event(), "key": f"stuck:{n}"})]
    assert len(ids) == 3
    app = make_celery(settings)
    notify.publish_deliveries(app, ids)

    stack = Stack(settings)
    try:
        stack.start_worker(1)  # one job slot: a delivery in it would hold it for TIMEOUT_S
        worker = stack.children[-1].process
        deadline = time.monotonic() + 60
        while receiver.hits < 3 and time.monotonic() < deadline:
            stack.check_alive()
            time.sleep(0.1)
        assert receiver.hits == 3, f"the notifier took {receiver.hits} of 3 deliveries\n{stack.children[-1].tail()}"
        # All three attempts are open and stuck; the worker's one slot is free for jobs on both its queues.
        for queue in (host_queue(HOST), DEFAULT_QUEUE):
            assert _ping(app, queue) < 5.0, queue
        notifiers = [c for c in processes_with(marker) if " notifier " in c]
        assert len(notifiers) == 1, processes_with(marker)

        receiver.close()  # the attempts end refused; each is recorded with its error
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with Session() as s:
                rows = s.query(Delivery).filter(Delivery.id.in_(ids)).all()
                if all(r.last_error for r in rows):
                    break
            time.sleep(0.2)
        assert all(r.attempts == 1 and r.last_error for r in rows), [(r.attempts, r.last_error) for r in rows]

        os.kill(worker.pid, signal.SIGKILL)  # the worker alone, not its group: the notifier must follow
        worker.wait()
        deadline = time.monotonic() + 20
        while any(" notifier " in c for c in processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(" notifier " in c for c in processes_with(marker)), processes_with(marker)
    finally:
        receiver.close()
        stack.stop()
        engine.dispose()

