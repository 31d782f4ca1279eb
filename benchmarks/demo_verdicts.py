"""`farm demo` N times in a row on one fresh home (new XDG folders, no FARM_* settings), then
the verdict of every UNet-step and end-to-end comparison it made, as its last round left it,
with the number of rounds it took: the check that build B (every reference kernel, 2-5x
slower) is called a regression on both metrics on every device every time and A against A
never is.

    python benchmarks/demo_verdicts.py --runs 5 --json docs/benchmarks/DATE-cpu-demo-verdicts.json

Prints one table of verdicts and one of run times; writes both as JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run_demos(home: Path, runs: int, logs: Path | None = None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    env |= {"XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config")}
    timings = []
    for i in range(1, runs + 1):
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "demo"], env=env, cwd=REPO,
                              capture_output=True, text=True)
        seconds = time.monotonic() - t0
        timings.append({"run": i, "seconds": round(seconds, 1), "exit": done.returncode})
        print(f"run {i}: exit {done.returncode} in {seconds:.0f} s", flush=True)
        if logs is not None:  # what a person reading a piped run sees
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"demo-run-{i}.txt").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            print(done.stdout[-4000:] + done.stderr[-4000:])
    return timings


def verdicts(home: Path) -> list[dict]:
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from orchestrator.cli.demo import batch_family, final_verdicts
    from orchestrator.store.models import Batch

    engine = create_engine(f"sqlite:///{home / 'data' / 'devicefarm' / 'farm.db'}")
    rows = []
    try:
        with Session(engine) as session:
            roots = [b for b in session.scalars(select(Batch).order_by(Batch.id))
                     if not (b.idempotency_key or "").startswith("more:")]
            for index, root in enumerate(roots):
                family, _ = batch_family(session, root.id)
                letter = root.build.name[-1].upper()
                first = {(c["device"], c.get("metric")): c["verdict"]
                         for c in (root.summary or {}).get("analysis", {}).get("comparisons", [])}
                for c in final_verdicts(family):
                    base = (c.get("baseline_build") or "-")[-1:].upper() or "-"
                    rows.append({"run": index // 2 + 1, "comparison": f"{letter} vs {base}", "device": c["device"],
                                 "metric": c.get("metric"), "ratio": c.get("ratio"), "ci_low": c.get("ci_low"),
                                 "ci_high": c.get("ci_high"), "verdict": c["verdict"], "rounds": c["rounds"],
                                 "first_round_verdict": first.get((c["device"], c.get("metric")))})
    finally:
        engine.dispose()
    return rows


def run_levels(home: Path) -> list[dict]:
    """Every succeeded latency run's UNet-step median: which demo run (stack) made it, in which
    batch round, of which build on which device; the data the run-to-run drift is read from."""
    import numpy as np
    from sqlalchemy import create_engine, select
    from sqlalchemy.orm import Session

    from orchestrator.store.batches import extra_round
    from orchestrator.store.models import Batch, Build, Device, Job, JobKind, Run, RunStatus, Sample

    engine = create_engine(f"sqlite:///{home / 'data' / 'devicefarm' / 'farm.db'}")
    rows = []
    try:
        with Session(engine) as session:
            roots = [b.id for b in session.scalars(select(Batch).order_by(Batch.id))
                     if not (b.idempotency_key or "").startswith("more:")]
            found = session.execute(
                select(Run, Job, Batch, Build.name, Device.serial).join(Job, Job.id == Run.job_id)
                .join(Batch, Batch.id == Job.batch_id).join(Build, Build.id == Run.build_id)
                .join(Device, Device.id == Run.device_id)
                .where(Job.kind == JobKind.latency, Run.status == RunStatus.succeeded).order_by(Run.id)).all()
            for run, _job, batch, build, serial in found:
                values = list(session.scalars(select(Sample.value).where(
                    Sample.run_id == run.id, Sample.metric == "unet_step_ms")))
                key = batch.idempotency_key or ""
                root = int(key.split(":")[1]) if key.startswith("more:") else batch.id
                rows.append({"run_id": run.id, "demo_run": roots.index(root) // 2 + 1, "batch": batch.id,
                             "round": extra_round(key), "device": serial, "build": build,
                             "n": len(values), "median": float(np.median(values)) if values else None})
    finally:
        engine.dispose()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the tables here")
    parser.add_argument("--logs", type=Path, help="write each run's output (stdout, then stderr) here")
    parser.add_argument("--home", type=Path, help="run in this (new) folder and keep it; default: a temporary one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="demo-verdicts-") as tmp:
        home = args.home or Path(tmp)
        timings = run_demos(home, args.runs, args.logs)
        rows = verdicts(home)
        levels = run_levels(home)

    def num(v, fmt):
        return format(v, fmt) if v is not None else "-"

    metrics = ("unet_step_ms", "e2e_ms")
    print("\n| run | comparison | device | metric | ratio | 95% CI | verdict | rounds |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["metric"] not in metrics:
            continue
        ci = f"{num(r['ci_low'], '.2f')} - {num(r['ci_high'], '.2f')}" if r["ci_low"] is not None else "-"
        print(f"| {r['run']} | {r['comparison']} | {r['device']} | {r['metric']} | {num(r['ratio'], '.3f')} | {ci} | "
              f"{r['verdict']} | {r['rounds']} |")
    print("\nUNet-step median of every latency run (ms):\n| demo run | round | device | build | n | median |\n"
          "|---|---|---|---|---|---|")
    for r in levels:
        print(f"| {r['demo_run']} | {r['round']} | {r['device']} | {r['build'][-1:].upper()} | {r['n']} | "
              f"{num(r['median'], '.2f')} |")
    summary = {"run_seconds": [t["seconds"] for t in timings]}
    for metric in metrics:
        b = [r for r in rows if r["metric"] == metric and r["comparison"].startswith("B vs A")]
        aa = [r for r in rows if r["metric"] == metric and r["comparison"] == "A vs A"]
        summary[metric] = {"b_regression": sum(r["verdict"] == "regression" for r in b), "b_comparisons": len(b),
                           "aa_regression": sum(r["verdict"] == "regression" for r in aa),
                           "aa_comparisons": len(aa),
                           "aa_inconclusive": sum(r["verdict"] == "inconclusive" for r in aa)}
        m = summary[metric]
        print(f"\n{metric}: B vs A called a regression {m['b_regression']}/{m['b_comparisons']}; A vs A called a "
              f"regression {m['aa_regression']}/{m['aa_comparisons']} (inconclusive {m['aa_inconclusive']})")
    print(f"runs took {summary['run_seconds']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"timings": timings, "verdicts": rows, "runs": levels,
                                               "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
