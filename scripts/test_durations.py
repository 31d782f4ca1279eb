"""Write tests/durations.json from a pytest JUnit report: each test file's total seconds. The
suite's parallel run (scripts/test.sh, pytest-xdist by file) hands out the longest files first,
so that no long file starts last and runs alone at the end (tests/conftest.py).

    .venv/bin/python -m pytest -p no:xdist --junitxml=/tmp/junit.xml
    .venv/bin/python scripts/test_durations.py /tmp/junit.xml
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("junit", type=Path, help="a JUnit XML report of a whole serial run")
    args = ap.parse_args()
    seconds: dict[str, float] = collections.defaultdict(float)
    for case in ET.parse(args.junit).iter("testcase"):
        seconds[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time", 0))
    doc = {"source": "pytest --junitxml of a serial run of the whole suite on this project's 2-core machine "
                     "(scripts/test_durations.py)",
           "seconds_per_file": {path: round(s, 1) for path, s in sorted(seconds.items())}}
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")


if __name__ == "__main__":
    main()
