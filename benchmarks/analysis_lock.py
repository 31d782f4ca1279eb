"""How long a batch's analysis keeps other writers of a SQLite store waiting.

On SQLite every transaction takes the write lock when it begins (orchestrator/store/session.py),
so whatever the analysis does inside its transaction, every worker recording a result waits
for, up to the 30 s busy timeout, after which its result is lost to "database is locked".
This fills a fresh store with a nightly history (D devices, B builds, one latency run a build
and device, 10 unet_step_ms and 5 e2e_ms samples a run, a level shift half-way so the
change-point scan has something to find), then runs the analysis of the last build's batch
(orchestrator.jobs.batch_analysis.analyze, as the worker does) while a writer thread commits a small write
every 50 ms, and reports the analysis' wall time and the writer's longest wait: with the
history's change-point scan read in a snapshot (as the farm does) and, for comparison, in a
transaction that takes the write lock, each on its own copy of the store.

    python benchmarks/analysis_lock.py --devices 5 --builds 365 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from sqlalchemy import update  # noqa: E402

from agent.protocol import JobResult, Manifest, ManifestFile, Sample  # noqa: E402
from orchestrator import store  # noqa: E402
from orchestrator.infra.settings import Settings  # noqa: E402
from orchestrator.store import make_engine, make_session_factory, upgrade
from orchestrator.store.models import Device, DeviceState, JobState  # noqa: E402
from orchestrator.store.session import read_snapshot  # noqa: E402

SPEC = {"model": "models/tiny", "precision": "fp16", "steps": 20, "height": 512, "width": 512}


def fill(Session, devices: int, builds: int, seed: int = 0) -> int:  # noqa: N803
    """The history; returns the last build's batch id."""
    rng = np.random.default_rng(seed)
    with Session() as s, s.begin():
        ids = []
        for d in range(devices):
            device = store.upsert_device(s, f"phone-{d}", "adb", f"127.0.0.1:{5555 + d}", host="bench")
            store.set_device_state(s, device.id, DeviceState.available)
            ids.append(device.id)
    batch_id = None
    for b in range(builds):
        level = 100.0 * (1.3 if b >= builds // 2 else 1.0)
        with Session() as s, s.begin():
            build = store.create_build(s, Manifest(build=f"n{b:04d}", version="0.1.0", created=1.7e9 + b * 86400.0,
                                                   files=[ManifestFile("engine/__init__.py", f"{b:064x}", 10)]))
            batch = store.create_batch(s, f"nightly {b}", build_id=build.id)
            batch_id = batch.id
            for d, device_id in enumerate(ids):
                job = store.create_job(s, "latency", SPEC, device_id, build.id, batch_id=batch.id)
                store.transition_job(s, job.id, JobState.running, worker="bench")
                scale = level * (1 + 0.02 * d)
                samples = [Sample("unet_step_ms", float(v), "ms", r)
                           for r, v in enumerate(rng.normal(scale, scale * 0.01, 10))]
                samples += [Sample("e2e_ms", float(v), "ms", r)
                            for r, v in enumerate(rng.normal(scale * 25, scale * 0.25, 5))]
                store.record_result(s, job.id, JobResult(job_id=f"job{job.id}-a1", kind="latency",
                                                         status="succeeded", started_at=1.7e9, finished_at=1.7e9 + 60,
                                                         device="Adreno (TM) 740", samples=samples))
                store.transition_job(s, job.id, JobState.succeeded)
    return batch_id


def measure(url: str, batch_id: int, snapshot: bool) -> dict:
    """One analysis of the batch, with a writer beside it. Without `snapshot`, the scan's read
    transaction takes the write lock like every other: what the analysis did before it read in
    a snapshot (then the scan and the comparisons were one transaction; the comparisons alone
    now take well under a second of it)."""
    from orchestrator.jobs import batch_analysis
    from orchestrator.jobs.batch_analysis import analyze
    from orchestrator.jobs.celery_app import make_celery

    batch_analysis.read_snapshot = read_snapshot if snapshot else (lambda session: None)

    settings = Settings(database_url=url)
    app = make_celery(settings)
    Session = make_session_factory(make_engine(url))  # noqa: N806
    waits: list[float] = []
    stop = threading.Event()

    def writer():
        while not stop.is_set():
            t0 = time.monotonic()
            with Session() as s, s.begin():
                s.execute(update(Device).where(Device.serial == "phone-0").values(state_reason="bench"))
            waits.append(time.monotonic() - t0)
            time.sleep(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    summary = analyze(app, batch_id)
    took = time.monotonic() - t0
    time.sleep(0.3)
    stop.set()
    thread.join()
    report = summary["analysis"]
    return {"analysis_s": round(took, 3), "writer_longest_wait_s": round(max(waits), 3),
            "writer_median_wait_s": round(statistics.median(waits), 4), "writes": len(waits),
            "comparisons": len(report["comparisons"]), "change_points": len(report["change_points"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=5)
    parser.add_argument("--builds", type=int, default=365)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        filled_db = Path(tmp) / "filled.db"
        url = f"sqlite:///{filled_db}"
        upgrade(url)
        t0 = time.monotonic()
        engine = make_engine(url)
        batch_id = fill(make_session_factory(engine), args.devices, args.builds)
        with engine.connect() as conn:  # all of it in the file itself, not in its WAL, before copying
            conn.connection.dbapi_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        engine.dispose()
        filled = time.monotonic() - t0
        for rep in range(args.repeats):
            for snapshot in (False, True):
                copy = Path(tmp) / f"run-{rep}-{snapshot}.db"  # the analysis writes: each on a fresh copy
                shutil.copyfile(filled_db, copy)
                rows.append({"scan_in": "read snapshot" if snapshot else "write transaction",
                             **measure(f"sqlite:///{copy}", batch_id, snapshot)})
    result = {"devices": args.devices, "builds": args.builds, "fill_s": round(filled, 1), "runs": rows,
              "machine": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(f"{args.devices} devices x {args.builds} nightly builds, {args.repeats} analyses each way (medians):")
    print(f"{'scan in':>18} {'analysis s':>11} {'writer waited at most s':>24} {'change points':>14}")
    for way in ("write transaction", "read snapshot"):
        mine = [r for r in rows if r["scan_in"] == way]
        result[way] = {"analysis_s": statistics.median(r["analysis_s"] for r in mine),
                       "writer_longest_wait_s": statistics.median(r["writer_longest_wait_s"] for r in mine)}
        print(f"{way:>18} {result[way]['analysis_s']:>11.2f} {result[way]['writer_longest_wait_s']:>24.2f} "
              f"{mine[0]['change_points']:>14}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
