"""What a series is: the key every stored sample is grouped by (one physical device, the
environment its run recorded, the workload, the engine profile and one metric) with its
canonical string, and the check that turns raw samples into one series' values, refusing
mixed keys or units instead of averaging them."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from dataclasses import MISSING, asdict, dataclass, fields, replace


@dataclass(frozen=True)
class SeriesKey:
    """One series. `metric` carries its unit in its name (unet_step_ms, peak_gpu_bytes,
    kernel:<name>_ms); `resolution` is "WIDTHxHEIGHT"; `os_driver` is the OS version and GPU
    driver and `environment` the key of the whole environment the runs recorded (OS build,
    kernel, driver, adapter, WebGPU runtime: orchestrator/store/environment.py), both from the
    caller, since a phone update or a driver update is a different series. An empty
    `environment` is the series in any environment (what a per-series setting is made for),
    and is left out of canonical(), as keys were written before runs carried one."""

    device: str
    os_driver: str
    model: str
    resolution: str
    steps: int
    precision: str
    profile: str
    metric: str
    environment: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "steps":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"SeriesKey.steps must be a non-negative int, got {value!r}")
            elif not isinstance(value, str):
                raise ValueError(f"SeriesKey.{f.name} must be a str, got {value!r}")
        if not self.device or not self.metric:
            raise ValueError(f"SeriesKey needs a device and a metric, got {self!r}")

    def canonical(self) -> str:
        """The key as canonical JSON (sorted keys, no spaces): SeriesSetting.series_key."""
        data = asdict(self)
        if not self.environment:
            del data["environment"]
        return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def in_any_environment(self) -> SeriesKey:
        """The same series with its environment (os_driver and environment) left open."""
        return replace(self, os_driver="", environment="")

    def as_dict(self) -> dict[str, str | int]:
        """The key as a plain dict (Alert.series)."""
        return asdict(self)

    @classmethod
    def parse(cls, text: str) -> SeriesKey:
        """The inverse of canonical(); also accepts the same JSON with other spacing or order."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a series key (invalid JSON): {text!r}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"not a series key (a JSON object is needed): {text!r}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> SeriesKey:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, extra = required - data.keys(), data.keys() - names
        if missing or extra:
            raise ValueError(
                f"not a series key: missing {sorted(missing)}, unknown {sorted(extra)} in {data!r}"
            )
        return cls(**data)


@dataclass(frozen=True)
class SeriesSample:
    """One stored sample as the analysis sees it (a Sample row plus its run's series key)."""

    key: SeriesKey
    unit: str
    value: float
    run_id: int | None = None


@dataclass(frozen=True)
class CheckedSeries:
    key: SeriesKey
    unit: str
    values: tuple[float, ...]
    excluded_runs: tuple[int, ...]  # flagged runs whose samples were left out
    run_ids: tuple[int | None, ...] = ()  # the run of each value, for compare()'s run labels


def check_series(
    samples: Iterable[SeriesSample],
    *,
    flagged_runs: Collection[int] = (),
    include_flagged: bool = False,
) -> CheckedSeries:
    """The values of one series, after checking that every sample has the same key and unit
    and a finite value. Samples of `flagged_runs` (see thermal.py) are left out unless
    `include_flagged`. Raises ValueError naming the conflicting keys or units."""
    samples = list(samples)
    if not samples:
        raise ValueError("no samples: a series needs at least one")
    keys = {s.key for s in samples}
    if len(keys) > 1:
        shown = sorted(k.canonical() for k in keys)
        raise ValueError(f"samples from {len(keys)} different series, refusing to pool them: {shown}")
    units = {s.unit for s in samples}
    if len(units) > 1:
        raise ValueError(
            f"series {samples[0].key.canonical()} mixes units {sorted(units)}; "
            "store one unit per metric (the metric name carries it)"
        )
    bad = [s.value for s in samples if not math.isfinite(s.value)]
    if bad:
        raise ValueError(f"series {samples[0].key.canonical()} has non-finite values {bad[:5]}")
    flagged = set(flagged_runs) if not include_flagged else set()
    kept = [s for s in samples if s.run_id is None or s.run_id not in flagged]
    excluded = tuple(sorted({s.run_id for s in samples if s.run_id is not None and s.run_id in flagged}))
    return CheckedSeries(key=samples[0].key, unit=samples[0].unit, values=tuple(float(s.value) for s in kept),
                         excluded_runs=excluded, run_ids=tuple(s.run_id for s in kept))
