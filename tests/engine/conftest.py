"""Fixtures for the model-file tests: the tiny synthetic model (made once per session) and
the diffusers goldens made from it by tests/golden/make_goldens.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.make_model import make_model

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_model.npz"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """engine.make_model("tiny", seed=0): the model the goldens were made from. Read-only:
    tests that change files copy it first."""
    return make_model("tiny", 0, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def golden() -> dict[str, np.ndarray]:
    if not GOLDEN.is_file():
        pytest.fail(
            f"{GOLDEN} missing; run /work/venv-gold/bin/python tests/golden/make_goldens.py"
        )
    with np.load(GOLDEN) as g:
        return {k: g[k] for k in g.files}
