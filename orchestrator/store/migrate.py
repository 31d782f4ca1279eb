"""Schema migrations, driven from Python (no alembic.ini): `upgrade(url)` brings a database to
the newest revision, `check(url)` tells whether a database matches this code's schema. The
`farm db upgrade` command and the docker-compose migration service both call `upgrade`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine

from .session import make_engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class SchemaMismatch(RuntimeError):
    """The database's revision is not the one this code expects."""


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if url:
        cfg.attributes["url"] = url
    return cfg


class UnknownRevision(ValueError):
    """A revision this code's migrations do not have (`farm db upgrade --revision`)."""


class UnknownStoreRevision(RuntimeError):
    """The database is at a revision this code's migrations do not have: a newer devicefarm
    migrated it. Not the asker's mistake: this farm's code is older than its store."""


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` to `revision` (the newest by default); UnknownRevision
    when the migrations have no such revision, UnknownStoreRevision when the database is at one
    they do not have."""
    cfg = alembic_config(url)
    if revision not in ("head", "heads"):
        try:
            known = ScriptDirectory.from_config(cfg).get_revision(revision) is not None
        except Exception:  # noqa: BLE001  (alembic's CommandError or ResolutionError: not a revision here)
            known = False
        if not known:
            raise UnknownRevision(f"no revision {revision!r} in this devicefarm's migrations (its newest is "
                                  f"{head_revision()})")
    try:
        command.upgrade(cfg, revision)
    except CommandError as exc:
        raise UnknownStoreRevision(f"{exc}: the database was migrated by a newer devicefarm than this one "
                                   f"(whose newest revision is {head_revision()}); run this farm's newer "
                                   "code against it") from exc


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def check(url_or_engine: str | Engine) -> None:
    """Raise SchemaMismatch naming both revisions and the fix unless the database is at head."""
    engine = make_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    try:
        current, head = current_revision(engine), head_revision()
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()
    if current != head:
        fix = ("run `farm db upgrade`" if current is None or current in _known_revisions()
               else "this database was migrated by a newer devicefarm: upgrade devicefarm")
        raise SchemaMismatch(f"database is at revision {current or 'none (empty)'}, this code "
                             f"needs {head}: {fix}")


def _known_revisions() -> set[str]:
    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}
