"""`farm db ...`: the store's schema: bring a database to the newest migration."""

from __future__ import annotations

import typer

from . import validate
from .common import BAD_INPUT, COULD_NOT_RUN
from .output import console

app = typer.Typer(help="Manage the farm's SQL database.", no_args_is_help=True)


@app.command()
def upgrade(
    url: str = typer.Option(None, "--url", help="Database URL (default: FARM_DATABASE_URL, "
                            "farm.toml, else the SQLite file in the data dir).", callback=validate.database_url),
    revision: str = typer.Option("head", help="Target revision."),
):
    """Create or migrate the database schema to the newest revision."""
    from orchestrator.infra.settings import load_settings
    from orchestrator.store import migrate

    settings = load_settings(database_url=url)
    try:
        migrate.upgrade(settings.database_url, revision)
    except Exception as exc:  # a revision unknown here (bad input); an unreachable server (could not run)
        console.print(f"[bold red]error:[/] database upgrade failed for {_safe(settings.database_url)}: "
                      f"{exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT if isinstance(exc, migrate.UnknownRevision) else COULD_NOT_RUN) from None
    console.print(f"database {_safe(settings.database_url)} is at revision {migrate.head_revision()}",
                  highlight=False, soft_wrap=True)


def _safe(url: str) -> str:
    """The URL with any password hidden."""
    from orchestrator.store.session import safe_url

    return safe_url(url)
