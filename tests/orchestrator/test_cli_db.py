"""`farm db upgrade`: migrates the database the settings name, or the one given by --url."""

from __future__ import annotations

from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.store import check


def test_db_upgrade_with_url(tmp_path):
    url = f"sqlite:///{tmp_path / 'farm.db'}"
    result = CliRunner().invoke(app, ["db", "upgrade", "--url", url])
    assert result.exit_code == 0, result.output
    assert "at revision" in result.output
    check(url)


def test_db_upgrade_reads_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("FARM_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("FARM_DATABASE_URL", raising=False)
    result = CliRunner().invoke(app, ["db", "upgrade"])
    assert result.exit_code == 0, result.output
    check(f"sqlite:///{tmp_path / 'data' / 'farm.db'}")


def test_db_upgrade_bad_revision_is_one_error_line(tmp_path):
    result = CliRunner().invoke(app, ["db", "upgrade", "--url", f"sqlite:///{tmp_path / 'f.db'}",
                                      "--revision", "nope"])
    assert result.exit_code == 3  # bad input: a revision unknown here
    assert "error:" in result.output and "Traceback" not in result.output


def test_db_upgrade_of_a_server_not_there_could_not_run(tmp_path):
    result = CliRunner().invoke(app, ["db", "upgrade", "--url", "postgresql+psycopg://farm@127.0.0.1:1/farm"])
    assert result.exit_code == 4  # could not run: nothing answers there
    assert "error:" in result.output and "Traceback" not in result.output


def test_db_upgrade_of_a_store_a_newer_farm_migrated_could_not_run(tmp_path):
    """A database at a revision this code does not have (a newer devicefarm migrated it) is the
    farm's trouble, not the asker's: exit 4, one line saying so."""
    from sqlalchemy import create_engine, text

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    assert CliRunner().invoke(app, ["db", "upgrade", "--url", url]).exit_code == 0
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))
    engine.dispose()
    result = CliRunner().invoke(app, ["db", "upgrade", "--url", url])
    assert result.exit_code == 4, result.output
    assert "migrated by a newer devicefarm" in " ".join(result.output.split()) and "Traceback" not in result.output
