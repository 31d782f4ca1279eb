"""What many tests share: a free port on 127.0.0.1, waiting for a condition, a raw HTTP
receiver that answers however a test says (slowly, endlessly, never), and the store's seeds
(a build of the tiny model, a latency result, a job run to its result, nightly batches of
builds, one slower). (Faults on a connection are net_support.py's; the fault tests' workers
are orchestrator/worker_farm.py's.)"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0, every_s: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy (True) or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


class RawReceiver:
    """A socket server in a thread that reads each request's head, then answers its connection
    with `answer(conn)`; `url` is http://127.0.0.1:PORT/hook, `hits` the connections taken.
    `closed` is set by close(): an answer that waits on it holds its connection open till then."""

    def __init__(self, answer: Callable[[socket.socket], object]):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        self.hits = 0
        self.closed = threading.Event()

        def serve():
            while True:
                try:
                    conn, _ = self.sock.accept()
                except OSError:
                    return
                self.hits += 1
                threading.Thread(target=self._one, args=(conn, answer), daemon=True).start()

        threading.Thread(target=serve, daemon=True).start()

    @staticmethod
    def _one(conn, answer):
        with conn:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            try:
                answer(conn)
            except OSError:
                pass

    def close(self):
        self.closed.set()
        self.sock.close()


# ---- seeds for the store --------------------------------------------------------------------


def tiny_manifest(name: str, created: float):
    """A build's manifest: the tiny model's index alone, made at `created` (seconds)."""
    from agent.protocol import Manifest, ManifestFile

    return Manifest(build=name, version="0.1.0", created=created,
                    files=[ManifestFile("models/tiny/model_index.json", "b" * 64, 20)])


def latency_result(rng, slow: float, reps: int = 10):
    """A latency JobResult: `reps` UNet steps around 100 ms x `slow`, 2 % apart."""
    from agent.protocol import JobResult, Sample

    steps = 100.0 * slow * rng.lognormal(0.0, 0.02, reps)
    return JobResult(job_id="j", kind="latency", status="succeeded",
                     samples=[Sample("unet_step_ms", float(v), "ms", r) for r, v in enumerate(steps)])


def record_job(session, kind: str, spec: dict, device_id: int, build_id: int, result, *,
               batch_id: int | None = None, artifacts_dir=None):
    """A job of `spec` that ran once and succeeded with `result`; its Run."""
    from orchestrator import store
    from orchestrator.store.models import JobState

    job = store.create_job(session, kind, spec, device_id, build_id, batch_id=batch_id)
    store.transition_job(session, job.id, JobState.running, worker="w")
    run = store.record_result(session, job.id, result, artifacts_dir=artifacts_dir)
    store.transition_job(session, job.id, JobState.succeeded)
    return run


def seed_nightlies(session, devices, spec: dict, result: Callable[[float], object],
                   slows=(1.0, 1.0, 1.3), on_build: Callable[[object, object], object] | None = None) -> dict[str, int]:
    """Builds b1, b2, ... one day apart, each a nightly batch of one latency job per device
    whose result is `result(slow)` (b3 30 % slower by default); `on_build(build, batch)` adds
    to each. {build name: batch id}."""
    from orchestrator import store

    batches = {}
    for i, slow in enumerate(slows, start=1):
        build = store.create_build(session, tiny_manifest(f"b{i}", 1_700_000_000.0 + 86400 * i))
        batch = store.create_batch(session, f"nightly b{i}", build_id=build.id)
        for device in devices:
            record_job(session, "latency", spec, device.id, build.id, result(slow), batch_id=batch.id)
        if on_build is not None:
            on_build(build, batch)
        batches[build.name] = batch.id
    return batches
