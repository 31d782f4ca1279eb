"""The device side installs and runs without the control plane: `pip install devicefarm` is the
engine and `farm-agent`; celery, SQLAlchemy, alembic, psycopg, redis, SciPy and the rest are the
`farm` extra (with the API's FastAPI and uvicorn). Checked on pyproject.toml, and by running a real job with every control-plane
package made unimportable (what a device-only install lacks), its job process included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from orchestrator.command import CONTROL_PLANE

REPO = Path(__file__).resolve().parents[2]
# The farm extra's distributions, by the name they are imported as.
IMPORTED_AS = {"adb-shell": "adb_shell", "sqlalchemy": "sqlalchemy", "alembic": "alembic",
               "pydantic-settings": "pydantic_settings", "psycopg": "psycopg", "celery": "celery", "redis": "redis",
               "croniter": "croniter", "scipy": "scipy", "segno": "segno", "fastapi": "fastapi", "uvicorn": "uvicorn"}


def _name(requirement: str) -> str:
    for stop in "[<>=!~; ":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower()


def test_the_package_alone_is_the_device_side():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = {_name(r) for r in project["dependencies"]}
    farm = {_name(r) for r in project["optional-dependencies"]["farm"]}
    assert base & farm == set() and not base & set(IMPORTED_AS)
    assert farm == set(IMPORTED_AS)  # every control-plane package is known to `farm`'s message...
    assert {IMPORTED_AS[d] for d in farm} | {"kombu"} == CONTROL_PLANE  # ...and blocked below
    assert project["scripts"]["farm-agent"] == "agent.cli:main"


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    """An environment where importing any control-plane package fails as if it were not installed."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {sorted(CONTROL_PLANE)!r}
        class _NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None
        sys.meta_path.insert(0, _NotInstalled())
    """))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(REPO)])}


def test_farm_without_the_control_plane_says_which_extra_brings_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "orchestrator.command", "devices", "list"], cwd=tmp_path,
                          env=_blocked_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "pip install 'devicefarm[farm]'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.gpu
def test_farm_agent_runs_a_job_without_any_control_plane_package(tiny_model_dir, tmp_path):
    env = _blocked_env(tmp_path)
    probe = subprocess.run([sys.executable, "-c", "import sqlalchemy"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'sqlalchemy'" in probe.stderr  # the blocker holds
    spec = {"job_id": "device-only", "kind": "generate", "model": str(tiny_model_dir), "precision": "fp32",
            "steps": 2, "scheduler": "euler", "height": 64, "width": 64, "time_limit_s": 300.0}
    (tmp_path / "job.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "agent.cli", "run", str(tmp_path / "job.json"), "--out",
                           str(tmp_path / "out"), "--root", str(tmp_path / "root"), "--quiet"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    assert done.returncode == 0 and result["status"] == "succeeded", (done.stdout, done.stderr, result.get("error"),
                                                                     result.get("log_tail"))
    assert any(a["kind"] == "image" for a in result["artifacts"])
