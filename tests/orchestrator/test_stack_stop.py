"""Stopping the embedded stack (`farm up`, `farm demo`): an idle worker given SIGTERM finishes its
warm shutdown by itself. SIGTERM to its whole process group killed the prefork children at once;
one could hold the pool's queue lock, and the worker then waited on it until the SIGKILL that
follows the grace period (every `farm demo` ended with that wait)."""

from __future__ import annotations

import signal
import time

from orchestrator.celery_app import make_celery
from orchestrator.db import upgrade
from orchestrator.settings import Settings
from orchestrator.stack import Stack

IDLE_S = 5.0


def test_stop_lets_an_idle_worker_shut_down_by_itself(tmp_path):
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="stophost")
    upgrade(settings.database_url)
    stack = Stack(settings)
    try:
        stack.start_worker(2)
        stack.wait_worker_ready(make_celery(settings))
        worker = stack.children[-1].process
        time.sleep(IDLE_S)  # the pool's children wait on its queue, one of them holding its read lock
    finally:
        stack.stop()
    assert worker.returncode != -signal.SIGKILL, "the worker's warm shutdown hung until the SIGKILL after the grace"
    assert worker.returncode == 0, worker.returncode
