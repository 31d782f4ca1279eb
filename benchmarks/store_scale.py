"""The store at scale: fills a freshly migrated database with a farm's worth of history
(200 devices, 1,000 builds, 1,000,000 raw samples, and the jobs, runs, kernel timings,
thermal readings and images that go with them), then times the queries the CLI and the
dashboards run (orchestrator/store/queries.py), each the median of several repetitions in a
fresh session, as `farm` would run them. Target: every query under 200 ms.

    python benchmarks/store_scale.py --json out.json                 # SQLite and PostgreSQL
    python benchmarks/store_scale.py --backends sqlite --samples 100000

PostgreSQL comes from --postgres-url or $FARM_TEST_POSTGRES_URL (scripts/ensure-postgres.sh
prints one); the benchmark creates its own database there and drops it afterwards.

The shape of the history: every build runs a latency job on 25 of the devices (a nightly
batch per build), so each device has 125 builds in its series; a run carries 40 samples (10
unet_step_ms, 5 repetitions of six per-generation metrics), 10 kernel timings and 2 thermal
readings; every tenth job is a generate with one image. Loading uses executemany on SQLite and
COPY on PostgreSQL; PostgreSQL is ANALYZEd afterwards as autovacuum would, SQLite is left
without statistics, as the farm leaves it.
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

from sqlalchemy import Engine, create_engine, select, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402
from sqlalchemy.orm import selectinload  # noqa: E402

from orchestrator.cli.results import run_dict  # noqa: E402
from orchestrator.store import make_engine, make_session_factory, queries, upgrade  # noqa: E402
from orchestrator.store.models import (  # noqa: E402
    Batch,
    Build,
    Device,
    Host,
    Image,
    Job,
    KernelTiming,
    Run,
    Sample,
    ThermalReading,
)

TARGET_MS = 200.0
SAMPLES_PER_RUN = 40
RUN_METRICS = [("unet_step_ms", "ms", 10)] + [(m, u, 5) for m, u in [
    ("e2e_ms", "ms"), ("text_encoder_ms", "ms"), ("unet_total_ms", "ms"), ("vae_decoder_ms", "ms"),
    ("peak_gpu_bytes", "bytes"), ("unet_peak_gpu_bytes", "bytes")]]
KERNELS = ["conv2d", "conv2d/winograd", "linear", "attention/flash", "attention/partial_softmax",
           "group_norm", "layer_norm", "geglu", "upsample", "add"]
HOSTS = 10
T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)


# ---- the generated history --------------------------------------------------------------------


class Shape:
    """How many of everything, and which device runs which build."""

    def __init__(self, devices: int, builds: int, samples: int):
        self.devices, self.builds = devices, builds
        self.runs = max(1, samples // SAMPLES_PER_RUN)
        self.per_build = max(1, min(devices, -(-self.runs // builds)))  # devices per build
        self.runs = min(self.runs, builds * self.per_build)
        self.queued = max(1, self.runs // 25)  # jobs with no run yet: queued, running, cancelled

    def run_plan(self) -> Iterator[tuple[int, int, int]]:
        """(run/job id, device id, build id), builds in order, devices spread evenly."""
        stride = max(1, self.devices // self.per_build)
        run_id = 0
        for b in range(self.builds):
            for k in range(self.per_build):
                run_id += 1
                if run_id > self.runs:
                    return
                yield run_id, (b + k * stride) % self.devices + 1, b + 1


def build_created(build_id: int) -> dt.datetime:
    return T0 + dt.timedelta(hours=8 * build_id)


def rows(shape: Shape) -> dict[str, Callable[[], Iterator[dict]]]:
    """Per table, a generator of its rows as dicts (ids given, so COPY needs no RETURNING)."""

    def hosts():
        for h in range(1, HOSTS + 1):
            yield {"id": h, "name": f"host-{h:02d}", "last_seen": T0, "created_at": T0}

    def devices():
        for d in range(1, shape.devices + 1):
            yield {"id": d, "serial": f"dev-{d:04d}", "host_id": (d - 1) % HOSTS + 1, "transport": "adb",
                   "address": f"10.0.{d // 250}.{d % 250}:5555", "model": f"SM-S9{d % 30:02d}B",
                   "manufacturer": "samsung", "os": "android", "os_version": "14", "gpu_vendor": "qualcomm",
                   "gpu_architecture": "adreno-7xx", "gpu_device": f"Adreno (TM) 7{d % 5}0", "gpu_driver": "",
                   "gpu_backend": "Vulkan", "virtual": False, "info": None,
                   "state": "quarantined" if d % 50 == 0 else "available", "state_reason": "",
                   "last_seen": T0, "lease_holder": None, "lease_until": None, "created_at": T0}

    def builds():
        for b in range(1, shape.builds + 1):
            yield {"id": b, "name": f"build-{b:05d}", "version": f"0.{b // 100}.{b % 100}",
                   "source_revision": f"{b:012x}", "manifest_sha256": f"{b:064x}", "created": build_created(b)}

    def batches():
        for b in range(1, shape.builds + 1):
            yield {"id": b, "name": f"nightly build-{b:05d}", "schedule_id": None, "build_id": b,
                   "idempotency_key": None, "created_at": build_created(b),
                   "finished_at": build_created(b) + dt.timedelta(hours=2), "summary": None}

    def jobs():
        spec = {"model": "models/sd14", "precision": "fp16", "steps": 20, "repetitions": 5}
        for run_id, device_id, build_id in shape.run_plan():
            start = build_created(build_id) + dt.timedelta(minutes=run_id % 60)
            yield {"id": run_id, "kind": "generate" if run_id % 10 == 0 else "latency", "spec": spec,
                   "device_id": device_id, "build_id": build_id, "schedule_id": None, "batch_id": build_id,
                   "state": "failed" if run_id % 97 == 0 else "succeeded", "attempts": 1,
                   "idempotency_key": None, "worker": f"w@host-{(device_id - 1) % HOSTS + 1:02d}",
                   "created_at": start, "started_at": start, "heartbeat_at": start,
                   "finished_at": start + dt.timedelta(minutes=3), "log_tail": "", "error": None}
        last_build = shape.builds
        for q in range(shape.queued):
            job_id = shape.runs + q + 1
            start = build_created(last_build) + dt.timedelta(hours=3, seconds=q)
            state = ("queued", "running", "cancelled")[q % 3]
            yield {"id": job_id, "kind": "latency", "spec": spec, "device_id": q % shape.devices + 1,
                   "build_id": last_build, "schedule_id": None, "batch_id": None, "state": state,
                   "attempts": 0 if state == "queued" else 1, "idempotency_key": None, "worker": None,
                   "created_at": start, "started_at": None, "heartbeat_at": None,
                   "finished_at": start if state == "cancelled" else None, "log_tail": "", "error": None}

    def runs():
        engine = {"profile": "adreno", "precision": "fp16", "height": 512, "width": 512}
        for run_id, device_id, build_id in shape.run_plan():
            start = build_created(build_id) + dt.timedelta(minutes=run_id % 60)
            yield {"id": run_id, "job_id": run_id, "attempt": 1, "device_id": device_id, "build_id": build_id,
                   "status": "failed" if run_id % 97 == 0 else "succeeded", "error": None,
                   "started_at": start, "finished_at": start + dt.timedelta(minutes=3),
                   "adapter": "Adreno (TM) 740", "engine": engine, "cooldown_wait_s": 12.0,
                   "cooldown_timed_out": False, "artifacts": [], "log_tail": "[job] done\n"}

    def samples():
        sample_id = 0
        for run_id, device_id, build_id in shape.run_plan():
            base = 300.0 + device_id % 40 * 10 + (build_id % 7)  # a per-device level, a little drift
            for metric, unit, reps in RUN_METRICS:
                for r in range(reps):
                    sample_id += 1
                    jitter = ((sample_id * 2654435761) % 1000) / 1000.0
                    value = (2.1e9 + jitter * 1e7) if unit == "bytes" else base * (1 + 0.02 * jitter)
                    yield {"id": sample_id, "run_id": run_id, "metric": metric, "unit": unit, "value": value,
                           "repetition": r}

    def kernel_timings():
        timing_id = 0
        for run_id, _, _ in shape.run_plan():
            for k, kernel in enumerate(KERNELS):
                timing_id += 1
                yield {"id": timing_id, "run_id": run_id, "kernel": kernel, "calls": 10 + k, "total_ms": 50.0 / (k + 1),
                       "repetition": 0}

    def thermal_readings():
        reading_id = 0
        for run_id, _, _ in shape.run_plan():
            for phase, celsius in (("before", 34.0), ("after", 47.5)):
                reading_id += 1
                yield {"id": reading_id, "run_id": run_id, "phase": phase, "zone": "gpu", "celsius": celsius}

    def images():
        for run_id, _, _ in shape.run_plan():
            if run_id % 10 == 0:
                yield {"id": run_id // 10, "run_id": run_id, "path": f"results/job{run_id}/image.png",
                       "sha256": f"{run_id:064x}", "size": 400_000, "prompt": "an astronaut", "seed": 0}

    return {"hosts": hosts, "devices": devices, "builds": builds, "batches": batches, "jobs": jobs, "runs": runs,
            "samples": samples, "kernel_timings": kernel_timings, "thermal_readings": thermal_readings,
            "images": images}


TABLES = {"hosts": Host, "devices": Device, "builds": Build, "batches": Batch, "jobs": Job, "runs": Run,
          "samples": Sample, "kernel_timings": KernelTiming, "thermal_readings": ThermalReading, "images": Image}


def _chunks(it: Iterator[dict], n: int) -> Iterator[list[dict]]:
    chunk: list[dict] = []
    for row in it:
        chunk.append(row)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def fill(engine: Engine, shape: Shape) -> dict[str, int]:
    """Load the generated history; returns rows per table."""
    counts: dict[str, int] = {}
    generators = rows(shape)
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
            for chunk in _chunks(gen(), 50_000):
                conn.execute(table.insert(), chunk)
                n += len(chunk)
            counts[name] = n
    return counts


# ---- the queries ----------------------------------------------------------------------------


def query_set(shape: Shape) -> dict[str, Callable]:
    """Name -> f(session) -> number of rows, for the queries the CLI and dashboards run."""
    device = shape.devices // 2 + 1  # a device in the middle of the fleet
    build_id = shape.builds // 2 + 1
    run_id = shape.runs // 2 + 1
    job_id = run_id

    def results_show(s):  # what `farm results show` reads
        return len(run_dict(s, run_id)["metrics"])

    def jobs_show(s):  # what `farm jobs show` reads
        job = s.get(Job, job_id)
        _ = job.device, job.build  # the CLI prints both
        return len(queries.medians(s, [r.id for r in job.runs], queries.KEY_METRICS))

    def devices_list(s):  # what `farm devices list` runs
        return len(s.scalars(select(Device).options(selectinload(Device.host)).order_by(Device.serial)).all())

    def export_device(s):  # what `farm results export --device` reads, chunk by chunk
        return sum(1 for _ in queries.iter_samples(make_session_factory(s.get_bind()), device_id=device))

    return {
        "results list": lambda s: len(queries.list_runs(s)),
        "results list --device": lambda s: len(queries.list_runs(s, device_id=device)),
        "results list --build": lambda s: len(queries.list_runs(s, build_id=build_id)),
        "results list --device --build": lambda s: len(queries.list_runs(s, device_id=device, build_id=build_id)),
        "results list --metric unet_step_ms --kind latency":
            lambda s: len(queries.list_runs(s, metric="unet_step_ms", kind="latency")),
        "results list --metric tune_ms (absent)": lambda s: len(queries.list_runs(s, metric="tune_ms")),
        "results show": results_show,
        "jobs list": lambda s: len(queries.list_jobs(s)),
        "jobs list --state queued": lambda s: len(queries.list_jobs(s, state="queued")),
        "jobs list --state succeeded": lambda s: len(queries.list_jobs(s, state="succeeded")),
        "jobs list --device": lambda s: len(queries.list_jobs(s, device_id=device)),
        "jobs list --build": lambda s: len(queries.list_jobs(s, build_id=build_id)),
        "jobs list --batch": lambda s: len(queries.list_jobs(s, batch_id=build_id)),
        "jobs show": jobs_show,
        "series: unet_step_ms of one device along builds":
            lambda s: len(queries.metric_series(s, device, "unet_step_ms")),
        "series: last 30 builds": lambda s: len(queries.metric_series(s, device, "unet_step_ms", limit_builds=30)),
        "devices list": devices_list,
        "results export --device (all its samples)": export_device,
    }


def time_queries(engine: Engine, shape: Shape, reps: int) -> dict[str, dict]:
    sessions = make_session_factory(engine)
    out = {}
    for name, query in query_set(shape).items():
        with sessions() as session:
            query(session)  # warm: plans cached, pages in the OS cache
        times, n = [], 0
        for _ in range(reps):
            with sessions() as session:
                t0 = time.perf_counter()
                n = query(session)
                times.append((time.perf_counter() - t0) * 1e3)
        out[name] = {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
                     "max_ms": round(max(times), 2), "rows": n}
        print(f"  {name:<55} {out[name]['median_ms']:>9.2f} ms  ({n} rows)", flush=True)
    return out


# ---- backends -------------------------------------------------------------------------------


def run_backend(url: str, shape: Shape, reps: int) -> dict:
    t0 = time.perf_counter()
    upgrade(url)
    engine = make_engine(url)
    try:
        counts = fill(engine, shape)
        fill_s = time.perf_counter() - t0
        print(f"  filled in {fill_s:.1f} s: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), flush=True)
        version = engine.dialect.server_version_info
        return {"server_version": ".".join(map(str, version)) if version else None, "fill_s": round(fill_s, 1),
                "rows": counts, "queries": time_queries(engine, shape, reps)}
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
    ap.add_argument("--builds", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per query (after one warm-up)")
    ap.add_argument("--sqlite-path", type=Path, help="SQLite file to create (default: a temporary one)")
    ap.add_argument("--postgres-url", default=os.environ.get("FARM_TEST_POSTGRES_URL"),
                    help="a database URL on the server to create the benchmark database on")
    ap.add_argument("--keep", action="store_true", help="keep the filled databases")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    shape = Shape(args.devices, args.builds, args.samples)
    result = {"benchmark": "store_scale", "date": dt.date.today().isoformat(),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count()},
              "shape": {"devices": shape.devices, "builds": shape.builds, "runs": shape.runs,
                        "devices_per_build": shape.per_build, "samples_per_run": SAMPLES_PER_RUN,
                        "queued_jobs": shape.queued},
              "target_ms": TARGET_MS, "reps": args.reps, "backends": {}}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        print(f"{backend}:", flush=True)
        if backend == "sqlite":
            with tempfile.TemporaryDirectory() as tmp:
                path = args.sqlite_path or Path(tmp) / "farm.db"
                if path.exists():
                    ap.error(f"{path} exists; give a new --sqlite-path")
                result["backends"]["sqlite"] = run_backend(f"sqlite:///{path}", shape, args.reps)
                result["backends"]["sqlite"]["server_version"] = __import__("sqlite3").sqlite_version
        elif backend == "postgresql":
            if not args.postgres_url:
                ap.error("PostgreSQL needs --postgres-url or $FARM_TEST_POSTGRES_URL "
                         "(scripts/ensure-postgres.sh prints one)")
            result["backends"]["postgresql"] = with_postgres_database(
                args.postgres_url, lambda url: run_backend(url, shape, args.reps), args.keep)
        else:
            ap.error(f"unknown backend {backend!r}: sqlite or postgresql")

    names = list(query_set(shape))
    backends = list(result["backends"])
    print(f"\n{'query (median ms)':<55}" + "".join(f"{b:>12}" for b in backends))
    for name in names:
        cells = []
        for b in backends:
            ms = result["backends"][b]["queries"][name]["median_ms"]
            cells.append(f"{ms:>11.1f}{'!' if ms > TARGET_MS else ' '}")
        print(f"{name:<55}" + "".join(cells))
    slow = [(b, n) for b in backends for n in names if result["backends"][b]["queries"][n]["median_ms"] > TARGET_MS]
    print(f"\n{'all under' if not slow else 'over'} {TARGET_MS:g} ms" + ("" if not slow else f": {slow}"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
