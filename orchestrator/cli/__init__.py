"""The `farm` command: one Typer sub-app per command group, joined here. Commands are thin:
they parse, call a service, and print with rich (or JSON with --json). Every error a user can
cause ends as one red line and a non-zero exit code, never a traceback; every verb's exit codes
are the one table of common.py (EXIT_CODES), shown under `farm --help` and in docs/cli.md."""

from __future__ import annotations

import sys

import typer

from engine.errors import EngineError

from . import api as api_cmd
from . import builds as builds_cmd
from . import ca as ca_cmd
from . import check as check_cmd
from . import dashboard as dashboard_cmd
from . import db as db_cmd
from . import demo as demo_cmd
from . import deploy as deploy_cmd
from . import devices as devices_cmd
from . import engine as engine_cmd
from . import jobs as jobs_cmd
from . import notify as notify_cmd
from . import profiles as profiles_cmd
from . import regressions as regressions_cmd
from . import results as results_cmd
from . import retention as retention_cmd
from . import schedules as schedules_cmd
from . import secrets as secrets_cmd
from . import stack as stack_cmd
from . import validate
from .common import BAD_INPUT, COULD_NOT_RUN, EXIT_CODES
from .output import err_console, escape, fit_help

fit_help()

EPILOG = "\b\nExit codes, every command:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())

app = typer.Typer(
    name="farm",
    cls=validate.FarmGroup,
    help="Ship Stable Diffusion to phones and GPU hosts, and prove every night it got faster.",
    epilog=EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"farm (devicefarm) {version('devicefarm')}")
        except PackageNotFoundError:
            typer.echo("farm (devicefarm): not installed as a package (pip install -e .)")
        raise typer.Exit()


@app.callback()
def root(
    show_version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit."),
) -> None:
    """Ship Stable Diffusion to phones and GPU hosts, and prove every night it got faster."""


app.add_typer(engine_cmd.app, name="engine")
app.add_typer(db_cmd.app, name="db")
app.add_typer(devices_cmd.app, name="devices")
app.add_typer(builds_cmd.app, name="builds")
app.add_typer(jobs_cmd.app, name="jobs")
app.add_typer(results_cmd.app, name="results")
app.add_typer(schedules_cmd.app, name="schedules")
app.add_typer(profiles_cmd.app, name="profiles")
app.add_typer(regressions_cmd.app, name="regressions")
app.add_typer(notify_cmd.app, name="notify")
app.add_typer(retention_cmd.app, name="retention")
app.add_typer(api_cmd.app, name="api")
results_cmd.app.command("compare")(regressions_cmd.compare)
app.command("bisect")(regressions_cmd.bisect)
app.command("check")(check_cmd.check)
app.add_typer(dashboard_cmd.app, name="dashboard")
app.add_typer(secrets_cmd.app, name="secrets")
app.add_typer(ca_cmd.app, name="ca")
app.command("deploy")(deploy_cmd.deploy)
app.command("worker")(stack_cmd.worker)
app.command("notifier")(stack_cmd.notifier)
app.command("beat")(stack_cmd.beat)
app.command("hub")(stack_cmd.hub)
app.command("up")(stack_cmd.up)
app.command("demo")(demo_cmd.demo)


def main() -> None:
    try:
        app(standalone_mode=True)
    except EngineError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(_engine_exit_code(exc))


def _engine_exit_code(exc: EngineError) -> int:
    """A bad model or argument is bad input; no adapter, or a GPU that failed, could not run."""
    from engine.errors import AdapterError, GPUError

    return COULD_NOT_RUN if isinstance(exc, (AdapterError, GPUError)) else BAD_INPUT


if __name__ == "__main__":
    main()
