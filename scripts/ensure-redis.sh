#!/usr/bin/env bash
# Make sure a Redis server is reachable for the broker tests and print the URL to give them
# (FARM_TEST_REDIS_URL); progress goes to stderr. In order:
#   1. $FARM_TEST_REDIS_URL when set and reachable (nothing is started);
#   2. a private redis-server started earlier by this script and still running;
#   3. a new private redis-server on a free port of 127.0.0.1, its data and log in
#      $FARM_REDIS_DIR (default /tmp/devicefarm-redis-$UID), reused by later runs
#      (stop: redis-cli -p "$(cat DIR/port)" shutdown nosave).
# Redis is installed with apt-get (Debian package redis-server) when no redis-server is found,
# in every case: tests/orchestrator/test_broker_redis.py also runs a redis-server of its own.
# Use: export FARM_TEST_REDIS_URL="$(bash scripts/ensure-redis.sh)"
set -euo pipefail
log() { echo "ensure-redis: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi; }
# PING over a plain TCP socket: needs neither redis-cli nor the redis Python package.
ping_url() {
  python3 - "$1" <<'PY'
import socket, sys
from urllib.parse import urlsplit
url = urlsplit(sys.argv[1])
try:
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=3) as s:
        if url.password:
            s.sendall(f"AUTH {url.password}\r\n".encode())
            s.recv(64)
        s.sendall(b"PING\r\n")
        sys.exit(0 if s.recv(64).startswith(b"+PONG") else 1)
except OSError:
    sys.exit(1)
PY
}
url_for() { echo "redis://127.0.0.1:$1/0"; }

# Installed even when a server is given: the broker-restart test starts (and kills) its own.
if ! command -v redis-server >/dev/null; then
  log "installing Redis (apt-get install redis-server)"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null 2>&1 ||
    { as_root apt-get update -qq >/dev/null && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } ||
    { log "error: no redis-server and apt-get could not install it"; exit 1; }
fi

if [ -n "${FARM_TEST_REDIS_URL:-}" ]; then
  if ping_url "$FARM_TEST_REDIS_URL"; then echo "$FARM_TEST_REDIS_URL"; exit 0; fi
  log "FARM_TEST_REDIS_URL is set but not reachable; starting a local server"
fi

dir="${FARM_REDIS_DIR:-/tmp/devicefarm-redis-$(id -u)}"
if [ -f "$dir/port" ] && ping_url "$(url_for "$(cat "$dir/port")")"; then url_for "$(cat "$dir/port")"; exit 0; fi

mkdir -p "$dir"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log "starting a private redis-server on 127.0.0.1:$port (data in $dir)"
# Deliberately not the Debian service: a private server leaves the system one alone and needs no root.
redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --daemonize yes --pidfile "$dir/redis.pid" \
  --logfile "$dir/redis.log" --save "" --appendonly no >/dev/null ||
  { log "error: redis-server did not start, see $dir/redis.log"; exit 1; }
for _ in $(seq 50); do ping_url "$(url_for "$port")" && break; sleep 0.1; done
ping_url "$(url_for "$port")" || { log "error: redis-server on port $port does not answer, see $dir/redis.log"; exit 1; }
echo "$port" >"$dir/port"
url_for "$port"
