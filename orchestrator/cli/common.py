"""What the CLI's commands share: settings, the store, the exit codes and the two ways to fail,
JSON output.

Every `farm` verb ends with one of these exit codes (docs/cli.md; `farm --help` shows them):

    0  ok
    1  a finding: a regression, a failed check
    2  undecided: `farm check` ran but its budget did not settle the question
    3  bad input: an unknown build, device, alert or file, a bad value, a usage error
       (a missing option, an unknown flag or command)
    4  could not run: no worker, time ran out, a job failed, the store unreachable

`fail(message)` ends a command for bad input, `could_not_run(message)` when the input was fine
but the farm could not do the work; each prints one red line naming the fix."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import typer
from rich.markup import escape

from .output import console

JSON_OPTION = typer.Option(False, "--json", help="Print machine-readable JSON.")

OK, FINDING, UNDECIDED, BAD_INPUT, COULD_NOT_RUN = 0, 1, 2, 3, 4
EXIT_CODES = {OK: "ok", FINDING: "a finding (a regression, a failed check)",
              UNDECIDED: "undecided (farm check: the budget did not settle it)",
              BAD_INPUT: "bad input (unknown build, device, alert or file; a bad value; a missing option or "
                         "unknown flag)",
              COULD_NOT_RUN: "could not run (no worker, time ran out, a job failed, the store unreachable)"}

T = TypeVar("T")


# ---- shared by the store-backed commands --------------------------------------------------


def fail(message: str) -> NoReturn:
    """Bad input: one red line and exit code 3, how every error a user can cause ends."""
    error_line(message)
    raise typer.Exit(BAD_INPUT)


def current_user() -> str:
    """Who runs this command, as a reservation names its holder ($USER; "" when unknown)."""
    return os.environ.get("USER") or os.environ.get("USERNAME") or ""


def could_not_run(message: str) -> NoReturn:
    """The input was fine but the work could not be done (no worker, time ran out, a job
    failed, the store unreachable): one red line and exit code 4."""
    error_line(message)
    raise typer.Exit(COULD_NOT_RUN)


def error_line(message: str) -> None:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


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
            could_not_run(str(exc))
        except DatabaseError as exc:
            could_not_run(f"cannot open the database: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
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
