"""What the fault tests share: `farm worker` processes started in their own process group
(so a SIGKILL takes the worker, its pool and the agents it started at once), their logs, and
waiting on the store. A farm here is the dict a test module's `farm` fixture yields, with at
least "Session" and "tmp"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.infra.settings import Settings
from orchestrator.services.stack import settings_env

REPO = Path(__file__).resolve().parents[2]


def kill_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


class Workers:
    """`farm worker --concurrency 2` processes for `settings` (no notifier: these tests send no notification), each logging to <tmp>/<name>.log."""

    def __init__(self, tmp: Path, settings: Settings):
        self.tmp, self.settings, self.processes = tmp, settings, []

    def start(self, name: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")  # noqa: SIM115  (the child holds it)
        worker = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "worker", "--concurrency", "2",
                                   "--notify-concurrency", "0"],
                                  env=settings_env(self.settings), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  start_new_session=True)
        log.close()
        self.processes.append(worker)
        return worker

    def stop(self) -> None:
        """SIGTERM each worker itself, as orchestrator.services.stack stops one (not its group: prefork
        children killed at once can leave the pool's queue lock held and the warm shutdown
        waiting on it), then SIGKILL each group."""
        for worker in self.processes:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in self.processes:
            try:
                worker.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            kill_group(worker, signal.SIGKILL)
            worker.wait()


def logs(farm) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(farm["tmp"].glob("*.log")))


def wait(farm, predicate, what: str, timeout_s: float = 90.0):
    """The first truthy value of `predicate(session)`, polled every 0.1 s; fails with the logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with farm["Session"]() as session:
            value = predicate(session)
            if value:
                return value
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}\n{logs(farm)}")
