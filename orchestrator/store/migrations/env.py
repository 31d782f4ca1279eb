"""Alembic environment for the farm's store: the target is orchestrator.store.models.Base.metadata;
the database is the connection or URL the caller put in config.attributes (see
orchestrator.store.migrate), else sqlalchemy.url, else the settings' database_url. Tables that are
not ours (a beat scheduler's own tables) are left out of autogenerate."""

from __future__ import annotations

from alembic import context

from orchestrator.store.models import Base, UTCDateTime
from orchestrator.store.session import make_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from orchestrator.infra.settings import load_settings

    return load_settings().database_url


def _include_object(obj, name, type_, reflected, compare_to):
    # A reflected table with no model belongs to someone else (e.g. sqlalchemy-celery-beat).
    return not (type_ == "table" and reflected and compare_to is None)


def _render_item(type_, obj, autogen_context):
    # Write our UTC type as the plain column type it stores, so migrations need no app import.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        include_object=_include_object,
        render_item=_render_item,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite ALTERs by table copy
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        include_object=_include_object,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _sqlite_foreign_keys(connection, "OFF")
            try:
                _configure(connection)
                with context.begin_transaction():
                    context.run_migrations()
            finally:
                _sqlite_foreign_keys(connection, "ON")
    finally:
        engine.dispose()


def _sqlite_foreign_keys(connection, state: str) -> None:
    """SQLite alters a table in batch mode by copying it, dropping the original and renaming the
    copy; with foreign keys enforced, that DROP deletes every row that refers to the table
    (altering `jobs` would delete every run). So they are not enforced while migrating. The
    PRAGMA is ignored inside a transaction, so it goes to the driver's connection, before any."""
    if connection.dialect.name == "sqlite":
        connection.connection.driver_connection.execute(f"PRAGMA foreign_keys={state}")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
