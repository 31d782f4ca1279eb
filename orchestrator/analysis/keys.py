"""What a series is: the job-spec part of its key (SpecKey), its whole key for a device, a
metric and the environment a run recorded (series_key), its id (series_ident), and the headline
metrics the analysis compares. Shared by the comparisons (regressions), the series state that
keeps each series' points (series_state) and the listing the faces read (series)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator import store
from orchestrator.analysis import stats as rg
from orchestrator.store import environment as run_env
from orchestrator.store.models import Device, Run

# metric -> higher is worse. The analysis compares these; the rest are stored and charted.
HEADLINE_METRICS = {"unet_step_ms": True, "e2e_ms": True, "peak_gpu_bytes": True}


@dataclass(frozen=True)
class SpecKey:
    """The job-spec part of a series key (everything but device and metric)."""

    model: str
    resolution: str
    steps: int
    precision: str
    profile: str  # as the job asked for it ("auto" follows the build's default)

    @classmethod
    def of(cls, spec: dict[str, Any]) -> SpecKey:
        height, width = spec.get("height"), spec.get("width")
        resolution = f"{width}x{height}" if height and width else "native"
        return cls(str(spec.get("model", "")), resolution, int(spec.get("steps", 20)),
                   str(spec.get("precision", "fp16")), str(spec.get("profile", "auto")))

    def canonical(self) -> str:
        """The key as canonical JSON: how the series state stores a series' workload."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


SERIES_ID_CHARS = 16


def series_ident(key: rg.SeriesKey) -> str:
    """A series' id: a short hash of its canonical key, stable for as long as the key is."""
    return hashlib.sha256(key.canonical().encode()).hexdigest()[:SERIES_ID_CHARS]


def series_key(device: Device, spec: SpecKey, metric: str, environment: dict[str, Any] | None = None) -> rg.SeriesKey:
    """The series of `metric` for `spec` on `device` in `environment` (what a run recorded:
    run_environment()); without one, the series in any environment, labelled with what the
    device's record says (the key a per-series setting is made for)."""
    if environment is None:
        os_driver, env_key = run_env.label(store.result_environment(device)), ""
    else:
        os_driver, env_key = run_env.label(environment), run_env.environment_key(environment)
    return rg.SeriesKey(device=device.serial, os_driver=os_driver, model=spec.model, resolution=spec.resolution,
                        steps=spec.steps, precision=spec.precision, profile=spec.profile, metric=metric,
                        environment=env_key)


def run_environment(run: Run, device: Device) -> dict[str, Any]:
    """What `run` ran on: as it was recorded with it, else (a run stored before runs carried
    one) what the device's record says now."""
    return run.environment or store.result_environment(device)


def env_key_of(run: Run, device: Device) -> str:
    return run.env_key or run_env.environment_key(run_environment(run, device))
