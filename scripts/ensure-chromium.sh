#!/usr/bin/env bash
# Make sure Debian's chromium and chromium-driver are installed for the browser tests of the
# dashboard (tests/orchestrator/test_dashboard_live.py drives them through selenium; no browser is
# ever downloaded by selenium itself), and libnss3-tools' certutil, with which
# tests/orchestrator/test_ca.py adds the farm's CA to a test profile's NSS database (Chromium on
# Linux trusts the CAs there). Installs them with apt-get, as root or through sudo -n, when any is
# missing. Prints nothing on success; errors go to stderr with a non-zero exit.
set -euo pipefail
log() { echo "ensure-chromium: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi; }
PACKAGES=(chromium chromium-driver libnss3-tools)
present() { command -v chromium >/dev/null && command -v chromedriver >/dev/null && command -v certutil >/dev/null; }

if present; then exit 0; fi
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null 2>&1 ||
  { as_root apt-get update -qq >/dev/null 2>&1 &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${PACKAGES[@]}" >/dev/null 2>&1; } ||
  { log "error: could not install ${PACKAGES[*]} (apt-get install ${PACKAGES[*]}, as root)"; exit 1; }
present || { log "error: chromium, chromedriver or certutil is still missing after apt-get install"; exit 1; }
