"""`farm`, the control plane's command: orchestrator.cli, once its packages are there. A
device-side install (`pip install devicefarm`: the engine and `farm-agent`) leaves them out;
there `farm` says which extra brings them instead of failing on an import."""

from __future__ import annotations

import sys

# The farm extra's packages, as imported (pyproject.toml [project.optional-dependencies] farm).
CONTROL_PLANE = frozenset({"adb_shell", "alembic", "celery", "croniter", "fastapi", "kombu", "psycopg",
                           "pydantic_settings", "redis", "scipy", "segno", "sqlalchemy", "uvicorn"})


def __getattr__(name: str):
    """`app`: the Typer app behind `farm`, for what inspects a console script's module (the
    compose tests check every command a service runs against it)."""
    if name == "app":
        from orchestrator.cli import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> None:
    try:
        from orchestrator.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in CONTROL_PLANE:
            raise
        sys.stderr.write(f"error: `farm` is the control plane, and this install has the device side only "
                         f"(no {exc.name}): pip install 'devicefarm[farm]' adds it; `farm-agent` runs as it is\n")
        sys.exit(1)
    cli_main()


if __name__ == "__main__":
    main()
