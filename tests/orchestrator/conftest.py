"""Store fixtures (and `cli`, the farm CLI over a fresh SQLite store): every store test runs on a fresh SQLite file and on a fresh PostgreSQL
database. PostgreSQL comes from $FARM_TEST_POSTGRES_URL, else the local server at
127.0.0.1:5432 (scripts/ensure-postgres.sh starts one); each test gets its own database,
created from that server and dropped afterwards. With no server, the PostgreSQL variants are
skipped locally and fail in CI (CI=true), where a missing server is a broken setup."""

from __future__ import annotations

import os
import uuid

import pytest
from ci_support import missing
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def pg_server_url() -> str:
    """A URL of a database on a reachable PostgreSQL server, used to create test databases."""
    url = os.environ.get("FARM_TEST_POSTGRES_URL") or DEFAULT_PG_URL
    engine = create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001  (any failure to connect means "no server")
        message = f"no PostgreSQL at {make_url(url).render_as_string(hide_password=True)}: {exc}"
        missing(message, "CI needs one: scripts/ensure-postgres.sh")
    finally:
        engine.dispose()
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """The URL of a fresh, empty database (no schema yet)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'farm.db'}"
        return
    server = make_url(request.getfixturevalue("pg_server_url"))
    name = f"farm_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield server.set(database=name).render_as_string(hide_password=False)
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@pytest.fixture
def db_engine(db_url):
    """An engine on a database migrated to the newest revision."""
    from orchestrator.store import make_engine, upgrade

    upgrade(db_url)
    engine = make_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def Session(db_engine):  # noqa: N802  (a session factory, named like the class it makes)
    from orchestrator.store import make_session_factory

    return make_session_factory(db_engine)


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """A migrated, empty farm in tmp_path; `cli(*args)` invokes `farm` (exit 0 expected unless
    ok=False); `cli.Session` writes to its store."""
    yield from _farm_cli(tmp_path, monkeypatch, f"sqlite:///{tmp_path / 'farm.db'}")


@pytest.fixture
def cli_db(tmp_path, monkeypatch, db_url):
    """`cli` on each store: SQLite, then PostgreSQL."""
    yield from _farm_cli(tmp_path, monkeypatch, db_url)


def _farm_cli(tmp_path, monkeypatch, url):
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from orchestrator.store import make_engine, make_session_factory, upgrade

    monkeypatch.setenv("FARM_DATABASE_URL", url)
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("FARM_HOST_NAME", "testhost")
    monkeypatch.delenv("FARM_BROKER_URL", raising=False)
    monkeypatch.delenv("FARM_DEVICES", raising=False)
    upgrade(url)
    engine = make_engine(url)
    runner = CliRunner()

    def invoke(*args: str, ok: bool = True):
        result = runner.invoke(app, list(args))
        if ok:
            assert result.exit_code == 0, result.output
        return result

    invoke.Session = make_session_factory(engine)
    invoke.tmp = tmp_path
    yield invoke
    engine.dispose()

