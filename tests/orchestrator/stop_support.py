"""A job process running on a device root, as `farm-agent run` leaves it (the device lock names
the job and its process group), for the tests of stopping a running job on each transport."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def running_job(root: Path, job_id: str):
    """A sleeping process group recorded in <root>/locks/device.lock as job `job_id`'s child;
    yields the process. Removed afterwards, whatever happened."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    lock = Path(root) / "locks" / "device.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"job_id": job_id, "kind": "generate", "pid": os.getpid(), "host": os.uname().nodename,
                                "started_at": time.time(), "time_limit_s": 600.0, "child_pid": proc.pid}))
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()
        lock.unlink(missing_ok=True)


def killed_within(proc: subprocess.Popen, seconds: float = 10.0) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode is not None and proc.returncode < 0


def check_stop_job(transport, root: Path) -> None:
    """Transport.stop_job against a job running on `root`: another job's id leaves it alone,
    its own id kills it and records the reason, and once it ended there is nothing to stop."""
    with running_job(root, "job7-a1") as proc:
        assert not transport.stop_job("job8-a1", "cancelled")
        assert proc.poll() is None
        assert transport.stop_job("job7-a1", "cancelled by operator")
        assert killed_within(proc)
        assert (root / "locks" / "stop-job7-a1").read_text() == "cancelled by operator"
    assert not transport.stop_job("job7-a1", "again")
