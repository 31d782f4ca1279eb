#!/usr/bin/env bash
# The main job on a fresh machine with no configuration: `farm demo` builds this checkout with a
# tiny random-weight model, starts the embedded stack (SQLite, the filesystem broker, a real
# worker, beat, two virtual phones over ADB and this host's GPU), deploys, measures on every
# device in parallel and prints a table per device. FARM_DATABASE_URL / FARM_BROKER_URL point it
# at PostgreSQL / Redis instead (docker-compose.yml).
set -euo pipefail
cd "$(dirname "$0")/.."
# Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" errors without one; give them a private one.
[ -n "${XDG_RUNTIME_DIR:-}" ] || export XDG_RUNTIME_DIR="$(mktemp -d)"
bash scripts/bootstrap.sh
exec .venv/bin/farm demo "$@"
