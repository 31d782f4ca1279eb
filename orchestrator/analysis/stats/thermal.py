"""Thermal context of a run: a run whose cool-down timed out, or whose device ran hot enough to
throttle, did not measure the build alone, so it is flagged with its reasons and its samples are
kept out of comparisons by default (check_series(flagged_runs=...))."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

THROTTLE_CELSIUS = 85.0  # hottest zone at which mobile SoCs commonly start to throttle the GPU


@dataclass(frozen=True)
class ThermalReading:
    phase: str  # "before" or "after" the run
    zone: str
    celsius: float


@dataclass(frozen=True)
class ThermalFlag:
    flagged: bool
    reasons: tuple[str, ...]
    hottest_before: float | None
    hottest_after: float | None


def thermal_flag(
    *,
    cooldown_timed_out: bool,
    readings: Iterable[ThermalReading | tuple[str, str, float]] = (),
    throttle_celsius: float = THROTTLE_CELSIUS,
    max_start_celsius: float | None = None,
) -> ThermalFlag:
    """Whether a run is flagged, and why: its cool-down timed out; any zone reached
    `throttle_celsius` before or after the run; or, when given, the hottest zone before the
    run was above `max_start_celsius` (the job's cool-down target)."""
    before, after, reasons = [], [], []
    for r in readings:
        r = r if isinstance(r, ThermalReading) else ThermalReading(*r)
        if r.phase not in ("before", "after"):
            raise ValueError(f"thermal reading phase must be 'before' or 'after', got {r.phase!r}")
        (before if r.phase == "before" else after).append(r)
    if cooldown_timed_out:
        reasons.append("cool-down timed out")
    for phase, group in (("before", before), ("after", after)):
        hot = [r for r in group if r.celsius >= throttle_celsius]
        if hot:
            worst = max(hot, key=lambda r: r.celsius)
            reasons.append(f"{worst.zone} at {worst.celsius:.1f} C {phase} the run (throttles at {throttle_celsius:.0f} C)")
    hottest_before = max((r.celsius for r in before), default=None)
    hottest_after = max((r.celsius for r in after), default=None)
    if max_start_celsius is not None and hottest_before is not None and hottest_before > max_start_celsius:
        reasons.append(f"started at {hottest_before:.1f} C, above the cool-down target {max_start_celsius:.1f} C")
    return ThermalFlag(bool(reasons), tuple(reasons), hottest_before, hottest_after)
