"""The test suite's times per file, from pytest JUnit reports, always beside the machine's speed
index (engine/speed.py: the tiny model's UNet step on this adapter, which the suite's time
follows; the same suite runs about 4.5x longer at 700 ms than at 150 ms).

    scripts/test.sh                                   # ends with --summary of its own run
    .venv/bin/python -m pytest -p no:xdist --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml --speed /tmp/speed.json   # writes tests/durations.json

Written, tests/durations.json orders the parallel run (scripts/test.sh hands out the longest
files first, so that no long file starts last and runs alone at the end: tests/conftest.py).
With --summary nothing is written: it prints the wall time, the speed index and the slowest
files, which is how scripts/test.sh ends."""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
SLOWEST = 10


def seconds_per_file(reports: list[Path]) -> dict[str, float]:
    seconds: dict[str, float] = collections.defaultdict(float)
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time", 0))
    return dict(seconds)


def counts(reports: list[Path]) -> collections.Counter:
    """Tests by outcome: passed, failed, errors, skipped, xfailed."""
    outcome: collections.Counter = collections.Counter()
    for report in reports:
        for case in ET.parse(report).iter("testcase"):
            kinds = [child for child in case if child.tag in ("failure", "error", "skipped")]
            if not kinds:
                outcome["passed"] += 1
            elif kinds[0].tag == "skipped" and kinds[0].get("type") == "pytest.xfail":
                outcome["xfailed"] += 1
            else:
                outcome[{"failure": "failed", "error": "errors"}.get(kinds[0].tag, kinds[0].tag)] += 1
    return outcome


def speed_line(speed: dict | None) -> str:
    from engine.speed import describe  # the line the suite and the demo print first

    return describe(speed) if speed else "speed index: not measured"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", type=Path, nargs="+", help="JUnit XML reports (a serial run's, to write)")
    ap.add_argument("--speed", type=Path, help="the run's speed index (python -m engine.speed --json FILE)")
    ap.add_argument("--summary", action="store_true", help="print the wall time, speed index and slowest files")
    ap.add_argument("--wall", type=float, help="with --summary: the whole run's wall time in seconds")
    ap.add_argument("--source", default="pytest --junitxml of a serial run of the whole suite on this project's "
                    "2-core machine (scripts/test_durations.py)", help="what the reports are, as recorded")
    args = ap.parse_args()
    reports = [r for r in args.junit if r.is_file()]
    speed = json.loads(args.speed.read_text()) if args.speed and args.speed.is_file() else None
    seconds = seconds_per_file(reports)
    if args.summary:
        done = counts(reports)
        wall = f"{args.wall // 60:.0f} min {args.wall % 60:.0f} s" if args.wall is not None else "?"
        print(f"the suite took {wall}: {', '.join(f'{n} {k}' for k, n in sorted(done.items()))}; {speed_line(speed)}")
        print(f"the {SLOWEST} slowest files (seconds of test time, summed over workers):")
        for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]:
            print(f"  {s:8.1f}  {path}")
        return
    doc = {"source": args.source, "speed_index": speed,
           "seconds_per_file": {path: round(s, 1) for path, s in sorted(seconds.items())}}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all; {speed_line(speed)}")


if __name__ == "__main__":
    main()
