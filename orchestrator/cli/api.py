"""`farm api ...`: the farm API (orchestrator/api). `serve` runs it under uvicorn (the same
server as `farm dashboard serve`: the dashboard at /, the API at /v1, its docs at /docs), on
port 8090 by default; `token create|list|revoke` manage its bearer tokens, whose plain text is
printed once, at creation, and stored nowhere (only its sha256 and first characters are kept):
`create` prints the token alone on stdout (`T=$(farm api token create ...)`), what it is on
stderr."""

from __future__ import annotations

from typing import Any

import typer

from . import validate
from .common import (
    JSON_OPTION,
    cli_settings,
    could_not_run,
    fail,
    iso,
    open_store,
    print_json_or_empty,
)
from .output import Table, console, err_console

app = typer.Typer(help="The farm API: serve it, and manage its bearer tokens.", no_args_is_help=True)
token_app = typer.Typer(help="Bearer tokens of the farm API: read, triage or run.", no_args_is_help=True)
app.add_typer(token_app, name="token")


def token_dict(row) -> dict[str, Any]:
    return {"id": row.id, "name": row.name, "scope": str(row.scope), "prefix": row.prefix,
            "created_at": iso(row.created_at), "last_used_at": iso(row.last_used_at),
            "revoked_at": iso(row.revoked_at)}


@token_app.command()
def create(
    scope: str = typer.Option(..., "--scope", help="read (everything), triage (read, and acknowledge, invalidate "
                              "or fix alerts) or run (read, and start checks)."),
    name: str = typer.Option("", "--name", help="Whose or what for (shown in `farm api token list`)."),
):
    """Make a token and print it, once: it is stored only as its hash."""
    from orchestrator import store
    from orchestrator.api import tokens

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:
            row, token = tokens.create_token(session, scope, name)
        except store.StoreError as exc:
            fail(str(exc))
        session.commit()
    err_console.print(f"API token {row.id} ({row.scope}{', ' + name if name else ''}); it is shown only now:",
                      highlight=False, markup=False)
    typer.echo(token)


@token_app.command("list")
def list_tokens(as_json: bool = JSON_OPTION):
    """Every token: id, name, scope, prefix, created, last used, revoked."""
    from orchestrator.api import tokens

    with open_store(cli_settings()) as sessions, sessions() as session:
        rows = [token_dict(t) for t in tokens.list_tokens(session)]
    if print_json_or_empty(rows, as_json, "no API tokens; `farm api token create --scope read` makes one"):
        return
    table = Table("id", "name", "scope", "prefix", "created", "last used", "revoked")
    for r in rows:
        table.add_row(str(r["id"]), r["name"] or "-", r["scope"], r["prefix"] + "…", _when(r["created_at"]),
                      _when(r["last_used_at"]) if r["last_used_at"] else "never",
                      _when(r["revoked_at"]) if r["revoked_at"] else "-")
    console.print(table)


def _when(value: str | None) -> str:
    return (value or "-")[:19].replace("T", " ")


@token_app.command()
def revoke(token_id: int = typer.Argument(..., help="Token id (`farm api token list`).", parser=validate.record_id)):
    """Revoke a token: the API refuses it from its next request on."""
    from orchestrator import store
    from orchestrator.api import tokens

    with open_store(cli_settings()) as sessions, sessions() as session:
        try:
            row = tokens.revoke_token(session, token_id)
        except store.StoreError as exc:
            fail(str(exc))
        session.commit()
    console.print(f"API token {row.id} ({row.scope}, {row.prefix}…) revoked", highlight=False, markup=False)


DEFAULT_PORT = 8090  # `farm api serve` and `farm dashboard serve`: one server

HOST_OPTION = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface).",
                           callback=validate.listen_host)
PORT_OPTION = typer.Option(DEFAULT_PORT, "--port", parser=validate.listen_port, help="Port (0: any free one).")


@app.command()
def serve(host: str = HOST_OPTION, port: int = PORT_OPTION):
    """Run the farm's server until stopped: the dashboard at /, the API at /v1 (OpenAPI at
    /openapi.json), its interactive docs at /docs and /redoc."""
    run_server(host, port)


def run_server(host: str, port: int) -> None:
    """`farm api serve` and `farm dashboard serve`: one line saying where everything is, then
    the server; a port in use is one line and exit code 4."""
    from orchestrator.api import serving
    from orchestrator.api.app import create_app
    from orchestrator.store import migrate

    settings = cli_settings()
    try:
        serving.check_listen(host, port)
    except serving.CannotListen as exc:
        could_not_run(str(exc))
    try:
        api = create_app(settings)
    except migrate.SchemaMismatch as exc:
        could_not_run(str(exc))
    base = f"http://{_shown(host, settings.host_name)}:{port}"
    console.print(f"dashboard {base}/  ·  API {base}/v1  ·  docs {base}/docs", highlight=False, soft_wrap=True)
    console.print("a token for the dashboard and the API: farm api token create --scope read (or triage, run)",
                  highlight=False, soft_wrap=True)
    serving.serve(api, host, port, settings)


def _shown(host: str, host_name: str) -> str:
    """How a browser reaches `host`: every interface is reached by this host's name."""
    if host in ("0.0.0.0", "::", ""):
        host = host_name
    return f"[{host}]" if ":" in host else host
