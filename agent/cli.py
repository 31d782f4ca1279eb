"""`farm-agent`: the device-side command. For now it reports what the device's GPU is; jobs,
bundles and the network agent are added on top of this entry point."""

from __future__ import annotations

import json
import platform
import sys

import typer

from engine.errors import EngineError

app = typer.Typer(name="farm-agent", help="The devicefarm agent that runs on each device.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def _root():
    """The devicefarm agent that runs on each device."""


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON.")):
    """Report this device's WebGPU adapter and operating system."""
    from engine.device import get_gpu

    data = {
        "adapter": get_gpu().caps.as_dict(),
        "os": {"system": platform.system(), "release": platform.release(), "machine": platform.machine()},
        "python": platform.python_version(),
    }
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        a = data["adapter"]
        typer.echo(f"{a['device']} ({a['backend']}, {a['adapter_type']}) on {data['os']['system']} {data['os']['release']}")


def main() -> None:
    try:
        app()
    except EngineError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(1)
