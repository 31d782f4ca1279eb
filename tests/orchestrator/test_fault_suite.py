"""The fault suite's small version (benchmarks/fault_suite.py --small): a few jobs over three
devices while workers are SIGKILLed, while Redis restarts and while PostgreSQL restarts, with
real workers, beat and jobs. Nothing may be lost and nothing recorded twice. And deploys cut mid-push over adb and
over http: nothing half-written is ever at a final path, and the resumed deploy sends exactly
what had not arrived whole, resuming a file from its last whole chunk (64 KiB here). The full-size figures are in docs/reliability.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ci_support import missing

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scenario", ["kills", "broker-restart", "db-restart", "push-cut"])
def test_no_job_lost_or_recorded_twice(scenario, tmp_path):
    restarts = scenario in ("broker-restart", "db-restart")
    if restarts and not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")):
        missing("no PostgreSQL server programs", "scripts/ensure-postgres.sh installs them")
    if restarts and shutil.which("redis-server") is None:
        missing("no redis-server", "scripts/ensure-redis.sh installs it")
    out = tmp_path / "figures.json"
    # A private PostgreSQL runs as another user: its folder must not sit under pytest's 0700 ones.
    runs = Path(tempfile.mkdtemp(prefix="fault-suite-"))
    runs.chmod(0o755)
    try:
        done = subprocess.run([sys.executable, "benchmarks/fault_suite.py", "--small", "--scenarios", scenario,
                               "--json", str(out), "--keep", str(runs)],
                              cwd=REPO, capture_output=True, text=True, timeout=900)
        logs = "\n".join(f"--- {p}\n{p.read_text()[-2500:]}" for p in sorted(runs.glob("*/*.log")))
    finally:
        shutil.rmtree(runs, ignore_errors=True)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    if scenario == "push-cut":
        assert [c["transport"] for c in result["cuts"]] == ["adb"] * 3 + ["http"] * 3, result
        for cut in result["cuts"]:
            assert cut["cut_error"] and not cut["installed_before_resume"] and cut["installed"], cut
            assert cut["partial_files_seen"] == 0, cut  # nothing half-written at a final path
            # the resumed deploy sends exactly what the device had not kept (whole files, whole
            # verified chunks), and nothing goes twice beyond the chunk the cut went through
            assert cut["kept_bytes"] + cut["resume_bytes_sent"] == cut["bytes_total"], cut
            assert cut["resent_wire_bytes"] <= result["chunk_size"] + result["start_bytes"], cut
            assert cut["cut_after_bytes"] - cut["kept_bytes"] <= result["chunk_size"] + result["start_bytes"], cut
        assert done.returncode == 0, done.stdout[-3000:]
        return
    assert result["jobs"] >= 9 and len(result["faults"]) >= (3 if scenario == "kills" else 1)
    assert result["lost"] == 0, f"{result}\n{logs}"
    assert result["recorded_twice"] == 0, result
    assert result["processes_exited"] == [], f"{result}\n{logs}"
    if scenario == "kills":
        assert any("push" in f["during"] for f in result["faults"]), result["faults"]  # one kill during a push
    assert done.returncode == 0, done.stdout[-3000:]
