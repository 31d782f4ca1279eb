#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, lint, then every test (GPU tests run on
# whatever adapter exists, lavapipe included; in CI they fail rather than skip without one).
set -euo pipefail
cd "$(dirname "$0")/.."
suite_started=$SECONDS
# Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" errors without one; give them a private one.
[ -n "${XDG_RUNTIME_DIR:-}" ] || export XDG_RUNTIME_DIR="$(mktemp -d)"
bash scripts/bootstrap.sh farm,test
# The virtual phone is tested with Google's own adb client too (Debian package adb).
if ! command -v adb >/dev/null; then
  echo "installing Google's adb client (Debian package adb) for the virtual-phone tests"
  if [ "$(id -u)" = 0 ]; then sudo_=""; else sudo_="sudo -n"; fi
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq adb >/dev/null 2>&1 ||
    { $sudo_ apt-get update -qq >/dev/null && $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq adb >/dev/null; } ||
    { echo "error: could not install adb (apt-get install adb)" >&2; exit 1; }
fi
# The multi-host tests (tests/orchestrator/test_hosts.py) make network namespaces and veth pairs
# with iproute2's `ip` (as root; Debian package iproute2).
if ! command -v ip >/dev/null; then
  echo "installing iproute2 for the multi-host tests"
  if [ "$(id -u)" = 0 ]; then sudo_=""; else sudo_="sudo -n"; fi
  $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null 2>&1 ||
    { $sudo_ apt-get update -qq >/dev/null && $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null; } ||
    { echo "error: could not install iproute2 (apt-get install iproute2)" >&2; exit 1; }
fi
# The store tests run against PostgreSQL too: use a reachable server or start a local one.
export FARM_TEST_POSTGRES_URL="$(bash scripts/ensure-postgres.sh)"
# The broker tests run worker processes on Redis too (tests/orchestrator/test_compose.py needs no server).
export FARM_TEST_REDIS_URL="$(bash scripts/ensure-redis.sh)"
bash scripts/ensure-chromium.sh  # the HTML dashboard is tested in headless Chromium
bash scripts/ensure-grafana-schema.sh >/dev/null  # the Grafana dashboards are type-checked against @grafana/schema
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache  # the layers: pyproject.toml [tool.importlinter]
# The suite's time follows this machine's software GPU (4.5x apart between machines of one
# kind): measure it first, so that every time below can be compared (docs/testing.md).
reports="$(mktemp -d)"
.venv/bin/python -m engine.speed --json "$reports/speed.json" || echo "speed index: could not be measured"
export FARM_SPEED_INDEX_JSON="$reports/speed.json"  # pytest's header repeats it (tests/conftest.py)
# Most of the suite's time is spent waiting on processes, browsers and timeouts rather than on
# the CPU: it runs on several workers, a file at a time, longest files first (tests/conftest.py).
# Tests marked `alone` time builds against each other or wait on second-long deadlines: they run
# afterwards, one at a time, with nothing beside them. Both parts always run; either failing
# fails the suite (a part that selects no test, exit 5, is no failure: `bash scripts/test.sh
# tests/engine` has nothing to run alone).
status=0
part() { "$@" || { rc=$?; [ "$rc" = 5 ] || status=$rc; }; }
part .venv/bin/python -m pytest -n "${FARM_TEST_WORKERS:-4}" --dist loadfile --no-loadscope-reorder --durations=15 \
  --junitxml="$reports/part1.xml" -m "not alone" "$@"
part .venv/bin/python -m pytest -p no:xdist --durations=5 --junitxml="$reports/part2.xml" -m alone "$@"
# What it took, beside the speed index, and where the time went (docs/testing.md: the budget).
.venv/bin/python scripts/test_durations.py --summary --wall "$((SECONDS - suite_started))" \
  --speed "$reports/speed.json" "$reports"/part*.xml || true
exit "$status"
