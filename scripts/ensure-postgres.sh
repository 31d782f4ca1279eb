#!/usr/bin/env bash
# Make sure a PostgreSQL server is reachable for the store tests and print the URL to give
# them (FARM_TEST_POSTGRES_URL); progress goes to stderr. In order:
#   1. $FARM_TEST_POSTGRES_URL when set and reachable (nothing is started);
#   2. the server on 127.0.0.1:5432 (database "test", user postgres, trust auth);
#   3. a Debian cluster (pg_ctlcluster) on port 5432 that is installed but stopped;
#   4. a private server: initdb into $FARM_PG_DIR (default /tmp/devicefarm-pg-$UID), started
#      with pg_ctl on a free port and reused by later runs (stop: pg_ctl -D DIR/data stop).
# PostgreSQL is installed with apt-get when no initdb is found. FARM_TEST_POSTGRES_TEMP=1 skips
# 2 and 3 (leave the system server alone).
# Use: export FARM_TEST_POSTGRES_URL="$(bash scripts/ensure-postgres.sh)"
set -euo pipefail
log() { echo "ensure-postgres: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi; }
ready() { command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p "$1" -t 3; }
url_for() { echo "postgresql+psycopg://postgres@127.0.0.1:$1/test"; }
has_test_db() { psql -h 127.0.0.1 -p "$1" -U postgres -d test -Atqc 'select 1' >/dev/null 2>&1; }
make_test_db() { has_test_db "$1" || psql -h 127.0.0.1 -p "$1" -U postgres -d postgres -qc 'CREATE DATABASE test' >/dev/null; }

if [ -n "${FARM_TEST_POSTGRES_URL:-}" ]; then
  conninfo="${FARM_TEST_POSTGRES_URL/+psycopg/}"
  if command -v pg_isready >/dev/null && pg_isready -q -d "$conninfo" -t 3; then echo "$FARM_TEST_POSTGRES_URL"; exit 0; fi
  log "FARM_TEST_POSTGRES_URL is set but not reachable; looking for a local server"
fi

find_bin() {  # the newest installed PostgreSQL's program $1
  command -v "$1" 2>/dev/null && return 0
  ls -d /usr/lib/postgresql/*/bin/"$1" 2>/dev/null | sort -V | tail -n 1 | grep . && return 0
  return 1
}
if ! find_bin initdb >/dev/null || ! command -v pg_isready >/dev/null; then
  log "installing PostgreSQL (apt-get install postgresql)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null 2>&1 ||
    { as_root apt-get update -qq >/dev/null && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; } ||
    { log "error: no PostgreSQL and apt-get could not install it; set FARM_TEST_POSTGRES_URL"; exit 1; }
fi

if [ "${FARM_TEST_POSTGRES_TEMP:-0}" != 1 ]; then
  if ready 5432 && has_test_db 5432; then url_for 5432; exit 0; fi
  if ! ready 5432 && command -v pg_lsclusters >/dev/null; then
    read -r ver name < <(pg_lsclusters -h 2>/dev/null | awk '$3 == 5432 {print $1, $2; exit}') || true
    if [ -n "${ver:-}" ]; then
      log "starting PostgreSQL cluster $ver/$name"
      as_root pg_ctlcluster "$ver" "$name" start || true
      for _ in $(seq 30); do ready 5432 && break; sleep 0.5; done
    fi
  fi
  if ready 5432 && make_test_db 5432 2>/dev/null; then url_for 5432; exit 0; fi
fi

# A private server, owned by an unprivileged user (initdb refuses to run as root).
dir="${FARM_PG_DIR:-/tmp/devicefarm-pg-$(id -u)}"
run_as=()
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
  run_as=(runuser -u postgres --)
fi
mkdir -p "$dir"
[ "$(id -u)" = 0 ] && chown postgres "$dir"
if [ -f "$dir/port" ] && ready "$(cat "$dir/port")"; then
  port="$(cat "$dir/port")"
else
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    log "initdb into $dir/data"
    "${run_as[@]}" "$(find_bin initdb)" -D "$dir/data" -U postgres --auth=trust -E UTF8 >"$dir/initdb.log" 2>&1 ||
      { log "error: initdb failed, see $dir/initdb.log"; exit 1; }
  fi
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  log "starting a private PostgreSQL on 127.0.0.1:$port"
  "${run_as[@]}" "$(find_bin pg_ctl)" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-h 127.0.0.1 -p $port -k $dir -c fsync=off" start >/dev/null ||
    { log "error: PostgreSQL did not start, see $dir/server.log"; exit 1; }
  echo "$port" >"$dir/port"
fi
make_test_db "$port"
url_for "$port"
