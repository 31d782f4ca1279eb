#!/bin/sh
# The official postgres image's first start, as far as docker-compose.yml uses it: on an empty
# $PGDATA, a cluster owned by $POSTGRES_USER with $POSTGRES_PASSWORD (scram-sha-256 over TCP,
# trust on the container's own socket), the database $POSTGRES_DB, then the scripts of
# /docker-entrypoint-initdb.d (*.sh run, or sourced when not executable; *.sql through psql)
# against a server that listens only on a socket of its own, so that the health check
# (pg_isready on the usual socket) does not pass before the first start is done. Then, and on
# every later start, the server on all addresses.
set -eu
: "${POSTGRES_PASSWORD:?no POSTGRES_PASSWORD}"
POSTGRES_USER="${POSTGRES_USER:-postgres}"
POSTGRES_DB="${POSTGRES_DB:-$POSTGRES_USER}"
export POSTGRES_USER POSTGRES_DB

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 --locale=C.UTF-8 -D "$PGDATA"
    rm -f "$pwfile"
    printf 'host all all all scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
    PGHOST="$(mktemp -d)"
    export PGHOST
    pg_ctl -D "$PGDATA" -o "-c listen_addresses='' -c unix_socket_directories='$PGHOST'" -w start
    if [ "$POSTGRES_DB" != postgres ]; then
        echo 'CREATE DATABASE :"db";' | psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" \
            --dbname postgres -v db="$POSTGRES_DB"
    fi
    for f in /docker-entrypoint-initdb.d/*; do
        case "$f" in
            *.sh) if [ -x "$f" ]; then "$f"; else (. "$f"); fi ;;
            *.sql) psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" -f "$f" ;;
        esac
    done
    pg_ctl -D "$PGDATA" -m fast -w stop
    rmdir "$PGHOST"
    unset PGHOST
fi
if [ "$1" = postgres ]; then
    shift
    exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
fi
exec "$@"
