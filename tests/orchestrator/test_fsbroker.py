"""The embedded broker's transport (orchestrator/infra/fsbroker.py) through kombu's public API: a
message is delivered whole and once while producers in other processes write large messages
and several consumers poll the same folder, and an undecodable file in the queue is set aside
without stopping the consumer or losing the messages behind it."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import time
from pathlib import Path

import pytest
from kombu import Connection

from orchestrator.infra import fsbroker  # noqa: F401  (registers farmfs://)

QUEUE = "fsbroker-test"


def _options(root: Path) -> dict:
    for name in ("queue", "processed", "control"):
        (root / name).mkdir(parents=True, exist_ok=True)
    return {"data_folder_in": str(root / "queue"), "data_folder_out": str(root / "queue"),
            "processed_folder": str(root / "processed"), "control_folder": str(root / "control"),
            "store_processed": False, "polling_interval": 0.01}


def _produce(root: str, producer: int, count: int) -> None:
    with Connection("farmfs://", transport_options=_options(Path(root))) as conn:
        queue = conn.SimpleQueue(QUEUE)
        for i in range(count):
            # ~1 MB bodies: a write takes long enough that a non-atomic put is seen half-done.
            queue.put({"producer": producer, "i": i, "pad": "x" * (1 << 20)})
        queue.close()


def _consume(root: str, expected: int, results) -> None:
    got = []
    with Connection("farmfs://", transport_options=_options(Path(root))) as conn:
        queue = conn.SimpleQueue(QUEUE)
        idle = 0
        while idle < 50:
            try:
                message = queue.get(timeout=0.1)
            except queue.Empty:
                idle += 1
                continue
            idle = 0
            body = message.payload
            got.append((body["producer"], body["i"], len(body["pad"])))
            message.ack()
            if len(got) >= expected:
                break
        queue.close()
    results.put(got)


def test_messages_arrive_whole_and_once_under_concurrent_producers_and_consumers(tmp_path):
    producers, per_producer, consumers = 3, 40, 3
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    readers = [ctx.Process(target=_consume, args=(str(tmp_path), producers * per_producer, results))
               for _ in range(consumers)]
    writers = [ctx.Process(target=_produce, args=(str(tmp_path), p, per_producer)) for p in range(producers)]
    for process in readers + writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    received = []
    for _ in readers:
        received += results.get(timeout=120)
    for process in readers:
        process.join(30)
        assert process.exitcode == 0  # no consumer died on a half-written file
    assert sorted((p, i) for p, i, _ in received) == [(p, i) for p in range(producers) for i in range(per_producer)]
    assert {n for _, _, n in received} == {1 << 20}
    assert not list((tmp_path / "queue").iterdir()) and not list((tmp_path / "processed").iterdir())


def test_an_undecodable_file_is_set_aside_and_the_next_message_delivered(tmp_path):
    options = _options(tmp_path)
    with Connection("farmfs://", transport_options=options) as conn:
        queue = conn.SimpleQueue(QUEUE)
        # Older than anything put below (kombu orders by the millisecond prefix of the name).
        (tmp_path / "queue" / f"0_garbage.{QUEUE}.msg").write_bytes(b"")
        queue.put({"n": 1})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 1}
        message.ack()
        queue.close()
    assert [p.name for p in (tmp_path / "processed").iterdir()] == [f"0_garbage.{QUEUE}.msg.bad"]
    assert not list((tmp_path / "queue").iterdir())


def test_a_wait_with_every_prefetch_slot_held_ends_after_one_polling_interval(tmp_path):
    """celery's worker loop for this transport acknowledges finished tasks only between waits,
    and waits with a 2 s timeout: a wait made while every prefetch slot was held by a finished,
    unacknowledged task ran its whole timeout (1 task/s per worker). Such a wait now ends after
    one polling interval; a wait with a free slot still waits for its message."""
    options = _options(tmp_path) | {"polling_interval": 0.2}
    name = f"{QUEUE}-slots"  # kombu keeps declared queues per process: a name of its own, bound here
    with Connection("farmfs://", transport_options=options) as conn:
        queue = conn.SimpleQueue(name)
        queue.consumer.qos(prefetch_count=1)
        queue.put({"n": 1})
        first = queue.get(timeout=5)  # its slot is held until it is acknowledged
        queue.put({"n": 2})
        started = time.monotonic()
        with pytest.raises(socket.timeout):
            conn.drain_events(timeout=10.0)
        waited = time.monotonic() - started
        first.ack()
        second = queue.get(timeout=5)
        assert second.payload == {"n": 2}
        second.ack()

        # With a slot free, a wait lasts until the message comes, past several polling intervals.
        def put_later():
            time.sleep(1.0)
            with Connection("farmfs://", transport_options=options) as other:
                other.SimpleQueue(name).put({"n": 3})

        producer = threading.Thread(target=put_later)
        producer.start()
        assert queue.get(timeout=5).payload == {"n": 3}
        producer.join()
        queue.close()
    assert waited < 2.0, f"a wait with a 10 s timeout, a 0.2 s polling interval and no free slot took {waited:.1f} s"


def _bind_many(root: str, worker: int, count: int, start) -> None:
    start.wait(30)
    with Connection("farmfs://", transport_options=_options(Path(root))) as conn:
        channel = conn.default_channel
        channel.exchange_declare("shared-exchange", "direct")
        for i in range(count):
            channel.queue_bind(f"q-{worker}-{i}", "shared-exchange", f"key-{worker}-{i}")


def test_queues_bound_at_once_by_many_processes_are_all_in_the_exchange_table(tmp_path):
    """Several processes declaring queues on one exchange at the same moment (workers and
    clients starting together): none fails on a table another is writing, and none loses
    another's binding."""
    workers, per_worker = 6, 15
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Event()
    processes = [ctx.Process(target=_bind_many, args=(str(tmp_path), w, per_worker, start)) for w in range(workers)]
    for process in processes:
        process.start()
    start.set()
    for process in processes:
        process.join(120)
        assert process.exitcode == 0
    with Connection("farmfs://", transport_options=_options(tmp_path)) as conn:
        table = conn.default_channel.get_table("shared-exchange")
    assert sorted(q.queue for q in table) == sorted(f"q-{w}-{i}" for w in range(workers) for i in range(per_worker))


def test_an_exchange_table_caught_mid_creation_reads_as_empty_and_takes_a_binding(tmp_path):
    """The moment between a process creating an exchange's table file and writing it: a reader
    sees no bindings and a binder adds its own, instead of failing to decode an empty file."""
    options = _options(tmp_path)
    (tmp_path / "control" / "new-exchange.exchange").write_bytes(b"")
    with Connection("farmfs://", transport_options=options) as conn:
        channel = conn.default_channel
        channel.exchange_declare("new-exchange", "direct")
        assert channel.get_table("new-exchange") == []
        channel.queue_bind("q", "new-exchange", "k")
        assert [q.queue for q in channel.get_table("new-exchange")] == ["q"]
