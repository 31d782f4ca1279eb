"""What the CLI's commands share: settings, the store, one way to fail, JSON output."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import typer
from rich.markup import escape

from .output import console

JSON_OPTION = typer.Option(False, "--json", help="Print machine-readable JSON.")

T = TypeVar("T")


# ---- shared by the store-backed commands --------------------------------------------------


def fail(message: str) -> NoReturn:
    """One red line and exit code 1: how every error a user can cause ends."""
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@contextmanager
def open_store(settings) -> Iterator[Any]:
    """A session factory on the settings' database, after checking that its schema is the one
    this code needs (the CLI never migrates on its own: `farm db upgrade` does)."""
    from orchestrator.store import make_engine, make_session_factory, migrate
    from orchestrator.store.session import DatabaseError

    engine = make_engine(settings.database_url)
    try:
        try:
            migrate.check(engine)
        except migrate.SchemaMismatch as exc:
            fail(str(exc))
        except DatabaseError as exc:
            fail(f"cannot open the database: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
        yield make_session_factory(engine)
    finally:
        engine.dispose()


def get_or_fail(get: Callable[[Any, Any], T], session, key, error: type[Exception] | None = None) -> T:
    """``get(session, key)``, or the store's message as the command's error when there is no
    such row (``error``: what ``get`` raises then; the store's StoreError by default)."""
    from orchestrator.store import StoreError

    missing = error or StoreError
    try:
        return get(session, key)
    except missing as exc:
        fail(str(exc))


def iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def cli_settings(**overrides):
    """The settings for this command: FARM_* environment and config file, then `overrides`
    (command-line values; None = not given)."""
    from orchestrator.infra.settings import load_settings

    return load_settings(**overrides)


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2))


def print_json_or_empty(rows: list, as_json: bool, empty: str) -> bool:
    """What a list command prints before its table: the rows as JSON with --json, or the line
    `empty` when there are none. True when that was everything (the command returns)."""
    if as_json:
        print_json(rows)
        return True
    if not rows:
        console.print(empty)
        return True
    return False
