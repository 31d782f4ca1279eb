"""What the test suite does when something it needs is missing: skip on a developer's machine,
fail under CI=true, where a missing server, browser or package is a broken install."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(message: str, ci_hint: str = "CI needs it") -> None:
    """Skip the test with `message`, or fail it (with `ci_hint`) under CI."""
    if in_ci():
        pytest.fail(f"{message} ({ci_hint})", pytrace=False)
    pytest.skip(message)


# Why CI must have shader-f16: scripts/bootstrap.sh installs Mesa's lavapipe (which has it) when
# the only adapter is wgpu's OpenGL fallback (which has not).
F16_HINT = "CI runs on lavapipe, which has shader-f16: scripts/bootstrap.sh installs mesa-vulkan-drivers"
