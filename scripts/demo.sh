#!/usr/bin/env bash
# The main job on a fresh machine with no configuration: `farm demo` builds this checkout with a
# tiny random-weight model, starts the embedded stack (SQLite, the filesystem broker, a real
# worker, beat, virtual phones over ADB, a browser phone and a tablet in Chromium, this host's
# GPU), deploys, measures on every
# device in parallel and prints a table per device. FARM_DATABASE_URL / FARM_BROKER_URL point it
# at PostgreSQL / Redis instead (docker-compose.yml).
set -euo pipefail
cd "$(dirname "$0")/.."
# Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" errors without one; give them a private one.
[ -n "${XDG_RUNTIME_DIR:-}" ] || export XDG_RUNTIME_DIR="$(mktemp -d)"
bash scripts/bootstrap.sh farm
# The browser devices (a phone whose Chrome runs the engine, a tablet over HTTPS) need Debian's
# Chromium and certutil; without them (no root, no apt) `farm demo` leaves those devices out and
# says so.
if ! command -v chromium >/dev/null || ! command -v certutil >/dev/null; then
  echo "installing Chromium for the demo's browser devices (scripts/ensure-chromium.sh)"
  bash scripts/ensure-chromium.sh || echo "could not install Chromium: the demo runs without its browser devices"
fi
exec .venv/bin/farm demo "$@"
