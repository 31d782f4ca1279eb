"""The fault suite's small version (benchmarks/fault_suite.py --small): a few jobs over three
devices while workers are SIGKILLed, and while PostgreSQL restarts, with real workers, beat and
jobs. Nothing may be lost and nothing recorded twice; the full-size figures are in
docs/reliability.md."""

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


@pytest.mark.parametrize("scenario", ["kills", "db-restart"])
def test_no_job_lost_or_recorded_twice(scenario, tmp_path):
    if scenario != "kills" and not list(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl")):
        missing("no PostgreSQL server programs", "scripts/ensure-postgres.sh installs them")
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
    assert result["jobs"] >= 9 and len(result["faults"]) >= (3 if scenario == "kills" else 1)
    assert result["lost"] == 0, f"{result}\n{logs}"
    assert result["recorded_twice"] == 0, result
    if scenario == "kills":
        assert any("push" in f["during"] for f in result["faults"]), result["faults"]  # one kill during a push
    assert done.returncode == 0, done.stdout[-3000:]
