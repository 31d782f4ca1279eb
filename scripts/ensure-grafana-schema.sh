#!/usr/bin/env bash
# Make sure npm's @grafana/schema (the TypeScript types Grafana generates from its CUE dashboard
# and panel schemas) of the Grafana that docker-compose.yml runs, and the TypeScript compiler,
# are installed in .cache/grafana-schema (git-ignored). tests/orchestrator/test_dashboards_grafana.py
# type-checks every dashboard against them with `tsc --strict`. Idempotent: does nothing when the
# pinned versions are already there. Prints the folder on success; errors go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
SCHEMA_VERSION=11.6.0      # = the grafana/grafana image tag in docker-compose.yml
TYPESCRIPT_VERSION=5.7.3   # the compiler @grafana/schema 11.6.0 itself is built with
dir=.cache/grafana-schema
log() { echo "ensure-grafana-schema: $*" >&2; }

installed() {
  node -e '
    const [dir, schema, ts] = process.argv.slice(1);
    const v = (p) => { try { return require(`${dir}/node_modules/${p}/package.json`).version; } catch { return ""; } };
    process.exit(v("@grafana/schema") === schema && v("typescript") === ts ? 0 : 1);
  ' "$PWD/$dir" "$SCHEMA_VERSION" "$TYPESCRIPT_VERSION" 2>/dev/null
}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi; }
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  log "installing Debian's nodejs and npm"
  command -v apt-get >/dev/null &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null ||
    { log "error: node and npm are required (apt-get install nodejs npm)"; exit 1; }
fi
if ! installed; then
  mkdir -p "$dir"
  printf '{"private": true, "description": "installed by scripts/ensure-grafana-schema.sh"}\n' >"$dir/package.json"
  npm install --prefix "$dir" --no-save --no-audit --no-fund --no-package-lock --loglevel=error \
    "@grafana/schema@$SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION" >/dev/null ||
    { log "error: npm install @grafana/schema@$SCHEMA_VERSION typescript@$TYPESCRIPT_VERSION failed"; exit 1; }
  installed || { log "error: $dir lacks @grafana/schema $SCHEMA_VERSION or typescript $TYPESCRIPT_VERSION after npm install"; exit 1; }
fi
echo "$PWD/$dir"
