"""A profile against the same profile with its rules for some ops taken out, on the plan executor
(this process's adapter) and in a Chromium page (the browser executor): the UNet CFG step, median
of --reps replays after --warmup, and each kernel family's GPU time from timestamp queries in one
profiled step. This is how a rule of a shipped profile is measured before it ships.

    python benchmarks/profile_rules.py --profile software --without layer_norm --json docs/benchmarks/X.json

Prints a table and writes JSON."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(model: Path, executor: str, profile: Path, reps: int, warmup: int) -> dict:
    import engine

    with engine.load_pipeline(model, precision="fp32", executor=executor, profile=str(profile)) as pipe:
        h, w = pipe.native_size
        ex = pipe.plan_executor(h, w, guidance_scale=7.5)
        times = ex.time_stage("unet_step", reps, warmup=warmup)
        kernels = ex.kernel_times("unet_step", 1) or {}
        adapter = getattr(pipe, "caps", None)
    return {"unet_step_ms": times, "median_ms": statistics.median(times),
            "kernels_ms": {k: round(v["total_ms"], 3) for k, v in sorted(kernels.items())},
            "adapter": adapter.architecture or adapter.device if adapter else "", "size": [h, w]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="software", help="a shipped profile's name")
    ap.add_argument("--without", nargs="+", default=["layer_norm"], help="ops whose rules the baseline drops")
    ap.add_argument("--executors", nargs="+", default=["plan", "browser"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from engine.make_model import make_model
    from engine.profiles import PROFILE_DIR

    work = Path(tempfile.mkdtemp(prefix="profile-rules-"))
    model = work / "tiny"
    make_model("tiny", 0, model)
    shipped = json.loads((PROFILE_DIR / f"{args.profile}.json").read_text())
    baseline = dict(shipped, name=f"{args.profile}-without-{'-'.join(args.without)}",
                    rules=[r for r in shipped["rules"] if r["op"] not in args.without])
    paths = {"shipped": work / "shipped.json", "baseline": work / "baseline.json"}
    paths["shipped"].write_text(json.dumps(shipped))
    paths["baseline"].write_text(json.dumps(baseline))

    rows = []
    for executor in args.executors:
        for which in ("baseline", "shipped"):
            t0 = time.perf_counter()
            r = measure(model, executor, paths[which], args.reps, args.warmup)
            r |= {"executor": executor, "profile": which, "wall_s": round(time.perf_counter() - t0, 1)}
            rows.append(r)
            print(f"{executor:8s} {which:9s} {r['adapter']:12s} UNet CFG step median {r['median_ms']:8.1f} ms "
                  + " ".join(f"{op}={r['kernels_ms'].get(op, 0):.1f}" for op in args.without), flush=True)
    print()
    print(f"| executor | adapter | without {', '.join(args.without)} | {args.profile} | ratio |")
    print("|---|---|---|---|---|")
    for executor in args.executors:
        base, new = (next(r for r in rows if r["executor"] == executor and r["profile"] == p)
                     for p in ("baseline", "shipped"))
        print(f"| {executor} | {new['adapter']} | {base['median_ms']:.1f} ms | {new['median_ms']:.1f} ms | "
              f"{new['median_ms'] / base['median_ms']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "profile_rules", "profile": args.profile,
                                         "without": args.without, "reps": args.reps, "warmup": args.warmup,
                                         "model": "tiny (random weights, seed 0)", "rows": rows}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
