"""The notification store: subscriptions (`farm notify`), the events they hear of (a new
alert, a device quarantined) turned into one delivery row per event and subscription, and the
conditional updates a sender claims and settles a delivery with. Rows are written inside the
transaction that raised the event, so an event is recorded exactly when its cause commits;
the (event_key, subscription) unique constraint makes recording it again a no-op, whoever does
it. Sending is orchestrator/jobs/notify.py's. Functions flush; the caller commits."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from .models import (
    Alert,
    AlertKind,
    Delivery,
    DeliveryState,
    Device,
    Subscription,
    SubscriptionKind,
    utcnow,
)

SEVERITIES = ("info", "warning", "critical")
QUARANTINED = "quarantined"  # the event kind of a device taken out of service, beside AlertKind's
EVENT_KINDS = (*[k.value for k in AlertKind], QUARANTINED)
DEFAULT_KINDS = tuple(k for k in EVENT_KINDS if k != AlertKind.improvement)  # no one is paged for a gain
_ATOM = r"[^@\s<>,;:\"()\[\]\\]+"  # no space, line break, list separator, quote or bracket
PLAIN_ADDRESS = re.compile(f"{_ATOM}@{_ATOM}")  # what may go into an email's To header
CRITICAL_CHANGE = 0.10  # a regression of 10 % or more is critical, a smaller one a warning


class NotifyError(ValueError):
    """A bad subscription or an unknown id; the message names the value and the fix."""


# ---- events -------------------------------------------------------------------------------


def alert_severity(kind: str, ratio: float | None) -> str:
    if kind == AlertKind.improvement:
        return "info"
    if kind == AlertKind.regression and ratio is not None and abs(ratio - 1) >= CRITICAL_CHANGE:
        return "critical"
    return "warning"


def alert_event(alert: Alert) -> dict[str, Any]:
    """What a message about `alert` says: what moved, where, by how much, the build pair and
    the command that shows it."""
    detail = alert.detail or {}
    return {
        "key": f"alert:{alert.id}", "type": "alert", "kind": str(alert.kind),
        "severity": alert_severity(alert.kind, alert.ratio), "alert_id": alert.id,
        "device": alert.device.serial if alert.device else None, "metric": alert.metric or None,
        "build": alert.build.name if alert.build else None,
        "baseline_build": alert.baseline_build.name if alert.baseline_build else None,
        "ratio": alert.ratio, "ci_low": alert.ci_low, "ci_high": alert.ci_high, "p_value": alert.p_value,
        "change_percent": None if alert.ratio is None else round((alert.ratio - 1) * 100, 2),
        "baseline_median": detail.get("baseline_median"), "candidate_median": detail.get("candidate_median"),
        "unit": detail.get("unit"), "series": alert.series or {}, "summary": alert.summary,
        "command": f"farm regressions show {alert.id}",
        "created_at": (alert.created_at or utcnow()).isoformat(),
    }


def quarantine_event(device: Device, reason: str, at: dt.datetime | None = None) -> dict[str, Any]:
    at = at or utcnow()
    return {
        "key": f"{QUARANTINED}:{device.id}:{at.isoformat()}", "type": "device", "kind": QUARANTINED,
        "severity": "critical", "device": device.serial, "metric": None, "reason": reason,
        "summary": f"device {device.serial} was quarantined: {reason}",
        "command": f"farm devices show {device.serial}", "created_at": at.isoformat(),
    }


def matches(subscription: Subscription, event: dict[str, Any]) -> bool:
    """A filter left empty matches all; the metric filter passes events that name no metric
    (a quarantine, a data stoppage), which are about a whole device."""
    kinds = subscription.alert_kinds or DEFAULT_KINDS
    return (event["kind"] in kinds
            and (not subscription.devices or event.get("device") in subscription.devices)
            and (not subscription.metrics or not event.get("metric") or event["metric"] in subscription.metrics)
            and SEVERITIES.index(event["severity"]) >= SEVERITIES.index(subscription.min_severity))


def record_event(session: Session, event: dict[str, Any]) -> list[int]:
    """One pending delivery of `event` for each matching subscription; the ids of those this
    call created (none for an event already recorded: INSERT ... ON CONFLICT DO NOTHING, so two
    transactions racing never both insert, and neither fails)."""
    rows = [{"subscription_id": s.id, "event_key": event["key"], "event": event, "state": DeliveryState.pending,
             "attempts": 0, "last_error": "", "created_at": utcnow()}
            for s in session.scalars(select(Subscription).order_by(Subscription.id)) if matches(s, event)]
    if not rows:
        return []
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    statement = (dialect.insert(Delivery).values(rows)
                 .on_conflict_do_nothing(index_elements=["event_key", "subscription_id"]).returning(Delivery.id))
    return sorted(session.execute(statement).scalars())


def record_alerts(session: Session, alert_ids: list[int]) -> list[int]:
    """record_event for each alert (the improvements too: a subscription may ask for them)."""
    created = []
    for alert_id in sorted(set(alert_ids)):
        alert = session.get(Alert, alert_id)
        if alert is not None:
            created += record_event(session, alert_event(alert))
    return created


# ---- subscriptions ------------------------------------------------------------------------


def add_subscription(session: Session, kind: str, target: str, *, secret: str = "", devices=(), metrics=(),
                     alert_kinds=(), min_severity: str = "info") -> Subscription:
    try:
        kind = SubscriptionKind(kind)
    except ValueError:
        raise NotifyError(f"unknown kind {kind!r}: use one of {', '.join(SubscriptionKind)}") from None
    if kind == SubscriptionKind.email and not PLAIN_ADDRESS.fullmatch(target):
        raise NotifyError(f"email target {target!r} is not one plain address (name@example.com): no spaces, "
                          "line breaks, commas or angle brackets")
    if kind != SubscriptionKind.email and not target.startswith(("http://", "https://")):
        raise NotifyError(f"{kind} target {target!r} is not an http(s):// URL")
    bad = [k for k in alert_kinds if k not in EVENT_KINDS]
    if bad:
        raise NotifyError(f"unknown alert kind {bad[0]!r}: use one of {', '.join(EVENT_KINDS)}")
    if min_severity not in SEVERITIES:
        raise NotifyError(f"unknown severity {min_severity!r}: use one of {', '.join(SEVERITIES)}")
    subscription = Subscription(kind=kind, target=target, secret=secret, devices=list(devices),
                                metrics=list(metrics), alert_kinds=list(alert_kinds), min_severity=min_severity)
    session.add(subscription)
    session.flush()
    return subscription


def subscriptions(session: Session) -> list[Subscription]:
    """Every subscription, in the order they were added."""
    return list(session.scalars(select(Subscription).order_by(Subscription.id)))


def get_subscription(session: Session, subscription_id: int) -> Subscription:
    subscription = session.get(Subscription, subscription_id)
    if subscription is None:
        raise NotifyError(f"no subscription {subscription_id}; `farm notify list` shows them")
    return subscription


def recent_deliveries(session: Session, limit: int = 20) -> list[Delivery]:
    return list(session.scalars(select(Delivery).order_by(Delivery.id.desc()).limit(limit)))


# ---- sending: claim, settle, sweep --------------------------------------------------------


def claim(session: Session, delivery_id: int, hold_s: float) -> Delivery | None:
    """Take a pending delivery for one attempt (counted now), unless another sender holds it:
    a conditional UPDATE, so two workers handed the same message never send it together."""
    now = utcnow()
    taken = session.execute(
        update(Delivery).where(Delivery.id == delivery_id, Delivery.state == DeliveryState.pending,
                               or_(Delivery.claimed_until.is_(None), Delivery.claimed_until < now))
        .values(attempts=Delivery.attempts + 1, claimed_until=now + dt.timedelta(seconds=hold_s))
        .execution_options(synchronize_session=False)).rowcount
    if not taken:
        return None
    delivery = session.get(Delivery, delivery_id)
    session.refresh(delivery)
    return delivery


def settle(session: Session, delivery: Delivery, error: str | None, *, retry_in_s: float | None) -> None:
    """Record an attempt: delivered, or refused with `error` and tried again in `retry_in_s`
    (None: no attempts left, failed)."""
    delivery.claimed_until = None
    if error is None:
        delivery.state, delivery.delivered_at, delivery.last_error = DeliveryState.delivered, utcnow(), ""
    else:
        delivery.last_error = error[:2000]
        if retry_in_s is None:
            delivery.state, delivery.next_attempt_at = DeliveryState.failed, None
        else:
            delivery.next_attempt_at = utcnow() + dt.timedelta(seconds=retry_in_s)
    session.flush()


def due(session: Session, now: dt.datetime, limit: int = 100) -> list[int]:
    """Pending deliveries whose next attempt is due and that no sender holds: what the sweep
    sends (a first attempt has no next_attempt_at: due at once)."""
    return list(session.scalars(
        select(Delivery.id).where(Delivery.state == DeliveryState.pending,
                                  or_(Delivery.next_attempt_at.is_(None), Delivery.next_attempt_at <= now),
                                  or_(Delivery.claimed_until.is_(None), Delivery.claimed_until < now))
        .order_by(Delivery.id).limit(limit)))
