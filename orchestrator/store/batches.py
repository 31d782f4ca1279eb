"""Batches (a suite's jobs, finished once by a conditional update) and alerts' triage.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from .jobs import SETTLED_STATES
from .models import (
    BATCH_SERIES,
    Alert,
    AlertState,
    Batch,
    Job,
    utcnow,
)
from .rows import StoreError, insert_or_get, text_for_store

__all__ = [
    "alert_ids", "batches_awaiting_analysis", "create_batch", "extra_round", "extra_rounds_of", "finish_batch_if_done",
    "get_alert", "get_batch", "triage_alert",
]


def create_batch(
    session: Session,
    name: str,
    *,
    build_id: int | None = None,
    schedule_id: int | None = None,
    idempotency_key: str | None = None,
    max_extra_rounds: int = 3,
    round_metrics: list[str] | None = None,
    purpose: str = BATCH_SERIES,
) -> Batch:
    """A new batch of jobs (`purpose`: Batch.purpose); with an `idempotency_key` (a schedule's
    firing time), asking again returns the batch made the first time."""
    batch = Batch(name=name, build_id=build_id, schedule_id=schedule_id, idempotency_key=idempotency_key,
                  max_extra_rounds=max_extra_rounds, round_metrics=round_metrics, purpose=purpose)
    if idempotency_key is None:
        session.add(batch)
        session.flush()
        return batch
    return insert_or_get(session, batch, select(Batch).where(Batch.idempotency_key == idempotency_key))


def get_batch(session: Session, batch_id: int) -> Batch:
    batch = session.get(Batch, batch_id)
    if batch is None:
        raise StoreError(f"no batch {batch_id}")
    return batch


def finish_batch_if_done(session: Session, batch_id: int) -> bool:
    """Stamp the batch finished when none of its jobs can still change; True only for the one
    caller whose conditional UPDATE did it (so its analysis is sent exactly once)."""
    open_jobs = select(func.count()).select_from(Job).where(
        Job.batch_id == batch_id, Job.state.not_in([s.value for s in SETTLED_STATES]))
    if session.scalar(open_jobs):
        return False
    result = session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.finished_at.is_(None))
        .values(finished_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    session.flush()
    return result.rowcount == 1


def batches_awaiting_analysis(session: Session, finished_before: dt.datetime, limit: int = 100) -> list[int]:
    """The ids of batches that finished before `finished_before` and have no summary yet (their
    analysis never came), oldest first, at most `limit`."""
    return list(session.scalars(
        select(Batch.id).where(Batch.finished_at.is_not(None), Batch.finished_at < finished_before,
                               Batch.summary.is_(None)).order_by(Batch.id).limit(limit)))


def extra_rounds_of(session: Session, root_id: int) -> list[Batch]:
    """The more-repetitions rounds a batch's analyses launched (idempotency key more:<root>:...)."""
    return list(session.scalars(select(Batch).where(Batch.idempotency_key.like(f"more:{root_id}:%"))
                                .order_by(Batch.id)))


def extra_round(idempotency_key: str | None) -> int:
    """Which more-repetitions round a batch is, from its idempotency key ("more:ROOT:N:DEVICE";
    0: the original batch)."""
    if idempotency_key and idempotency_key.startswith("more:"):
        return int(idempotency_key.split(":")[2])
    return 0


# ---- alerts -------------------------------------------------------------------------------


def alert_ids(session: Session) -> list[int]:
    """The id of every alert, whatever its state, in the order they were raised."""
    return list(session.scalars(select(Alert.id).order_by(Alert.id)))


def get_alert(session: Session, alert_id: int) -> Alert:
    alert = session.get(Alert, alert_id)
    if alert is None:
        raise StoreError(f"no alert {alert_id}; `farm regressions list --alerts --all` shows them")
    return alert


def triage_alert(session: Session, alert_id: int, state: AlertState | str, note: str | None = None) -> Alert:
    """A person's word on an alert (`farm regressions ack|invalidate|fixed`, the API's
    acknowledge, invalidate and fixed): its new state, and the note when one is given."""
    alert = get_alert(session, alert_id)
    alert.state, alert.updated_at = AlertState(state), utcnow()
    if note:
        alert.note = text_for_store(note)
    session.flush()
    return alert
