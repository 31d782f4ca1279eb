"""The alerts the analysis raises (regressions, improvements, fidelity, data stoppages) and what
it reads to raise them once: the alert a finding already has, a device's open alert of a kind,
when each device last reported. Listing alerts is queries.list_alerts; a person's triage is
batches.triage_alert. Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from .models import Alert, AlertKind, AlertState, Job, JobState

__all__ = ["OPEN_ALERT_STATES", "find_alert", "has_open_alert", "last_reports", "save_alert"]

OPEN_ALERT_STATES = (AlertState.new, AlertState.acknowledged)


def save_alert(session: Session, alert: Alert) -> Alert:
    """Store an alert, a new one or the changes to one (it has its id on return)."""
    session.add(alert)
    session.flush()
    return alert


def find_alert(session: Session, build_id: int, device_id: int, kind: AlertKind, metric: str) -> Alert | None:
    """The alert of `kind` on a build's `metric` on a device, in whatever state, or None."""
    return session.scalar(select(Alert).where(Alert.build_id == build_id, Alert.device_id == device_id,
                                              Alert.kind == kind, Alert.metric == metric))


def has_open_alert(session: Session, device_id: int, kind: AlertKind) -> bool:
    """Whether the device has an open (new or acknowledged) alert of `kind`."""
    return session.scalar(select(Alert.id).where(
        Alert.device_id == device_id, Alert.kind == kind, Alert.state.in_(OPEN_ALERT_STATES)).limit(1)) is not None


def last_reports(session: Session) -> list[tuple[int, dt.datetime | None]]:
    """(device id, when its newest finished job finished) for each device that ran one: when the
    control plane last heard a result from it, by its own clock, not the device's."""
    return [tuple(r) for r in session.execute(
        select(Job.device_id, func.max(Job.finished_at))
        .where(Job.state.in_([JobState.succeeded, JobState.failed])).group_by(Job.device_id))]
