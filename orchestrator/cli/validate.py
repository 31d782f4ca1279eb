"""The `farm` CLI's checks on what a user types, as Typer callbacks and parsers: device
addresses, serials, host and build names, ids, ports, database URLs and paths are each checked
once, where the argument enters, by the parsers of orchestrator/infra/inputs.py. A bad value is a
usage error shown as the CLI's one red line, `error: Invalid value for '--x': ...`, naming the
value and the fix; `FarmGroup` makes every usage error Click finds (a missing option, an
unknown flag or command) end the same way instead of in a framed usage box, with the exit code
of bad input (3) for every verb: Click's own 2 means "undecided" in this CLI's table (common.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape
from typer.core import TyperGroup

from orchestrator.infra import inputs

from .common import BAD_INPUT
from .output import err_console

USAGE_ERROR = BAD_INPUT


class FarmGroup(TyperGroup):
    """The root command: any usage error on it or below it (bad value, missing option, unknown
    flag or command) is printed as one red line and exits 3, bad input."""

    def make_context(self, *args, **kwargs) -> typer.Context:
        try:
            return super().make_context(*args, **kwargs)
        except typer.TyperException as exc:  # `farm --bogus`: before any command runs
            _usage_error(exc)

    def invoke(self, ctx: typer.Context) -> Any:
        # TyperException is the base of Typer's (vendored) Click errors: usage errors and the rest.
        try:
            return super().invoke(ctx)
        except typer.TyperException as exc:
            _usage_error(exc)


def _usage_error(exc: Exception) -> None:
    if type(exc).__name__ == "NoArgsIsHelpError":
        exc.exit_code = USAGE_ERROR  # `farm devices` alone prints its help, as before: a command is missing
        raise exc
    message = " ".join(exc.format_message().split())  # Click lists choices on several lines
    usage_ctx = getattr(exc, "ctx", None)
    if not isinstance(exc, typer.BadParameter) and usage_ctx is not None:
        message += f" (`{usage_ctx.command_path} --help` lists what it takes)"
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(USAGE_ERROR) from None


def _checked(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A callback that passes None (option not given) through and turns BadInput into the
    usage error Click reports against the option."""

    def callback(value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(value)
        except inputs.BadInput as exc:
            raise typer.BadParameter(str(exc)) from None

    callback.__name__ = check.__name__
    return callback


def _each(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The same for a repeatable option (a list, or None when not given)."""
    one = _checked(check)

    def callback(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else [one(v) for v in values]

    callback.__name__ = check.__name__
    return callback


# ---- names and ids ------------------------------------------------------------------------

serial = _checked(inputs.check_serial)
host_name = _checked(inputs.check_host_name)
build_name = _checked(inputs.check_build_name)
build_version = _checked(lambda v: inputs.check_build_name(v, "build version"))
path_in_build = _checked(lambda v: inputs.check_relative_path("path", v))


def record_id(value: str) -> int:
    """A parser for the numeric id of a job, run or alert: a whole number from 1 up."""
    try:
        number = int(str(value).strip(), 10)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not an id: give a whole number (the `list` command shows "
                                 "them)") from None
    if number < 1:
        raise typer.BadParameter(f"{number} is not an id: ids start at 1")
    return number


def listen_port(value: str) -> int:
    """A parser for a port to listen on: 0 (any free port) to 65535."""
    return 0 if str(value).strip() == "0" else _checked(inputs.parse_port)(value)


listen_host = _checked(lambda v: inputs.check_host(v, "listen address"))


# ---- device addresses ---------------------------------------------------------------------


def device_address(ctx: typer.Context, value: str) -> str:
    """--address of `farm devices add`, checked against --transport (which is eager, so parsed
    first wherever it stands on the command line); returns the canonical form to store."""
    transport = ctx.params.get("transport")
    if transport is None:  # --transport missing: Click reports that instead
        return value
    if str(transport) == "local" and value:
        value = local_root(value)
    try:
        return str(inputs.parse_device_address(str(transport), value))
    except inputs.BadInput as exc:
        raise typer.BadParameter(str(exc)) from None


def local_root(value: str) -> str:
    """A local device's agent root as typed, made absolute (the worker that uses it may run in
    another folder); refused when it is a file."""
    path = Path(os.path.abspath(Path(value).expanduser()))
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{value} is a file; a local device's address is its agent root folder")
    return str(path)


def _device_entry(value: str) -> str:
    from orchestrator.infra.settings import parse_device_entry

    try:
        parse_device_entry(value)
    except ValueError as exc:
        raise inputs.BadInput(str(exc)) from None
    return value


device_entries = _each(_device_entry)


def database_url(value: str) -> str:
    """--url of `farm db upgrade`: a URL SQLAlchemy can read."""
    from orchestrator.store.session import check_url

    if value is None:
        return None
    try:
        check_url(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a database URL; give e.g. sqlite:////var/lib/farm/farm.db "
                                 "or postgresql+psycopg://farm@db-host/farm") from None
    return value


# ---- paths --------------------------------------------------------------------------------
# Paths that must exist (a model, a profiles folder, an image) are checked by the code that
# reads them, with messages of their own; what is checked here are the paths a command writes
# to, which were otherwise found to be of the wrong kind only after the work was done.


def _output_check(kind: str) -> Callable[[Path], Path]:
    def check(value: Path) -> Path:
        path = Path(value).expanduser()
        if kind == "file" and path.is_dir():
            raise inputs.BadInput(f"{value} is a folder; give a file name to write")
        if kind == "dir" and path.exists() and not path.is_dir():
            raise inputs.BadInput(f"{value} is a file; give a folder to write into")
        return value

    check.__name__ = f"output_{kind}"
    return check


output_file = _checked(_output_check("file"))
output_dir = _checked(_output_check("dir"))


# ---- the run settings every verb that runs the engine shares ------------------------------
# One name, one default and one minimum for one idea, whichever verb takes it (check, jobs
# submit, schedules add, engine fit/plan): tests/orchestrator/test_cli_fit.py holds them equal.

# The check's analysis needs at least 5 timed generations per run to decide anything.
REPETITIONS = 5
UNET_REPETITIONS = 10
PRECISION = "fp16"
PRECISION_HELP = ("fp16, f16-storage or fp32 (fp16 runs as f16-storage where an adapter lacks "
                  "shader-f16).")


def _precision(value: str) -> str:
    from engine.kernels import PRECISIONS

    if value not in PRECISIONS:
        raise inputs.BadInput(f"unknown precision {value!r}; choose {', '.join(PRECISIONS)}")
    return value


precision = _checked(_precision)


def _resolution(value: str) -> tuple[int, int]:
    """HEIGHTxWIDTH (512x512) or one size (512) as (height, width), multiples of 8."""
    height, sep, width = str(value).strip().lower().partition("x")
    try:
        h, w = int(height), int(width) if sep else int(height)
    except ValueError:
        raise inputs.BadInput(f"{value!r}: give HEIGHTxWIDTH (512x512) or one size (512)") from None
    if h <= 0 or w <= 0 or h % 8 or w % 8:
        raise inputs.BadInput(f"{value!r}: height and width must be positive multiples of 8")
    return h, w


resolution = _checked(_resolution)


def precision_option(default: str | None = PRECISION, help: str = PRECISION_HELP) -> Any:  # noqa: A002
    return typer.Option(default, "--precision", callback=precision, help=help)


def resolution_option(help: str = "Image size, HEIGHTxWIDTH (512x512) or one number for a square; "  # noqa: A002
                      "multiples of 8 (default: the model's native size).") -> Any:
    return typer.Option(None, "--resolution", metavar="HxW", callback=resolution, help=help)


def repetitions_option(help: str = "Timed generations per run (at least 5: the regression analysis "  # noqa: A002
                       "needs 5 to decide).") -> Any:
    return typer.Option(REPETITIONS, "--repetitions", min=REPETITIONS, help=help)


def unet_repetitions_option(help: str = "Timed UNet steps per run (at least 5).") -> Any:  # noqa: A002
    return typer.Option(UNET_REPETITIONS, "--unet-repetitions", min=REPETITIONS, help=help)
