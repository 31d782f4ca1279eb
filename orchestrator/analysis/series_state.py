"""The series state, kept up to date: each new series run (a succeeded latency run that is no
check's) becomes, for each headline metric it measured, a row of its series (made when new:
orchestrator/store/series_models.py) with what the drift estimate needs of it (the run's median,
its log median and that median's variance: stats.run_spread) and whether it is thermally
flagged; and the point of its build in that series is recomputed from the build's samples.
Then the nightly analysis, the change-point scan, the dashboard and the API read a series'
recent points and runs instead of its whole history, and find a series by its id.

catch_up() brings the state up to the runs table: what the analysis of a batch calls first,
and every read of series before it reads. Cheap when there is nothing new (one indexed query
over the newest LAG run ids); the first call after migration 0024 reads the whole history once,
CHUNK runs a transaction step. Runs are read in id order; a run committed late with a lower id
than ones already read (two workers recording at once) is still found: the scan looks LAG ids
back, and the state records every run it holds. Two catch-ups at once are serialised by the
progress row's lock, taken only when there is something to write.

record_verdict() keeps each series' newest comparison (its verdict, ratio and interval against
its baseline) in its row, as the batch analysis makes it: the faces read it, never compare."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from orchestrator import store
from orchestrator.analysis import keys
from orchestrator.analysis import stats as rg
from orchestrator.store import Session
from orchestrator.store import environment as run_env
from orchestrator.store.models import Build, utcnow

LAG = 1000  # run ids looked back past the progress mark, for runs committed out of id order
CHUNK = 5000  # runs read per step of a catch-up


def catch_up(session: Session, *, thorough: bool = False) -> int:
    """Bring the series state up to every series run stored; returns the runs added (flushes
    only; the caller commits). Unless `thorough`, nothing is looked at when no run is newer
    than the progress mark (two indexed lookups: what every read of the state pays); a
    thorough catch-up (a batch's analysis) also looks LAG ids back for runs committed late."""
    newest, done = store.newest_run_id(session), store.series_progress(session)
    if not thorough and newest <= done:
        return 0
    added = 0
    while True:
        pending = store.pending_series_runs(session, max(0, done - LAG), CHUNK)
        rows = _run_rows(session, pending) if pending else []
        full = len(pending) == CHUNK
        # Read up to here: the newest pending run when there are more, else every run so far
        # (the rest are no series' runs).
        mark = pending[-1].id if full else max(newest, max((r.id for r in pending), default=0))
        if rows or mark > done:
            store.lock_series_progress(session)  # from here on, one catch-up at a time
            held = store.runs_in_series_state(session, [r.id for r in pending])
            rows = [row for row in rows if row["run_id"] not in held]
            _apply(session, rows)
            store.set_series_progress(session, mark)
            added += len({row["run_id"] for row in rows})
        if not full:
            return added
        done = mark


def record_verdict(session: Session, result: dict[str, Any], candidate: Build, baseline: Build) -> None:
    """Keep a batch analysis' comparison (compare_builds' dict) as its series' newest verdict,
    which the overview and the series pages read as it is: "inconclusive" and "same" as much
    as the alerts' regression and improvement. An older build's comparison (a batch analysed
    again later) leaves a newer build's verdict in place."""
    state = store.get_series_state(session, keys.series_ident(rg.SeriesKey.from_dict(result["series"])))
    if state is None:  # no samples of the candidate in it: nothing to show the verdict on
        return
    verdict = store.verdict_of(result, (candidate.id, candidate.name, candidate.created), (baseline.id, baseline.name))
    if store.newer_verdict(state.verdict, verdict):
        state.verdict = verdict | {"at": utcnow().isoformat()}
        session.flush()


def _run_rows(session: Session, pending: list) -> list[dict[str, Any]]:
    """A series_runs row (with its series' key and values) per pending run and headline metric
    it measured."""
    run_ids = [r.id for r in pending]
    values: dict[tuple[int, str], list[float]] = defaultdict(list)
    for run_id, metric, _, value in store.samples_of_runs(session, run_ids, keys.HEADLINE_METRICS):
        values[(run_id, metric)].append(value)
    readings = defaultdict(list)
    for t in store.thermal_readings_of(session, run_ids):
        readings[t.run_id].append(rg.ThermalReading(t.phase, t.zone, t.celsius))
    devices: dict[int, Any] = {}
    rows = []
    for run in pending:
        if run.device_id not in devices:
            devices[run.device_id] = store.get_device(session, run.device_id)
        device = devices[run.device_id]
        spec = keys.SpecKey.of(run.spec or {})
        environment = run.environment or store.result_environment(device)
        flagged = rg.thermal_flag(cooldown_timed_out=run.cooldown_timed_out, readings=readings[run.id]).flagged
        for metric in keys.HEADLINE_METRICS:
            found = values.get((run.id, metric))
            if not found:
                continue
            key = keys.series_key(device, spec, metric, environment)
            try:
                spread = rg.run_spread(found)
            except ValueError:  # a negative sample: no drift from this run (the comparison refuses it)
                spread = None
            rows.append({"key": key, "device_id": device.id, "workload": spec.canonical(),
                         "env_key": run.env_key or run_env.environment_key(environment), "values": found,
                         "series_id": keys.series_ident(key), "run_id": run.id, "build_id": run.build_id,
                         "build_created": run.created, "n": len(found), "median": float(np.median(found)),
                         "log_median": spread[0] if spread else None, "within": spread[1] if spread else None,
                         "flagged": flagged})
    return rows


def _apply(session: Session, rows: list[dict[str, Any]]) -> None:
    """Add the rows, recompute the points of the (series, build) pairs they touch, and update
    each touched series' counts and newest point."""
    if not rows:
        return
    series = {}
    for row in rows:
        if row["series_id"] not in series:
            key = row["key"]
            series[row["series_id"]] = store.upsert_series_state(
                session, row["series_id"], key=key.canonical(), series=key.as_dict(), device_id=row["device_id"],
                metric=key.metric, workload=row["workload"], env_key=row["env_key"])
    columns = ("series_id", "run_id", "build_id", "build_created", "n", "median", "log_median", "within", "flagged")
    store.save_series_runs(session, [{c: row[c] for c in columns} for row in rows])
    fresh: dict[tuple[str, int], list[float]] = defaultdict(list)
    created = {}
    for row in rows:
        fresh[(row["series_id"], row["build_id"])].extend(row["values"])
        created[row["build_id"]] = row["build_created"]
    pairs = list(fresh)
    # A build measured again (a more-repetitions round reruns the baseline): its point is
    # recomputed from all its runs' samples; a new build's point from what came now.
    existing = set(store.series_points_at(session, pairs))
    values = dict(fresh)
    if existing:
        values.update(store.point_values(session, sorted(existing), {s: series[s].metric for s, _ in existing}))
        store.delete_series_points(session, sorted(existing))
    store.save_series_points(session, [
        {"series_id": s, "build_id": b, "build_created": created[b], "n": len(v), "median": float(np.median(v)),
         "minimum": float(min(v)), "maximum": float(max(v))} for (s, b), v in values.items()])
    runs_added: dict[str, int] = defaultdict(int)
    for row in rows:
        runs_added[row["series_id"]] += 1
    now = utcnow()
    for (s, b), v in values.items():
        state = series[s]
        if (s, b) not in existing:
            state.builds += 1
        if state.last_build_created is None or (created[b], b) >= (state.last_build_created, state.last_build_id or 0):
            state.last_build_id, state.last_build_created = b, created[b]
            state.last_median, state.last_n = float(np.median(v)), len(v)
    for s, n in runs_added.items():
        series[s].runs += n
        series[s].updated_at = now
    session.flush()
