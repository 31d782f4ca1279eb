"""Shell completion of what the store names: builds (ids, labels, names), device serials, open
alerts' ids and schedule names, for the options and arguments that take them (Typer's
`autocompletion=`). A completer runs on every Tab, so it reads the store once, briefly, in a
read-only snapshot, and never fails: with no store yet, an unreachable one or one of another
schema, it suggests nothing rather than print an error into the user's command line."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# An unreachable PostgreSQL must not hang the user's Tab.
CONNECT_TIMEOUT_S = 2
# Alerts are many; the open ones, newest first, are the ones a command is typed about.
ALERT_LIMIT = 200


@contextmanager
def _snapshot() -> Iterator[Any]:
    """A read-only session on the farm's store, or None when there is none to read."""
    from orchestrator.store import make_session_factory, read_snapshot
    from orchestrator.store.session import make_unpooled_engine

    from .common import cli_settings

    url = cli_settings().database_url
    if url.startswith("sqlite"):
        database = url.partition(":///")[2].partition("?")[0]
        if not database or database == ":memory:" or not Path(database).expanduser().is_file():
            yield None  # no farm here yet: opening the file would make an empty one
            return
    engine = make_unpooled_engine(url, CONNECT_TIMEOUT_S)
    try:
        with make_session_factory(engine)() as session, session.begin():
            read_snapshot(session)
            yield session
    finally:
        engine.dispose()


def _complete(read: Callable[[Any], list[tuple[str, str]]], incomplete: str) -> list[tuple[str, str]]:
    """(value, help) for each of `read(session)`'s values that starts with `incomplete`; none
    when the store cannot be read."""
    try:
        with _snapshot() as session:
            if session is None:
                return []
            pairs = read(session)
    except Exception:  # noqa: BLE001  (a completer must never break the shell)
        return []
    return [(value, help_) for value, help_ in dict(pairs).items() if value.startswith(incomplete or "")]


def _build_refs(session) -> list[tuple[str, str]]:
    from orchestrator import store

    newest_first = list(reversed(store.builds_in_order(session)))
    return ([(b.label, b.name) for b in newest_first if b.label]
            + [(b.name, b.label or f"build {b.id}") for b in newest_first]
            + [(str(b.id), b.label or b.name) for b in newest_first])


def _serials(session) -> list[tuple[str, str]]:
    from orchestrator import store

    return [(d.serial, str(d.state)) for d in store.all_devices(session)]


def _alert_ids(session) -> list[tuple[str, str]]:
    from orchestrator.store import queries

    return [(str(a.id), f"{a.kind} {a.metric or ''} {a.device.serial if a.device else ''}".strip())
            for a in queries.list_alerts(session, limit=ALERT_LIMIT)]


def _schedule_names(session) -> list[tuple[str, str]]:
    from orchestrator import store

    return [(s.name, f"{s.cron} {s.timezone}") for s in store.all_schedules(session)]


def builds(incomplete: str) -> list[tuple[str, str]]:
    """Build labels, names and ids, newest first."""
    return _complete(_build_refs, incomplete)


def devices(incomplete: str) -> list[tuple[str, str]]:
    """Device serials, with each device's state."""
    return _complete(_serials, incomplete)


def alerts(incomplete: str) -> list[tuple[str, str]]:
    """The open alerts' ids, newest first."""
    return _complete(_alert_ids, incomplete)


def schedules(incomplete: str) -> list[tuple[str, str]]:
    """Schedule names."""
    return _complete(_schedule_names, incomplete)
