#!/bin/sh
# Grafana's read-only role on the farm's store: it may read every table of the public schema,
# those the migrations create later included (default privileges of the role that runs them,
# the store's owner), and change nothing. docker-compose.yml mounts this folder as postgres'
# /docker-entrypoint-initdb.d, so it runs once, when postgres initialises an empty volume; on a
# volume made before, run it by hand (it can run again; it resets the role's password):
#   docker compose exec postgres sh /docker-entrypoint-initdb.d/grafana-readonly.sh
# Reads POSTGRES_USER (the owner), POSTGRES_DB, FARM_GRAFANA_DB_USER, FARM_GRAFANA_DB_PASSWORD;
# psql's connection comes from the PG* environment (the local socket inside the container).
set -eu
: "${POSTGRES_USER:?the store owner (postgres service environment)}"
: "${FARM_GRAFANA_DB_USER:?the read-only role to create}"
: "${FARM_GRAFANA_DB_PASSWORD:?its password: run farm secrets init}"
db="${POSTGRES_DB:-$POSTGRES_USER}"

psql -v ON_ERROR_STOP=1 --no-psqlrc --quiet --username "$POSTGRES_USER" --dbname "$db" \
    -v owner="$POSTGRES_USER" -v db="$db" \
    -v role="$FARM_GRAFANA_DB_USER" -v password="$FARM_GRAFANA_DB_PASSWORD" <<'SQL'
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'role') AS new_role \gset
\if :new_role
CREATE ROLE :"role" LOGIN PASSWORD :'password';
\else
ALTER ROLE :"role" LOGIN PASSWORD :'password';
\endif
-- Even if a grant slips in later, this role's sessions start read-only.
ALTER ROLE :"role" SET default_transaction_read_only = on;
GRANT CONNECT ON DATABASE :"db" TO :"role";
-- PostgreSQL 15 already keeps CREATE on public from everyone; older servers do not.
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO :"role";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"role";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO :"role";
SQL
