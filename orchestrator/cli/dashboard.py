"""`farm dashboard ...`: the farm's dashboard (orchestrator/dashboard). `serve` runs the farm's
server, whose pages are the live dashboard: it is `farm api serve` (one server, one default port,
8090; the pages ask for an API token); `build` writes the same pages and the JSON they read into
a folder that works offline, from file:// or any static server, with no token (default
<data_dir>/dashboard)."""

from __future__ import annotations

from pathlib import Path

import typer

from . import validate
from .api import HOST_OPTION, PORT_OPTION, run_server
from .common import cli_settings, could_not_run, fail
from .output import console

app = typer.Typer(help="The live dashboard (served by the farm API) and its offline copy.", no_args_is_help=True)

OUT_OPTION = typer.Option(None, "--out", help="Folder to write the site into (default: <data_dir>/dashboard).",
                          callback=validate.output_dir)


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
        could_not_run(str(exc))
    except DatabaseError as exc:
        could_not_run(f"cannot open the database: {exc.__class__.__name__}: {str(exc).splitlines()[0]}")
    except (OSError, ExportError) as exc:
        fail(f"cannot write the dashboard into {target}: {exc}")
    console.print(f"dashboard written: {index}", highlight=False, soft_wrap=True)


@app.command()
def serve(host: str = HOST_OPTION, port: int = PORT_OPTION):
    """Serve the live dashboard until interrupted: `farm api serve` (the dashboard at /, the API
    at /v1, its docs at /docs)."""
    run_server(host, port)
