"""`farm dashboard ...`: the self-contained HTML dashboard (orchestrator/dashboard). `build`
writes it into a folder; `serve` rebuilds it and serves that folder over HTTP until stopped.
The default folder is <data_dir>/dashboard, and relative image paths of alerts are read under
data_dir."""

from __future__ import annotations

import functools
import http.server
from pathlib import Path

import typer

from . import validate
from .common import _settings, fail, open_store
from .output import console

app = typer.Typer(help="Build or serve the static HTML dashboard.", no_args_is_help=True)

OUT_OPTION = typer.Option(None, "--out", help="Folder to write the site into (default: <data_dir>/dashboard).",
                          callback=validate.output_dir)


def _build(out: Path | None) -> Path:
    from orchestrator.dashboard import build_site

    settings = _settings()
    target = out if out is not None else settings.data_dir / "dashboard"
    with open_store(settings) as sessions:
        try:
            return build_site(sessions, target, image_root=settings.data_dir)
        except OSError as exc:
            fail(f"cannot write the dashboard into {target}: {exc}")


@app.command()
def build(out: Path = OUT_OPTION):
    """Write the dashboard (index.html, alert pages, images) into a folder."""
    index = _build(out)
    console.print(f"dashboard written: {index}", highlight=False, soft_wrap=True)


@app.command()
def serve(
    port: int = typer.Option(8080, "--port", help="TCP port to listen on (0: any free one).",
                             parser=validate.listen_port),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on.", callback=validate.listen_host),
    out: Path = OUT_OPTION,
):
    """Rebuild the dashboard, then serve its folder over HTTP until interrupted."""
    index = _build(out)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(index.parent))
    try:
        server = http.server.ThreadingHTTPServer((host, port), handler)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc} (choose another --port)")
    with server:
        console.print(f"serving {index.parent} at http://{host}:{server.server_address[1]}/ (Ctrl-C stops)",
                      highlight=False, soft_wrap=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
