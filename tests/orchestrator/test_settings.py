"""Settings precedence: defaults < config file < FARM_* environment < command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from orchestrator.infra.settings import load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in ("FARM_DATABASE_URL", "FARM_BROKER_URL", "FARM_DATA_DIR", "FARM_CONFIG_DIR", "FARM_HOST_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _write_config(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "farm.toml").write_text(text)
    return directory


def test_defaults(tmp_path):
    import socket

    s = load_settings()
    assert s.data_dir == tmp_path / "data" / "devicefarm"
    assert s.config_dir == tmp_path / "config" / "devicefarm"
    assert s.database_url == f"sqlite:///{tmp_path / 'data' / 'devicefarm' / 'farm.db'}"
    assert s.broker_url is None and s.broker_dir == s.data_dir / "broker"
    assert s.host_name == socket.gethostname()


def test_precedence_file_env_command_line(tmp_path, monkeypatch):
    _write_config(tmp_path / "config" / "devicefarm",
                  'host_name = "from-file"\nbroker_url = "redis://file:6379/0"\n'
                  'database_url = "postgresql+psycopg://file/farm"\n')
    s = load_settings()
    assert (s.host_name, s.broker_url, s.database_url) == (
        "from-file", "redis://file:6379/0", "postgresql+psycopg://file/farm")

    monkeypatch.setenv("FARM_HOST_NAME", "from-env")
    monkeypatch.setenv("FARM_BROKER_URL", "redis://env:6379/0")
    s = load_settings()
    assert (s.host_name, s.broker_url, s.database_url) == (
        "from-env", "redis://env:6379/0", "postgresql+psycopg://file/farm")

    s = load_settings(host_name="from-cli", database_url=None)  # None: option not given
    assert (s.host_name, s.broker_url, s.database_url) == (
        "from-cli", "redis://env:6379/0", "postgresql+psycopg://file/farm")


def test_data_dir_moves_the_default_database(tmp_path, monkeypatch):
    monkeypatch.setenv("FARM_DATA_DIR", str(tmp_path / "elsewhere"))
    assert load_settings().database_url == f"sqlite:///{tmp_path / 'elsewhere' / 'farm.db'}"


def test_config_file_is_found_in_the_config_dir_given_by_env_or_command_line(tmp_path, monkeypatch):
    env_dir = _write_config(tmp_path / "env-config", 'host_name = "env-dir"\n')
    cli_dir = _write_config(tmp_path / "cli-config", 'host_name = "cli-dir"\n')
    monkeypatch.setenv("FARM_CONFIG_DIR", str(env_dir))
    assert load_settings().host_name == "env-dir"
    s = load_settings(config_dir=cli_dir)
    assert (s.host_name, s.config_dir, s.config_file) == ("cli-dir", cli_dir, cli_dir / "farm.toml")


def test_unknown_key_in_config_file_is_an_error(tmp_path):
    _write_config(tmp_path / "config" / "devicefarm", 'databse_url = "typo"\n')
    with pytest.raises(ValidationError, match="databse_url"):
        load_settings()
