"""The store at scale: a year of nightly runs for a farm of 200 devices, each timing two
profiles every night on the three headline metrics, loaded into a freshly migrated store on
SQLite and PostgreSQL; measured as it grows: one nightly batch's analysis (what the
analyze_batch task runs: orchestrator/jobs/batch_analysis.py analyze_in_store) after 1 month, 6
months and 1 year of history, which must stay flat (within 1.5x from 1 month to 1 year); then
the dashboard's and the API's main reads (p50 and p95 of repeated calls, each in a fresh
session, as a request gets one) and the store's size.

    python benchmarks/store_scale.py --json docs/benchmarks/<date>-store-scale.json
    python benchmarks/store_scale.py --backends sqlite --devices 20 --at 30,90    # minutes, not an hour

PostgreSQL comes from --postgres-url or $FARM_TEST_POSTGRES_URL (scripts/ensure-postgres.sh
prints one); the benchmark creates its own database there and drops it afterwards.

The history: night n makes build n (one a day) and its nightly batch: on every device two
latency jobs (profiles "auto" and "tuned"), each one run of 10 UNet-step samples, 3
end-to-end generations and one peak-memory reading, 6 kernel timings and 2 thermal readings,
in the environment the device reports (a quarter of the devices get a driver update on night
200: a new environment, a new series). Levels: a per-device level, 1% noise per sample and
0.5% drift per night; every 10th device regresses 8% on builds of nights 100-109 (its
regression alerts are stored, fixed); every 20th improves 10% for good from night 150 (a
change point). The nights before a measured one are loaded in bulk (executemany on SQLite, COPY
on PostgreSQL, which is ANALYZEd as autovacuum would), and the analysis' series state is
brought up to date for them as the nightly analyses would have left it; the measured night's
batch is then analysed as the task does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from sqlalchemy import Engine, create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from orchestrator import store  # noqa: E402
from orchestrator.analysis import series as farm_series  # noqa: E402
from orchestrator.analysis import series_state  # noqa: E402
from orchestrator.analysis.stats import SeriesKey  # noqa: E402
from orchestrator.dashboard import views  # noqa: E402
from orchestrator.jobs.batch_analysis import analyze_in_store  # noqa: E402
from orchestrator.store import environment as run_env  # noqa: E402
from orchestrator.store import make_engine, make_session_factory, queries, upgrade  # noqa: E402
from orchestrator.store.models import (  # noqa: E402
    Alert,
    AlertKind,
    AlertState,
    Batch,
    Build,
    Device,
    Host,
    Job,
    KernelTiming,
    Run,
    Sample,
    ThermalReading,
)

FLAT_WITHIN = 1.5  # one batch's analysis at a year of history / at a month
PROFILES = ("auto", "tuned")
METRICS = (("unet_step_ms", "ms", 10), ("e2e_ms", "ms", 3), ("peak_gpu_bytes", "bytes", 1))
SAMPLES_PER_RUN = sum(n for _, _, n in METRICS)
KERNELS = ("conv2d", "linear", "attention/flash", "group_norm", "geglu", "upsample")
HOSTS = 10
T0 = dt.datetime(2025, 1, 1, 2, tzinfo=dt.UTC)
SPEC = {"model": "models/sd14", "height": 512, "width": 512, "steps": 20, "precision": "fp16", "repetitions": 3}
DRIVER_UPDATE_NIGHT = 200
REGRESSION_NIGHTS = range(100, 110)
STEP_NIGHT = 150


# ---- the generated history --------------------------------------------------------------------


class Farm:
    """Who runs what, and the ids of every row (deterministic: a night's rows never need a
    lookup)."""

    def __init__(self, devices: int):
        self.devices = devices
        self.runs_per_night = devices * len(PROFILES)

    def run_id(self, night: int, device: int, profile: int) -> int:
        return (night - 1) * self.runs_per_night + (device - 1) * len(PROFILES) + profile + 1

    def environment(self, device: int, night: int) -> dict:
        updated = device % 4 == 0 and night >= DRIVER_UPDATE_NIGHT
        return {"os": "android", "os_version": "14", "os_build": "UP1A.231005.007", "kernel": "5.15.123",
                "driver": f"V@0{615 + device % 3}.{'77' if updated else '65'}",
                "runtime": {"name": "Chrome", "version": "131.0.6778.39"},
                "adapter": {"vendor": "qualcomm", "architecture": "adreno-7xx", "device": f"Adreno (TM) 7{device % 5}0",
                            "backend": "vulkan"}}

    def level(self, device: int, profile: int, night: int) -> float:
        base = (120.0 + device % 40 * 6.0) * (0.9 if profile else 1.0) * (1 + 0.005 * ((night * 7919) % 5 - 2))
        if device % 10 == 3 and night in REGRESSION_NIGHTS:
            base *= 1.08
        if device % 20 == 5 and night >= STEP_NIGHT:
            base *= 0.9
        return base


def build_created(night: int) -> dt.datetime:
    return T0 + dt.timedelta(days=night)


def series_dict(farm: Farm, device: int, profile: int, night: int, metric: str) -> dict:
    env = farm.environment(device, night)
    return SeriesKey(device=f"dev-{device:04d}", os_driver=run_env.label(env), model=SPEC["model"],
                     resolution="512x512", steps=SPEC["steps"], precision=SPEC["precision"],
                     profile=PROFILES[profile], metric=metric, environment=run_env.environment_key(env)).as_dict()


def rows(farm: Farm, nights: range, first: bool) -> dict[str, Callable[[], Iterator[dict]]]:
    """Per table, a generator of the rows of `nights` (with the fleet when `first`)."""

    def hosts():
        if first:
            for h in range(1, HOSTS + 1):
                yield {"id": h, "name": f"host-{h:02d}", "last_seen": T0, "created_at": T0}

    def devices():
        if first:
            for d in range(1, farm.devices + 1):
                yield {"id": d, "serial": f"dev-{d:04d}", "host_id": (d - 1) % HOSTS + 1, "transport": "adb",
                       "address": f"10.0.{d // 250}.{d % 250}:5555", "engine_host": "browser",
                       "model": f"SM-S9{d % 30:02d}B", "manufacturer": "samsung", "os": "android", "os_version": "14",
                       "gpu_vendor": "qualcomm", "gpu_architecture": "adreno-7xx", "gpu_device": f"Adreno (TM) 7{d % 5}0",
                       "gpu_driver": "", "gpu_backend": "vulkan", "virtual": False, "adapter_group": None,
                       "info": None, "state": "available", "state_reason": "", "last_seen": T0,
                       "infra_failures_in_row": 0, "probe_failures": 0, "next_probe_at": None, "lease_holder": None,
                       "lease_until": None, "lease_timed": False, "created_at": T0}

    def builds():
        for n in nights:
            yield {"id": n, "name": f"nightly-{n:04d}", "version": f"1.{n // 100}.{n % 100}",
                   "source_revision": f"{n:012x}", "manifest_sha256": f"{n:064x}", "created": build_created(n)}

    def batches():
        for n in nights:
            yield {"id": n, "name": f"nightly {n}", "schedule_id": None, "build_id": n, "idempotency_key": None,
                   "max_extra_rounds": 0, "round_metrics": None, "purpose": "nightly",
                   "created_at": build_created(n), "finished_at": build_created(n) + dt.timedelta(hours=3),
                   "summary": None}

    def each_run() -> Iterator[tuple[int, int, int, int, dt.datetime]]:
        for n in nights:
            for d in range(1, farm.devices + 1):
                for p in range(len(PROFILES)):
                    run_id = farm.run_id(n, d, p)
                    yield run_id, n, d, p, build_created(n) + dt.timedelta(seconds=30 * (d * 2 + p))

    def jobs():
        for run_id, n, d, p, start in each_run():
            yield {"id": run_id, "kind": "latency", "spec": SPEC | {"profile": PROFILES[p], "job_id": f"job{run_id}"},
                   "device_id": d, "build_id": n, "schedule_id": None, "batch_id": n, "deployment_id": None,
                   "after_job_id": None, "state": "succeeded", "attempts": 1, "worker_losses": 0,
                   "progress": None, "dispatch_seq": 0, "queued_at": start, "due_at": None, "idempotency_key": None,
                   "worker": f"farm@host-{(d - 1) % HOSTS + 1:02d}", "created_at": start, "started_at": start,
                   "heartbeat_at": start, "finished_at": start + dt.timedelta(seconds=25), "log_tail": "",
                   "error": None}

    def runs():
        engine = {"profile": "adreno", "precision": "fp16", "height": 512, "width": 512}
        for run_id, n, d, _, start in each_run():
            env = farm.environment(d, n)
            yield {"id": run_id, "job_id": run_id, "attempt": 1, "device_id": d, "build_id": n,
                   "status": "succeeded", "error": None, "started_at": start,
                   "finished_at": start + dt.timedelta(seconds=25), "adapter": "Adreno (TM) 740", "engine": engine,
                   "cooldown_wait_s": 12.0, "cooldown_timed_out": False, "artifacts": [], "log_tail": "",
                   "environment": env, "env_key": run_env.environment_key(env), "downsampled_at": None,
                   "retained": None, "logs_deleted_at": None}

    def samples():
        for run_id, n, d, p, _ in each_run():
            rng = np.random.default_rng(run_id)
            level = farm.level(d, p, n)
            noise = 1 + 0.01 * rng.standard_normal(SAMPLES_PER_RUN)
            k = 0
            for metric, unit, reps in METRICS:
                for r in range(reps):
                    value = 2.1e9 * (1 + 0.001 * p) if unit == "bytes" else level * (20 if metric == "e2e_ms" else 1)
                    yield {"id": run_id * SAMPLES_PER_RUN + k, "run_id": run_id, "metric": metric, "unit": unit,
                           "value": float(value if unit == "bytes" else value * noise[k]), "repetition": r}
                    k += 1

    def kernel_timings():
        for run_id, n, d, p, _ in each_run():
            level = farm.level(d, p, n)
            for k, kernel in enumerate(KERNELS):
                yield {"id": run_id * len(KERNELS) + k, "run_id": run_id, "kernel": kernel, "calls": 10 + k,
                       "total_ms": level / (k + 2), "repetition": 0}

    def thermal_readings():
        for run_id, *_ in each_run():
            for k, (phase, celsius) in enumerate((("before", 34.0), ("after", 41.5))):
                yield {"id": run_id * 2 + k, "run_id": run_id, "phase": phase, "zone": "gpu", "celsius": celsius}

    def alerts():
        for n in nights:
            if n not in REGRESSION_NIGHTS:
                continue
            for d in range(3, farm.devices + 1, 10):
                for p in range(len(PROFILES)):
                    for metric in ("unet_step_ms", "e2e_ms"):
                        at = build_created(n) + dt.timedelta(hours=4)
                        yield {"id": (n * farm.devices + d) * 4 + p * 2 + (metric == "e2e_ms"), "kind": "regression",
                               "state": "fixed", "device_id": d, "build_id": n, "baseline_build_id": n - 1,
                               "batch_id": n, "metric": metric, "series": series_dict(farm, d, p, n, metric),
                               "ratio": 1.08, "ci_low": 1.06, "ci_high": 1.10, "p_value": 1e-4,
                               "summary": f"{metric} +8.0% on dev-{d:04d}", "detail": {}, "note": "fixed",
                               "created_at": at, "updated_at": at}

    return {"hosts": hosts, "devices": devices, "builds": builds, "batches": batches, "jobs": jobs, "runs": runs,
            "samples": samples, "kernel_timings": kernel_timings, "thermal_readings": thermal_readings,
            "alerts": alerts}


TABLES = {"hosts": Host, "devices": Device, "builds": Build, "batches": Batch, "jobs": Job, "runs": Run,
          "samples": Sample, "kernel_timings": KernelTiming, "thermal_readings": ThermalReading, "alerts": Alert}


def _chunks(it: Iterator[dict], n: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for row in it:
        chunk.append(row)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def fill(engine: Engine, farm: Farm, nights: range, first: bool) -> dict[str, int]:
    """Load the rows of `nights`; returns rows per table."""
    counts: dict[str, int] = {}
    generators = rows(farm, nights, first)
    if engine.dialect.name == "postgresql":
        from psycopg.types.json import Jsonb

        raw = engine.raw_connection()
        try:
            with raw.cursor() as cur:
                for name, gen in generators.items():
                    table = TABLES[name].__table__
                    columns = [c.name for c in table.columns]
                    json_cols = {c.name for c in table.columns if c.type.__class__.__name__ == "JSON"}
                    n = 0
                    with cur.copy(f"COPY {name} ({', '.join(columns)}) FROM STDIN") as copy:
                        for row in gen():
                            copy.write_row([Jsonb(row[c]) if c in json_cols and row[c] is not None else row[c]
                                            for c in columns])
                            n += 1
                    counts[name] = n
                    # ids were given: move the sequence past them so the app can insert again
                    cur.execute(f"SELECT setval(pg_get_serial_sequence('{name}', 'id'), "
                                f"(SELECT coalesce(max(id), 1) FROM {name}))")
            raw.commit()
        finally:
            raw.close()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
        return counts
    with engine.begin() as conn:
        for name, gen in generators.items():
            table = TABLES[name].__table__
            n = 0
            for chunk in _chunks(gen(), 20_000):
                conn.execute(table.insert(), chunk)
                n += len(chunk)
            counts[name] = n
    return counts


# ---- what is timed ------------------------------------------------------------------------


def analyse_night(sessions, night: int, reps: int) -> dict:
    """One nightly batch's analysis, as the task runs it, `reps` times (the first records its
    alerts and change points, the others find and update them, as a task retried does):
    seconds of each, their median, and what the first found."""
    times, first = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        # The clock of the night after the batch: no device is silent then (a data-stoppage alert
        # for every device, as on a store loaded today, is no part of a nightly analysis).
        summary, _, _ = analyze_in_store(sessions, night, now=build_created(night) + dt.timedelta(hours=4))
        times.append(time.perf_counter() - t0)
        first = first or summary["analysis"]
    verdicts: dict[str, int] = {}
    for c in first["comparisons"]:
        verdicts[c["verdict"]] = verdicts.get(c["verdict"], 0) + 1
    return {"seconds": round(statistics.median(times), 2), "each_s": [round(t, 2) for t in times],
            "comparisons": len(first["comparisons"]), "verdicts": verdicts, "alerts": len(first["alerts"]),
            "change_points": len(first["change_points"])}


def read_set(farm: Farm, night: int) -> dict[str, Callable]:
    """Name -> f(session) -> rows, the reads behind the dashboard's pages and the API's routes."""
    device = farm.devices // 2 + 1
    serial = f"dev-{device:04d}"
    key = SeriesKey.from_dict(series_dict(farm, device, 0, night, "unet_step_ms"))
    ident = farm_series.series_id(key)

    def series_page(s):  # GET /v1/series/{id}: the series and its points
        return len(farm_series.points(s, farm_series.get_series(s, ident)))

    def series_events(s):
        return len(views.series_events(s, farm_series.get_series(s, ident))["annotations"])

    def series_kernels(s):
        return len(views.series_kernels(s, farm_series.get_series(s, ident))["builds"])

    def device_series(s):  # GET /v1/series?device=
        return len(farm_series.list_series(s, store.get_device(s, serial)))

    def alert_page(s):
        alert = queries.list_alerts(s, states=tuple(AlertState), kinds=(AlertKind.regression,), limit=1)[0]
        return len(views.alert_context(s, alert)["before"] or {})

    return {
        "dashboard overview (every series' latest build)": lambda s: len(views.overview(s)["cells"]),
        "GET /v1/series (every series)": lambda s: len(farm_series.list_series(s)),
        "GET /v1/series?device=": device_series,
        "GET /v1/series/{id} (its points)": series_page,
        "series page: events": series_events,
        "series page: kernels": series_kernels,
        "alert page: context": alert_page,
        "GET /v1/alerts": lambda s: len(queries.list_alerts(s, limit=50)),
        "GET /v1/results (newest 50)": lambda s: len(queries.list_runs(s)),
        "GET /v1/jobs (newest 50)": lambda s: len(queries.list_jobs(s)),
        "GET /v1/devices": lambda s: len(queries.list_devices(s)),
    }


def time_reads(sessions, farm: Farm, night: int, reps: int) -> dict[str, dict]:
    out = {}
    for name, read in read_set(farm, night).items():
        with sessions() as session:
            read(session)  # warm: plans cached, pages in the OS cache
        times, n = [], 0
        for _ in range(reps):
            with sessions() as session:
                t0 = time.perf_counter()
                n = read(session)
                times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        out[name] = {"p50_ms": round(statistics.median(times), 2),
                     "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))], 2), "rows": n}
        print(f"    {name:<50} p50 {out[name]['p50_ms']:>9.2f} ms  p95 {out[name]['p95_ms']:>9.2f} ms  ({n})",
              flush=True)
    return out


def store_bytes(engine: Engine, sqlite_path: Path | None) -> int:
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one())
    return sum(p.stat().st_size for p in sqlite_path.parent.glob(sqlite_path.name + "*"))


# ---- backends -------------------------------------------------------------------------------


def run_backend(url: str, farm: Farm, at: list[int], reps: int, analysis_reps: int,
                sqlite_path: Path | None = None) -> dict:
    upgrade(url)
    engine = make_engine(url)
    sessions = make_session_factory(engine)
    out: dict = {"checkpoints": {}, "load_s": 0.0, "catch_up_s": 0.0}
    try:
        loaded = 0
        for night in at:
            t0 = time.perf_counter()
            counts = fill(engine, farm, range(loaded + 1, night), first=loaded == 0)
            out["load_s"] += time.perf_counter() - t0
            # What the nightly analyses of those nights would have left: the series state.
            t0 = time.perf_counter()
            with sessions() as session, session.begin():
                series_state.catch_up(session)
            out["catch_up_s"] += time.perf_counter() - t0
            fill(engine, farm, range(night, night + 1), first=False)
            loaded = night
            analysis = [analyse_night(sessions, night, analysis_reps)]
            label = f"{night} nights"
            print(f"  {label}: loaded {sum(counts.values()):,} rows; analysis {analysis[0]['seconds']} s "
                  f"(median of {analysis[0]['each_s']}) "
                  f"({analysis[0]['comparisons']} comparisons: {analysis[0]['verdicts']}, "
                  f"{analysis[0]['alerts']} alerts, {analysis[0]['change_points']} change points)", flush=True)
            out["checkpoints"][str(night)] = {"analysis": analysis[0],
                                              "store_bytes": store_bytes(engine, sqlite_path)}
        with sessions() as session:
            out["rows"] = {name: session.query(model).count() for name, model in TABLES.items()}
        print("  reads at the last night:", flush=True)
        out["reads"] = time_reads(sessions, farm, at[-1], reps)
        out["load_s"], out["catch_up_s"] = round(out["load_s"], 1), round(out["catch_up_s"], 1)
        version = engine.dialect.server_version_info
        out["server_version"] = ".".join(map(str, version)) if version else None
        first, last = (out["checkpoints"][str(n)]["analysis"]["seconds"] for n in (at[0], at[-1]))
        out["growth"] = round(last / first, 2) if first else None
        return out
    finally:
        engine.dispose()


def with_postgres_database(server_url: str, body: Callable[[str], dict], keep: bool) -> dict:
    server = make_url(server_url)
    name = f"farm_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            return body(server.set(database=name).render_as_string(hide_password=False))
        finally:
            if not keep:
                with admin.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--at", default="30,182,365", help="the nights whose batch is analysed (history length)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per read (after one warm-up)")
    ap.add_argument("--analysis-reps", type=int, default=3, help="times each measured night's batch is analysed "
                    "(the median is reported)")
    ap.add_argument("--postgres-url", default=os.environ.get("FARM_TEST_POSTGRES_URL"),
                    help="a database URL on the server to create the benchmark database on")
    ap.add_argument("--keep", action="store_true", help="keep the PostgreSQL database")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    at = sorted({int(n) for n in args.at.split(",")})
    if not at or at[0] < 2:
        ap.error("--at: nights from 2 on (the first night has no baseline)")
    farm = Farm(args.devices)
    result = {"benchmark": "store_scale", "date": dt.date.today().isoformat(),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count()},
              "shape": {"devices": farm.devices, "profiles": list(PROFILES), "metrics": [m for m, _, _ in METRICS],
                        "samples_per_run": SAMPLES_PER_RUN, "kernels_per_run": len(KERNELS), "nights": at},
              "flat_within": FLAT_WITHIN, "backends": {}}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        print(f"{backend}:", flush=True)
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "farm.db"
                result["backends"]["sqlite"] = run_backend(f"sqlite:///{path}", farm, at, args.reps, args.analysis_reps, path)
                result["backends"]["sqlite"]["server_version"] = __import__("sqlite3").sqlite_version
        elif backend == "postgresql":
            if not args.postgres_url:
                ap.error("PostgreSQL needs --postgres-url or $FARM_TEST_POSTGRES_URL "
                         "(scripts/ensure-postgres.sh prints one)")
            result["backends"]["postgresql"] = with_postgres_database(
                args.postgres_url, lambda url: run_backend(url, farm, at, args.reps, args.analysis_reps), args.keep)
        else:
            ap.error(f"unknown backend {backend!r}: sqlite or postgresql")

    backends = list(result["backends"])
    print(f"\n{'one batch analysis (s)':<40}" + "".join(f"{b:>14}" for b in backends))
    for night in at:
        print(f"{f'after {night} nights':<40}" + "".join(
            f"{result['backends'][b]['checkpoints'][str(night)]['analysis']['seconds']:>14.2f}" for b in backends))
    print(f"{f'{at[-1]} nights / {at[0]} nights':<40}" + "".join(
        f"{result['backends'][b]['growth']:>13.2f}{'!' if result['backends'][b]['growth'] > FLAT_WITHIN else ' '}"
        for b in backends))
    print(f"\n{'read (p50 / p95 ms)':<50}" + "".join(f"{b:>22}" for b in backends))
    for name in result["backends"][backends[0]]["reads"]:
        print(f"{name:<50}" + "".join(
            f"{result['backends'][b]['reads'][name]['p50_ms']:>11.1f} /{result['backends'][b]['reads'][name]['p95_ms']:>8.1f}"
            for b in backends))
    print(f"{'store size (MB)':<50}" + "".join(
        f"{result['backends'][b]['checkpoints'][str(at[-1])]['store_bytes'] / 1e6:>22.0f}" for b in backends))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    flat = all(result["backends"][b]["growth"] <= FLAT_WITHIN for b in backends)
    print(f"\nanalysis {'flat' if flat else 'NOT flat'}: within {FLAT_WITHIN}x from {at[0]} to {at[-1]} nights")
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
