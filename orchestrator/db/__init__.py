"""The SQL store: typed models (models), engines and sessions (session), data-access functions
(store) and Alembic migrations (migrate, migrations/). PostgreSQL in production, a SQLite file as
the embedded default; the schema comes only from migrations, never from create_all."""

from .migrate import SchemaMismatch, check, upgrade
from .session import make_engine, make_session_factory

__all__ = ["SchemaMismatch", "check", "make_engine", "make_session_factory", "upgrade"]
