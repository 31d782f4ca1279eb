"""What the store's modules share: its errors, the single conditional statements its writes are
made of (an update that names the row's expected state, an idempotent insert, a redispatch) and
the conditions its reads share (a run that is a series' measurement, a build made before another).
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from .models import BATCH_CHECK, Batch, Build, Job

__all__ = [
    "InvalidTransition", "StoreError", "bulk_insert", "in_series", "insert_or_get", "made_before", "redispatch_row",
    "text_for_store", "update_row",
]


class StoreError(Exception):
    """A request the store refuses (unknown id, forbidden transition); the message says why."""


class InvalidTransition(StoreError):
    pass


def update_row(session: Session, model, row_id: int, conditions: list, values: dict[str, Any]) -> bool:
    """One conditional UPDATE of row `row_id`; True when it matched. A loaded copy of the row is
    expired, since the UPDATE bypassed the ORM."""
    result = session.execute(
        update(model).where(model.id == row_id, *conditions).values(**values)
        .execution_options(synchronize_session=False)
    )
    session.flush()
    loaded = session.identity_map.get(identity_key(model, row_id))
    if loaded is not None:
        session.expire(loaded)
    return result.rowcount == 1


def redispatch_row(session: Session, model, row_id: int, waiting: list, due_at: dt.datetime,
                new_message: bool) -> int | None:
    """Move a waiting row's deadline to `due_at`; with `new_message` its message is replaced:
    the dispatch sequence goes up and older messages are dropped when they arrive. Returns the
    sequence number the message must carry, or None when the row no longer waits."""
    values: dict[str, Any] = {"due_at": due_at}
    if new_message:
        values["dispatch_seq"] = model.dispatch_seq + 1
    if not update_row(session, model, row_id, waiting, values):
        return None
    return session.scalar(select(model.dispatch_seq).where(model.id == row_id))


def text_for_store(text: str) -> str:
    """Free text from a device (an error, a log) as every backend keeps it: PostgreSQL refuses
    NUL characters in text, so each is stored as U+FFFD."""
    return text.replace("\x00", "\ufffd")


def bulk_insert(session: Session, model, rows: Iterable[dict]) -> None:
    rows = list(rows)
    if rows:
        session.execute(model.__table__.insert(), rows)


def insert_or_get(session: Session, obj, query):
    """Insert `obj`; when a unique constraint says another transaction got there first, return
    that row instead (the losing insert is rolled back to a savepoint, the session survives)."""
    try:
        with session.begin_nested():
            session.add(obj)
    except IntegrityError:
        existing = session.scalar(query)
        if existing is None:
            raise
        return existing
    return obj


def by_id_or_name(session: Session, model, name_column, ref: int | str, what: str):
    """The row of `model` whose id (an int `ref`) or name (a str) is `ref`; StoreError naming
    it when there is none, with the `farm <what>s list` that shows the known ones."""
    row = session.scalar(select(model).where(model.id == ref if isinstance(ref, int) else name_column == ref))
    if row is None:
        raise StoreError(f"no {what} {ref!r}; `farm {what}s list` shows the known ones")
    return row


def where_given(query, *conditions):
    """`query` narrowed by each (column, value) pair whose value is not None: the optional
    filters of a list."""
    for column, value in conditions:
        if value is not None:
            query = query.where(column == value)
    return query


def in_series():
    """The condition on Job (joined) that a run is a series' measurement: not a run of a `farm
    check` (Batch.purpose "check"), which the check alone judges."""
    return Job.batch_id.is_(None) | Job.batch_id.not_in(select(Batch.id).where(Batch.purpose == BATCH_CHECK))


def made_before(build: Build):
    """The condition on Build that a build was made before `build` (creation time, then id)."""
    return (Build.created < build.created) | ((Build.created == build.created) & (Build.id < build.id))
