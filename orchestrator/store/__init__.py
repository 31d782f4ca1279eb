"""The SQL store: typed models (models) and enums (enums), engines and sessions (session), the
data-access functions the other layers call, one module per idea (devices, builds, jobs, results,
batches, schedules, series, alerts, change_points, images, profiles; rows: what they share) and
re-exported here (`from orchestrator import store; store.create_job(session, ...)`), the queries
the faces read (queries), notifications' rows (notifications), the device state machine
(device_states), what a run's environment is (environment) and Alembic migrations (migrate,
migrations/); the API's tokens and checks are rows of tokens and check_runs. The layers above
reach SQL only through it (the import-linter contracts in pyproject.toml keep it so). PostgreSQL
in production, a SQLite file as the embedded default; the schema comes only from migrations,
never from create_all."""

from . import (
    alerts,
    batches,
    builds,
    change_points,
    check_runs,
    devices,
    images,
    jobs,
    profiles,
    results,
    schedules,
    series,
    series_state,
    tokens,
)
from .alerts import *  # noqa: F403  (each module's __all__: the store's functions)
from .batches import *  # noqa: F403
from .builds import *  # noqa: F403
from .change_points import *  # noqa: F403
from .check_runs import *  # noqa: F403
from .devices import *  # noqa: F403
from .images import *  # noqa: F403
from .jobs import *  # noqa: F403
from .migrate import SchemaMismatch, check, upgrade
from .models import utcnow  # the store's clock
from .profiles import *  # noqa: F403
from .reservations import *  # noqa: F403  (devices people book, screenshots)
from .results import *  # noqa: F403
from .rows import InvalidTransition, StoreError, text_for_store
from .schedules import *  # noqa: F403
from .series import *  # noqa: F403
from .series_state import *  # noqa: F403
from .session import (
    DatabaseError,
    Session,
    SessionFactory,
    StatementError,
    make_engine,
    make_session_factory,
    read_snapshot,
    refused_value,
)
from .tokens import *  # noqa: F403

__all__ = ["DatabaseError", "InvalidTransition", "SchemaMismatch", "Session", "SessionFactory", "StoreError", "check", "make_engine",
           "make_session_factory", "read_snapshot", "refused_value", "StatementError",
           "text_for_store", "upgrade", "utcnow",
           *batches.__all__, *builds.__all__, *devices.__all__, *jobs.__all__, *results.__all__, *schedules.__all__,
           *check_runs.__all__, *tokens.__all__,
           *alerts.__all__, *change_points.__all__, *images.__all__, *profiles.__all__, *series.__all__,
           *series_state.__all__]
__all__ += reservations.__all__  # noqa: F405  (bound by the star import above)
