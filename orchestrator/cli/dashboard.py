"""`farm dashboard ...`: the farm's dashboard (orchestrator/dashboard). `serve` runs the farm
API, whose pages are the live dashboard (the same app as `farm api serve`, on port 8080 by
default; the pages ask for an API token); `build` writes the same pages and the JSON they read
into a folder that works offline, from file:// or any static server, with no token (default
<data_dir>/dashboard)."""

from __future__ import annotations

from pathlib import Path

import typer

from . import validate
from .common import cli_settings, fail
from .output import console, field

app = typer.Typer(help="The live dashboard (served by the farm API) and its offline copy.", no_args_is_help=True)

OUT_OPTION = typer.Option(None, "--out", help="Folder to write the site into (default: <data_dir>/dashboard).",
                          callback=validate.output_dir)


def _app(settings):
    from orchestrator.api.app import create_app
    from orchestrator.store import migrate

    try:
        return create_app(settings)
    except migrate.SchemaMismatch as exc:
        fail(str(exc))


@app.command()
def build(out: Path = OUT_OPTION):
    """Write the dashboard's pages and the JSON they read into a folder (offline: no token)."""
    from orchestrator.api.offline import ExportError, export_site
    from orchestrator.store import migrate
    from orchestrator.store.session import DatabaseError

    settings = cli_settings()
    target = out if out is not None else settings.data_dir / "dashboard"
    try:
        index = export_site(settings, target)
    except migrate.SchemaMismatch as exc:
        fail(str(exc))
    except DatabaseError as exc:
        fail(f"cannot open the database: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    except (OSError, ExportError) as exc:
        fail(f"cannot write the dashboard into {target}: {exc}")
    console.print(f"dashboard written: {index}", highlight=False, soft_wrap=True)


@app.command()
def serve(
    port: int = typer.Option(8080, "--port", help="TCP port to listen on (0: any free one).",
                             parser=validate.listen_port),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on.", callback=validate.listen_host),
):
    """Serve the live dashboard (the farm API and its pages) until interrupted."""
    from orchestrator.api import serving

    settings = cli_settings()
    api = _app(settings)
    field(console, "dashboard", f"http://{host}:{port}/  (a token: farm api token create --scope read)")
    serving.serve(api, host, port, settings)
