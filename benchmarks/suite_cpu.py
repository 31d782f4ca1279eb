"""What each test file costs this machine: every file run alone and serially (no xdist), its
wall time and the CPU time the whole machine spent meanwhile (busy jiffies of /proc/stat, so the
browsers, workers and servers a file starts count too, reaped or not). Run it on an otherwise
idle machine after scripts/test.sh has installed what the suite needs.

Part 1 of scripts/test.sh runs on several workers over this machine's cores, so its wall time
cannot be below part 1's CPU seconds divided by the cores; part 2 (`alone`) runs one file at a
time, so its wall time is about the sum of its files'. Both floors are printed.

    .venv/bin/python benchmarks/suite_cpu.py --json docs/benchmarks/suite-cpu.json
    .venv/bin/python benchmarks/suite_cpu.py tests/engine/test_phone_class.py   # one file
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def busy_seconds() -> float:
    """CPU seconds this machine has spent busy since boot (every core, user and system)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def alone_files() -> set[str]:
    """The files marked `alone` (part 2 of scripts/test.sh)."""
    out = set()
    for path in (REPO / "tests").rglob("test_*.py"):
        text = path.read_text()
        if "pytest.mark.alone" in text:
            out.add(path.relative_to(REPO).as_posix())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files (default: every tests/**/test_*.py)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    files = args.files or sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))
    alone = alone_files()
    speed = None
    if os.environ.get("FARM_SPEED_INDEX_JSON") and Path(os.environ["FARM_SPEED_INDEX_JSON"]).is_file():
        speed = json.loads(Path(os.environ["FARM_SPEED_INDEX_JSON"]).read_text())
    rows = []
    print(f"{'file':<55}{'part':>5}{'wall s':>9}{'CPU s':>9}  outcome", flush=True)
    for name in files:
        before, started = busy_seconds(), time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", name],
                              cwd=REPO, capture_output=True, text=True)
        row = {"file": name, "part": 2 if name in alone else 1, "wall_s": round(time.monotonic() - started, 1),
               "cpu_s": round(busy_seconds() - before, 1),
               "outcome": (done.stdout.strip().splitlines() or ["(no output)"])[-1]}
        rows.append(row)
        print(f"{name:<55}{row['part']:>5}{row['wall_s']:>9.1f}{row['cpu_s']:>9.1f}  {row['outcome']}", flush=True)
    cores = os.cpu_count() or 1
    totals = {}
    for part in (1, 2):
        mine = [r for r in rows if r["part"] == part]
        totals[part] = {"files": len(mine), "wall_s": round(sum(r["wall_s"] for r in mine), 1),
                        "cpu_s": round(sum(r["cpu_s"] for r in mine), 1)}
    print(f"\npart 1: {totals[1]['files']} files, {totals[1]['wall_s']:.0f} s serially, {totals[1]['cpu_s']:.0f} CPU s: "
          f"on {cores} cores at least {totals[1]['cpu_s'] / cores:.0f} s")
    print(f"part 2: {totals[2]['files']} files, {totals[2]['wall_s']:.0f} s one after another")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": {"cpus": cores, "cpu": platform.processor() or platform.machine(),
                        "python": platform.python_version()},
            "speed_index": speed, "files": rows,
            "totals": {f"part{k}": v for k, v in totals.items()},
            "part1_floor_s": round(totals[1]["cpu_s"] / cores, 1)}, indent=2) + "\n")
    return 0 if all("failed" not in r["outcome"] and "error" not in r["outcome"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
