"""Suite-wide test wiring: the `gpu` marker, and the order files are handed out in a parallel
run. Tests that need a WebGPU adapter run on whatever adapter exists (lavapipe on CPU
machines). Without one they are skipped locally, but in CI (CI=true) they fail: a missing
adapter there is a broken install, not a reason to pass. scripts/test.sh runs the suite on
pytest-xdist workers, a file at a time (module fixtures such as a started stack or browser are
made once); the longest files (tests/durations.json) go first, so none starts last and runs
alone at the end."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest
from ci_support import missing
from report_guard import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

GOLDEN = Path(__file__).resolve().parent / "golden" / "tiny_model.npz"
GOLDEN_3STEP = Path(__file__).resolve().parent / "golden" / "tiny_model_3step.npz"
DURATIONS = Path(__file__).resolve().parent / "durations.json"
REPO = Path(__file__).resolve().parent.parent
NEW_FILE_SECONDS = 10.0  # a file not in durations.json yet: somewhere in the middle


def pytest_report_header(config):
    """The machine's speed index (engine/speed.py) that scripts/test.sh measured first: the
    suite's times follow it."""
    path = os.environ.get("FARM_SPEED_INDEX_JSON")
    if path and Path(path).is_file():
        from engine.speed import describe

        return describe(json.loads(Path(path).read_text()))
    return None


def pytest_collection_modifyitems(config, items):
    """Under xdist, files longest first (stable within a file and among equals): every worker
    computes the same order, which the controller hands out a file at a time."""
    if not hasattr(config, "workerinput"):
        return
    seconds = json.loads(DURATIONS.read_text())["seconds_per_file"] if DURATIONS.is_file() else {}

    def cost(item) -> float:
        return seconds.get(Path(str(item.path)).relative_to(REPO).as_posix(), NEW_FILE_SECONDS)

    items.sort(key=lambda item: -cost(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With FARM_TEST_CPU=FILE: each test's CPU seconds (setup, call and teardown), its own
    process's and its reaped children's (workers, browsers, servers it started and waited for),
    appended to FILE as JSON lines: where the suite's CPU goes (docs/testing.md)."""
    path = os.environ.get("FARM_TEST_CPU")
    if not path:
        return (yield)
    before = os.times()
    try:
        return (yield)
    finally:
        after = os.times()
        row = {"test": item.nodeid, "self_s": round(after.user + after.system - before.user - before.system, 3),
               "children_s": round(after.children_user + after.children_system
                                   - before.children_user - before.children_system, 3),
               "wall_s": round(after.elapsed - before.elapsed, 3)}
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


@cache
def _adapter_problem() -> str | None:
    try:
        from engine.device import get_gpu

        get_gpu()
    except Exception as exc:  # AdapterError, or wgpu failing to load its native library
        return str(exc)
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    problem = _adapter_problem()
    if problem is None:
        return
    missing(f"no WebGPU adapter: {problem}", "CI has none")


@pytest.fixture(scope="session")
def gpu():
    from engine.device import get_gpu

    return get_gpu()


@pytest.fixture
def fresh_rng(request):
    """A generator with a fresh seed per test; the seed is printed so a failure can be replayed."""
    import numpy as np

    seed = int(os.environ.get("FARM_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"{request.node.name}: FARM_TEST_SEED={seed}")
    return np.random.default_rng(seed)



@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from engine.make_model import make_model

    """engine.make_model("tiny", seed=0): the model the goldens were made from. Read-only:
    tests that change files copy it first."""
    return make_model("tiny", 0, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def golden() -> dict:
    import numpy as np

    if not GOLDEN.is_file():
        pytest.fail(
            f"{GOLDEN} missing; run /work/venv-gold/bin/python tests/golden/make_goldens.py"
        )
    with np.load(GOLDEN) as g:
        return {k: g[k] for k in g.files}


@pytest.fixture(scope="session")
def golden3() -> dict:
    """3-step PNDM, DDIM and Euler generations of diffusers (tests/golden/make_3step_goldens.py)."""
    import numpy as np

    if not GOLDEN_3STEP.is_file():
        pytest.fail(f"{GOLDEN_3STEP} missing; run /work/venv-gold/bin/python tests/golden/make_3step_goldens.py")
    with np.load(GOLDEN_3STEP) as g:
        return {k: g[k] for k in g.files}
