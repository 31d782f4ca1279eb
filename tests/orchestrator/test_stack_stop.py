"""Stopping the embedded stack (`farm up`, `farm demo`): `farm up` ended by SIGTERM or SIGHUP (a
`kill`, a closed terminal, a CI time limit) stops every process it started, as Ctrl-C does
(their default action ended `farm up`/`farm demo` at once and left the hub, the phones and the
worker running); an idle worker given SIGTERM finishes its warm shutdown by itself. SIGTERM to its whole process group killed the prefork children at once;
one could hold the pool's queue lock, and the worker then waited on it until the SIGKILL that
follows the grace period (every `farm demo` ended with that wait)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from processes import processes_with

from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import make_celery
from orchestrator.services.stack import Stack
from orchestrator.store import upgrade

IDLE_S = 5.0


def test_stop_lets_an_idle_worker_shut_down_by_itself(tmp_path, monkeypatch):
    marker = f"STACK_STOP_MARKER={tmp_path}"
    monkeypatch.setenv("STACK_STOP_MARKER", str(tmp_path))
    settings = Settings(data_dir=tmp_path / "data", config_dir=tmp_path / "config", host_name="stophost")
    upgrade(settings.database_url)
    stack = Stack(settings)
    try:
        stack.start_worker(2)
        stack.wait_worker_ready(make_celery(settings))
        worker = stack.children[-1].process
        assert any(" notifier " in c for c in processes_with(marker)), processes_with(marker)
        time.sleep(IDLE_S)  # the pool's children wait on its queue, one of them holding its read lock
    finally:
        stack.stop()
    assert worker.returncode != -signal.SIGKILL, "the worker's warm shutdown hung until the SIGKILL after the grace"
    assert worker.returncode == 0, worker.returncode
    assert processes_with(marker) == [], "the worker's notifier outlived it"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_farm_up_stopped_by_a_signal_stops_what_it_started(tmp_path, sig):
    marker = f"STACK_STOP_MARKER={tmp_path}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {"FARM_DATA_DIR": str(tmp_path / "data"), "FARM_CONFIG_DIR": str(tmp_path / "config"),
            "FARM_HOST_NAME": "sighost", "STACK_STOP_MARKER": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "orchestrator.cli", "db", "upgrade"], env=env, check=True,
                   capture_output=True)
    up = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", "--phones", "1", "--no-host-gpu"],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in up.stdout:  # the line `farm up` prints once everything runs
            lines.append(line)
            if "farm up" in line:
                break
        else:
            pytest.fail("farm up ended before it was up:\n" + "".join(lines))
        started = processes_with(marker)
        assert any("simulate" in c for c in started) and any("worker" in c for c in started), started
        up.send_signal(sig)
        rest = up.communicate(timeout=60)[0]
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == 0, "".join(lines) + rest
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == [], "".join(lines) + rest
