"""The analysis' series as a listing: every series a succeeded latency run has contributed to,
keyed exactly as orchestrator/analysis/regressions.py keys it when it compares builds (device,
OS and driver, model, resolution, steps, precision, requested profile, metric and the
environment the runs recorded), and its points, one per build in build order. Read from the
series state (orchestrator/analysis/series_state.py), brought up to date first: a series is
found by its id, every series is one query (with its newest verdict, as the batch analysis
stored it: latest_verdict), and neither grows with the farm's history. What the
farm API's /v1/series serves; a series' `id` is a short hash of its canonical key, stable for as
long as the key is."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.analysis import stats as rg
from orchestrator.analysis.regressions import SERIES_ID_CHARS, series_ident  # noqa: F401  (the id, here too)
from orchestrator.analysis.series_state import catch_up
from orchestrator.store import Session
from orchestrator.store.models import Device


@dataclass(frozen=True)
class Series:
    id: str
    key: rg.SeriesKey
    device_id: int
    spec: regressions.SpecKey
    runs: int  # succeeded latency runs in it
    builds: int = 0  # its points
    latest: dict[str, Any] | None = None  # its newest point: build, build_id, median, n
    verdict: dict[str, Any] | None = None  # its newest verdict: latest_verdict()


# What a series' newest comparison says, as the faces name it: the analysis' "same" is "no_change".
# Settled: regression, improvement, no_change. Unsettled: inconclusive (the interval straddles
# the minimum effect), not_enough_data (one build, or nothing to compare with), not_analysed
# (its newest build's batch not analysed yet, or analysed before migration 0026).
VERDICTS = {"regression": "regression", "improvement": "improvement", "same": "no_change",
            "inconclusive": "inconclusive"}
SETTLED = ("regression", "improvement", "no_change")


def latest_verdict(stored: dict[str, Any] | None, builds: int, last_build_id: int | None) -> dict[str, Any]:
    """A series' newest verdict as the API serves it, from what the batch analysis stored in its
    row (series_state.record_verdict): verdict, settled, the builds compared, the ratio of
    medians and its interval, the reason, and whether it is about the series' newest build."""
    empty = {"verdict": "not_enough_data", "settled": False, "build": None, "baseline_build": None,
             "on_latest": False, "ratio": None, "ci_low": None, "ci_high": None, "p_value": None,
             "confidence": None, "reason": "one build: nothing to compare it with yet"}
    if stored is None:
        return empty if builds < 2 else empty | {
            "verdict": "not_analysed", "reason": "no analysis of this series' builds recorded yet"}
    verdict = VERDICTS.get(stored["verdict"], "not_enough_data")
    return {"verdict": verdict, "settled": verdict in SETTLED, "build": stored["build"],
            "baseline_build": stored["baseline_build"], "on_latest": stored["build_id"] == last_build_id,
            "ratio": stored["ratio"], "ci_low": stored["ci_low"], "ci_high": stored["ci_high"],
            "p_value": stored["p_value"], "confidence": stored.get("confidence"), "reason": stored["reason"]}


def series_id(key: rg.SeriesKey) -> str:
    return series_ident(key)


def _spec(key: rg.SeriesKey) -> regressions.SpecKey:
    return regressions.SpecKey(key.model, key.resolution, key.steps, key.precision, key.profile)


def _series(state, build_name: str | None) -> Series:
    key = rg.SeriesKey.from_dict(state.series)
    latest = None if state.last_build_id is None else {"build": build_name, "build_id": state.last_build_id,
                                                         "median": state.last_median, "n": state.last_n}
    return Series(state.id, key, state.device_id, _spec(key), state.runs, state.builds, latest,
                  latest_verdict(state.verdict, state.builds, state.last_build_id))


def list_series(session: Session, device: Device | None = None, metric: str | None = None) -> list[Series]:
    """Every headline-metric series with at least one sample (of `device`, of `metric` when
    given), by device serial and then key."""
    catch_up(session)
    rows = store.series_states(session, device.id if device is not None else None, metric,
                               metrics=None if metric is not None else list(regressions.HEADLINE_METRICS))
    return [_series(state, build_name) for state, _, build_name in rows]


def get_series(session: Session, ident: str) -> Series:
    """The series whose id is `ident`; StoreError when none is."""
    catch_up(session)
    state = store.get_series_state(session, ident)
    if state is None:
        raise store.StoreError(f"no series {ident!r}; GET /v1/series lists them")
    build = store.get_build(session, state.last_build_id) if state.last_build_id is not None else None
    return _series(state, build.name if build is not None else None)


def points(session: Session, series: Series, builds: Iterable[int] | None = None) -> list[dict[str, Any]]:
    """One point per build (of `builds`, when given), oldest first: its samples, their count,
    median, minimum, maximum. The count and statistics are the state's, kept when retention
    has thinned an old run's raw samples; `values` are the raw samples still stored."""
    builds = list(builds) if builds is not None else None
    values: dict[int, list[float]] = {}
    for build_id, value in store.series_run_values(session, series.id, series.key.metric, builds):
        values.setdefault(build_id, []).append(value)
    return [{"build": name, "build_id": p.build_id, "n": p.n, "median": p.median, "min": p.minimum,
             "max": p.maximum, "values": values.get(p.build_id, [])}
            for p, name in store.series_points(session, series.id, builds=builds)]
