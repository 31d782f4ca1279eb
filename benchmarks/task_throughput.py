"""Task throughput and round-trip latency of the farm's Celery setup, per broker: the embedded
filesystem broker (SQLite results) and Redis (Redis results), each with real worker processes
started exactly as the farm starts them (`celery -A orchestrator.jobs.celery_app worker`, configured
by FARM_* variables, so make_celery's real settings: acks late, prefetch 1, 0.1 s polling for
the filesystem broker).

    python benchmarks/task_throughput.py --json out.json
    python benchmarks/task_throughput.py --brokers redis --redis-url redis://127.0.0.1:6379/0

Latency: one orchestrator.tasks.ping at a time, from apply_async until its result is back
(results are polled every 10 ms from the SQLite backend; Redis pushes them). Throughput: a
burst of pings sent at once, tasks per second from the first send to the last result, repeated
and reported as the median. Without --redis-url a private redis-server (no persistence) is
started on a free port.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.infra.settings import Settings  # noqa: E402
from orchestrator.jobs.celery_app import host_queue, make_celery  # noqa: E402

PING = "orchestrator.tasks.ping"
RESULT_POLL_S = 0.01


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("error: no redis-server on PATH (bash scripts/ensure-redis.sh installs it), or pass --redis-url")
    port = free_port()
    server = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder),
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            if redis.Redis.from_url(url).ping():
                return server, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    server.kill()
    sys.exit(f"error: redis-server did not start on port {port}")


def start_workers(settings: Settings, count: int, concurrency: int, log_dir: Path) -> list[subprocess.Popen]:
    env = os.environ | {"FARM_DATA_DIR": str(settings.data_dir), "FARM_CONFIG_DIR": str(settings.config_dir),
                        "FARM_DATABASE_URL": settings.database_url, "FARM_HOST_NAME": settings.host_name}
    if settings.broker_url:
        env["FARM_BROKER_URL"] = settings.broker_url
    else:
        env.pop("FARM_BROKER_URL", None)
    workers = []
    for i in range(count):
        log = open(log_dir / f"worker{i}.log", "w")  # noqa: SIM115  (the child keeps it)
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "orchestrator.jobs.celery_app", "worker", "-Q",
             host_queue(settings.host_name), "-c", str(concurrency), "-n", f"bench{i}@{settings.host_name}",
             "--without-gossip", "--without-mingle", "-l", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
        log.close()
    return workers


def stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.terminate()
    for p in processes:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure(app, queue: str, latency_n: int, burst: int, repeats: int) -> dict:
    ping = app.signature(PING)

    def round_trip(payload) -> float:
        start = time.perf_counter()
        assert ping.clone(args=(payload,)).apply_async(queue=queue).get(timeout=60, interval=RESULT_POLL_S) == payload
        return time.perf_counter() - start

    for i in range(20):  # warm-up: connections, worker pools, the result table
        round_trip(i)
    latencies_ms = [round_trip(i) * 1e3 for i in range(latency_n)]
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = [ping.clone(args=(i,)).apply_async(queue=queue) for i in range(burst)]
        got = [r.get(timeout=300, interval=RESULT_POLL_S) for r in results]
        elapsed = time.perf_counter() - start
        assert got == list(range(burst)), "results out of order or lost"
        rates.append(burst / elapsed)
    return {
        "latency_ms": {"n": latency_n, "p50": statistics.median(latencies_ms), "p95": percentile(latencies_ms, 95),
                       "min": min(latencies_ms), "max": max(latencies_ms)},
        "throughput_tasks_per_s": {"burst": burst, "runs": rates, "median": statistics.median(rates)},
    }


def run_broker(broker: str, args, tmp: Path) -> dict:
    folder = tmp / broker
    folder.mkdir()
    server, url = None, None
    if broker == "redis":
        url = args.redis_url
        if url is None:
            server, url = start_redis(folder)
    settings = Settings(data_dir=folder / "data", config_dir=folder / "config", broker_url=url,
                        host_name=f"bench-{broker}")
    if broker == "filesystem":
        settings.data_dir.mkdir(parents=True)
    app = make_celery(settings)  # creates the embedded broker's folders before the workers start
    workers = start_workers(settings, args.workers, args.concurrency, folder)
    try:
        out = measure(app, host_queue(settings.host_name), args.latency_n, args.burst, args.repeats)
        # The result objects are freed by the garbage collector, and each unsubscribes from its
        # Redis channel as it goes: collect them while Redis is up (after it stops, each one
        # retried the connection 20 times, and the run never ended).
        gc.collect()
    finally:
        stop(workers)
        if server is not None:
            stop([server])
    return {"broker": broker, "broker_url": "filesystem://" if url is None else url,
            "workers": args.workers, "concurrency": args.concurrency} | out


def versions() -> dict:
    import celery
    import kombu

    out = {"python": platform.python_version(), "celery": celery.__version__, "kombu": kombu.__version__}
    if shutil.which("redis-server"):
        out["redis_server"] = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--brokers", default="filesystem,redis", help="comma-separated: filesystem, redis")
    ap.add_argument("--redis-url", help="an existing Redis (default: start a private redis-server)")
    ap.add_argument("--workers", type=int, default=1, help="worker processes")
    ap.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    ap.add_argument("--latency-n", type=int, default=200, help="sequential round trips")
    ap.add_argument("--burst", type=int, default=500, help="tasks per throughput run")
    ap.add_argument("--repeats", type=int, default=5, help="throughput runs (the median is reported)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    results = []
    with tempfile.TemporaryDirectory(prefix="farm-task-bench-") as tmp:
        for broker in args.brokers.split(","):
            print(f"measuring {broker} ...", file=sys.stderr, flush=True)
            results.append(run_broker(broker.strip(), args, Path(tmp)))

    print(f"{'broker':<12} {'workers x c':>11} {'p50 ms':>8} {'p95 ms':>8} {'tasks/s (median)':>17} {'runs':>22}")
    for r in results:
        lat, thr = r["latency_ms"], r["throughput_tasks_per_s"]
        runs = f"{min(thr['runs']):.0f}-{max(thr['runs']):.0f}"
        print(f"{r['broker']:<12} {r['workers']:>6} x {r['concurrency']:<2} {lat['p50']:>8.1f} {lat['p95']:>8.1f} "
              f"{thr['median']:>17.0f} {runs:>22}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "task_throughput", "task": PING, "result_poll_s": RESULT_POLL_S,
                  "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "gpu": None},
                  "versions": versions(), "params": vars(args) | {"json": str(args.json)}, "results": results}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
