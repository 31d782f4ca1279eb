#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, lint, then every test (GPU tests run on
# whatever adapter exists, lavapipe included; in CI they fail rather than skip without one).
set -euo pipefail
cd "$(dirname "$0")/.."
# Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" errors without one; give them a private one.
[ -n "${XDG_RUNTIME_DIR:-}" ] || export XDG_RUNTIME_DIR="$(mktemp -d)"
bash scripts/bootstrap.sh test
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
