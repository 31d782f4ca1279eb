"""The compose stack's PostgreSQL init script (scripts/docker/postgres-init/grafana-readonly.sh)
run for real, as postgres' entrypoint runs it, against a fresh database on the test server;
then the store is migrated, as the stack's `migrate` service does after it. Grafana's role
reads every table, those the migrations made after the script included, and can change
nothing: no INSERT, UPDATE, DELETE, TRUNCATE, DROP or CREATE, even once it turns its
read-only default off."""

from __future__ import annotations

import os
import secrets
import subprocess
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

INIT_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docker" / "postgres-init" / "grafana-readonly.sh"
INSUFFICIENT_PRIVILEGE = "42501"
READ_ONLY_TRANSACTION = "25006"


@pytest.fixture
def fresh_store(pg_server_url):
    """(owner URL, role, password, environment of the init script) for a new, empty database;
    the database and the role are dropped afterwards (roles are server-wide)."""
    server = make_url(pg_server_url)
    name, role = f"farm_test_{uuid.uuid4().hex[:12]}", f"grafana_test_{uuid.uuid4().hex[:12]}"
    password = secrets.token_urlsafe(16)
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")} | {
        "PGHOST": server.host or "127.0.0.1", "PGPORT": str(server.port or 5432),
        "POSTGRES_USER": server.username, "POSTGRES_DB": name,
        "FARM_GRAFANA_DB_USER": role, "FARM_GRAFANA_DB_PASSWORD": password}
    if server.password:
        env["PGPASSWORD"] = server.password
    try:
        yield server.set(database=name), role, password, env
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


def run_init_script(env: dict[str, str]) -> None:
    done = subprocess.run(["sh", str(INIT_SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def sqlstate(engine, statement: str, writable: bool = False) -> str | None:
    """The SQLSTATE `statement` fails with on a fresh connection, or None if it runs."""
    with engine.connect() as conn:
        try:
            if writable:  # what a client that wants to write would do first
                conn.execute(text("SET TRANSACTION READ WRITE"))  # the first statement of its transaction
            conn.execute(text(statement))
        except DBAPIError as exc:
            return getattr(exc.orig, "sqlstate", None) or str(exc.orig)
        finally:
            conn.rollback()
    return None


def test_grafanas_role_reads_every_table_and_changes_nothing(fresh_store):
    from orchestrator.store import upgrade

    owner_url, role, password, env = fresh_store
    run_init_script(env)
    run_init_script(env)  # by hand on an existing volume: running it again is harmless
    upgrade(owner_url.render_as_string(hide_password=False))  # the migrations come after, as in the stack
    owner = create_engine(owner_url)
    with owner.begin() as conn:  # a table a later migration might add
        conn.execute(text("CREATE TABLE later_migration (id integer PRIMARY KEY, note text)"))
        conn.execute(text("INSERT INTO later_migration VALUES (1, 'kept')"))
    tables = inspect(owner).get_table_names()
    assert {"devices", "jobs", "later_migration"} <= set(tables), tables
    columns = {t: inspect(owner).get_columns(t)[0]["name"] for t in tables}
    owner.dispose()

    grafana = create_engine(owner_url.set(username=role, password=password))
    try:
        for table in tables:
            assert sqlstate(grafana, f'SELECT count(*) FROM "{table}"') is None, table
        with grafana.connect() as conn:
            assert conn.execute(text("SELECT note FROM later_migration")).scalar_one() == "kept"
        for table in tables:
            column = columns[table]
            for statement in (f'INSERT INTO "{table}" DEFAULT VALUES',
                              f'UPDATE "{table}" SET "{column}" = "{column}"',
                              f'DELETE FROM "{table}"',
                              f'TRUNCATE "{table}"',
                              f'DROP TABLE "{table}"'):
                assert sqlstate(grafana, statement) in {READ_ONLY_TRANSACTION, INSUFFICIENT_PRIVILEGE}, statement
                assert sqlstate(grafana, statement, writable=True) == INSUFFICIENT_PRIVILEGE, statement
        assert sqlstate(grafana, "CREATE TABLE mine (id integer)", writable=True) == INSUFFICIENT_PRIVILEGE
    finally:
        grafana.dispose()
    with create_engine(owner_url).connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM later_migration")).scalar_one() == 1


def test_the_init_script_refuses_to_run_without_the_roles_password(fresh_store):
    _, _, _, env = fresh_store
    done = subprocess.run(["sh", str(INIT_SCRIPT)], env={k: v for k, v in env.items()
                                                         if k != "FARM_GRAFANA_DB_PASSWORD"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "run farm secrets init" in done.stderr, done.stderr
