"""The alerts the analysis raises (regressions, improvements, fidelity, data stoppages) and what
it reads to raise them once: the alert a finding already has, a device's open alert of a kind,
when each device last reported. And alert groups: one regression as people triage it, every
alert one build raised against one baseline (a build pair), which an alert joins when it is
saved; a group is listed with what is inside it (devices, metrics, kinds, states, its worst
change), triaged in bulk and given an owner, a bug link and a note. Listing single alerts is
queries.list_alerts; one alert's triage is batches.triage_alert. Every function takes a
session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session, selectinload

from .models import Alert, AlertGroup, AlertKind, AlertState, Build, Job, JobState, utcnow
from .rows import InvalidTransition, StoreError, text_for_store

__all__ = ["BUG_URL_PATTERN", "GROUP_SORTS", "OPEN_ALERT_STATES", "AlertGroupView", "find_alert", "get_alert_group",
           "has_open_alert", "last_reports", "list_alert_groups", "save_alert",
           "triage_group", "update_alert_group", "valid_bug_url"]

OPEN_ALERT_STATES = (AlertState.new, AlertState.acknowledged)
GROUP_SORTS = ("created", "worst", "size")  # newest first, worst change first, most alerts first
# Kinds that belong to a build pair; a data stoppage is a device's, with no build, and stays alone.
GROUPED_KINDS = (AlertKind.regression, AlertKind.improvement, AlertKind.fidelity)


def save_alert(session: Session, alert: Alert) -> Alert:
    """Store an alert, a new one or the changes to one (it has its id on return). An alert of a
    build joins the group of its build pair, made with the pair's first alert; one whose
    baseline changed (measured again against another build) moves to that pair's group."""
    session.add(alert)
    if alert.build_id is not None and alert.kind in GROUPED_KINDS:
        group = session.get(AlertGroup, alert.group_id) if alert.group_id is not None else None
        if group is None or (group.build_id, group.baseline_build_id) != (alert.build_id, alert.baseline_build_id):
            alert.group_id = _group_of(session, alert.build_id, alert.baseline_build_id).id
    session.flush()
    return alert


def _group_of(session: Session, build_id: int, baseline_build_id: int | None) -> AlertGroup:
    """The group of a build pair, made when there is none. Two analyses of one build that
    would make it at once take turns on the build's row (PostgreSQL; SQLite has one writer),
    so the second finds the first's group; should two exist anyway, the oldest is the pair's."""
    query = select(AlertGroup).where(
        AlertGroup.build_id == build_id,
        AlertGroup.baseline_build_id.is_(None) if baseline_build_id is None
        else AlertGroup.baseline_build_id == baseline_build_id).order_by(AlertGroup.id).limit(1)
    group = session.scalar(query)
    if group is None:
        session.execute(select(Build.id).where(Build.id == build_id).with_for_update())
        group = session.scalar(query)
    if group is None:
        group = AlertGroup(build_id=build_id, baseline_build_id=baseline_build_id)
        session.add(group)
        session.flush()
    return group


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


# ---- alert groups -------------------------------------------------------------------------


@dataclass
class AlertGroupView:
    """A group with its alerts (oldest first) and what a list of groups shows of them."""

    group: AlertGroup
    alerts: list[Alert]
    triaged: tuple[int, ...] = ()  # the alerts the triage that returned this view set, by id

    @property
    def devices(self) -> list[str]:
        return sorted({a.device.serial for a in self.alerts if a.device is not None})

    @property
    def metrics(self) -> list[str]:
        return sorted({a.metric for a in self.alerts if a.metric})

    @property
    def kinds(self) -> dict[str, int]:
        return dict(sorted(Counter(str(a.kind) for a in self.alerts).items()))

    @property
    def states(self) -> dict[str, int]:
        """How many alerts are in each state, every state named (0 where none)."""
        counts = Counter(str(a.state) for a in self.alerts)
        return {str(state): counts[str(state)] for state in AlertState}

    @property
    def open(self) -> bool:
        return any(a.state in OPEN_ALERT_STATES for a in self.alerts)

    @property
    def worst(self) -> Alert | None:
        """The alert whose ratio is furthest from 1: among the regressions when there are any
        (a group is read as the regression it is), else among every alert with a ratio."""
        rated = [a for a in self.alerts if a.ratio is not None and a.ratio > 0]
        regressions = [a for a in rated if a.kind == AlertKind.regression]
        return max(regressions or rated, key=lambda a: abs(math.log(a.ratio)), default=None)

    @property
    def created_at(self) -> dt.datetime:
        return self.group.created_at


def get_alert_group(session: Session, group_id: int) -> AlertGroupView:
    group = session.get(AlertGroup, group_id)
    if group is None:
        raise StoreError(f"no alert group {group_id}; `farm regressions list --all` shows them")
    return AlertGroupView(group, _alerts_of(session, [group.id]).get(group.id, []))


def _alerts_of(session: Session, group_ids: list[int]) -> dict[int, list[Alert]]:
    by_group: dict[int, list[Alert]] = {}
    for start in range(0, len(group_ids), 500):  # bound the IN list
        for alert in session.scalars(
                select(Alert).options(selectinload(Alert.device), selectinload(Alert.build),
                                      selectinload(Alert.baseline_build))
                .where(Alert.group_id.in_(group_ids[start:start + 500])).order_by(Alert.id)):
            by_group.setdefault(alert.group_id, []).append(alert)
    return by_group


def list_alert_groups(
    session: Session,
    *,
    states: Iterable[AlertState] = OPEN_ALERT_STATES,
    kinds: Iterable[AlertKind] | None = None,
    build_id: int | None = None,
    device_id: int | None = None,
    metric: str | None = None,
    owner: str | None = None,
    sort: str = "created",
    limit: int | None = None,
) -> list[AlertGroupView]:
    """Groups with at least one alert in `states` that matches every alert filter given (kind,
    device, metric), of the candidate build `build_id` and the owner `owner` ("" for none),
    sorted by `sort` (GROUP_SORTS). Each comes with all its alerts, whatever their state:
    a group is triaged whole. (Alerts raised before groups existed were grouped by migration
    0025.)"""
    if sort not in GROUP_SORTS:
        raise StoreError(f"unknown sort {sort!r}; choose from {', '.join(GROUP_SORTS)}")
    inside = [Alert.group_id == AlertGroup.id, Alert.state.in_(list(states))]
    if kinds is not None:
        inside.append(Alert.kind.in_(list(kinds)))
    if device_id is not None:
        inside.append(Alert.device_id == device_id)
    if metric is not None:
        inside.append(Alert.metric == metric)
    query = select(AlertGroup).options(selectinload(AlertGroup.build), selectinload(AlertGroup.baseline_build)) \
        .where(exists().where(*inside))
    if build_id is not None:
        query = query.where(AlertGroup.build_id == build_id)
    if owner is not None:
        query = query.where(AlertGroup.owner == owner)
    groups = list(session.scalars(query.order_by(AlertGroup.created_at.desc(), AlertGroup.id.desc())))
    alerts = _alerts_of(session, [g.id for g in groups])
    views = [AlertGroupView(g, alerts.get(g.id, [])) for g in groups]
    if sort == "worst":
        views.sort(key=lambda v: -abs(math.log(v.worst.ratio)) if v.worst is not None else 0.0)
    elif sort == "size":
        views.sort(key=lambda v: -len(v.alerts))
    return views if limit is None else views[:limit]


def triage_group(session: Session, group_id: int, state: AlertState | str, note: str | None = None,
                 alert_ids: Iterable[int] | None = None) -> AlertGroupView:
    """A person's word on a whole regression: the group's open alerts (new or acknowledged), or
    exactly the `alert_ids` of it whatever their state, in `state`, with `note` kept on each
    when given. A closed alert (invalid, fixed) is left alone by the bulk action: reopening it
    would also make an invalid alert's build a candidate again instead of a baseline.
    InvalidTransition when no alert is open and none is named."""
    view = get_alert_group(session, group_id)
    if alert_ids is None:
        chosen = [a for a in view.alerts if a.state in OPEN_ALERT_STATES]
        if not chosen:
            raise InvalidTransition(
                f"group {group_id} has no open alert ({_states_said(view)}): name the ones to change with "
                f"--only ID (API: alert_ids); `farm regressions group show {group_id}` lists them")
    else:
        wanted = set(alert_ids)
        strangers = sorted(wanted - {a.id for a in view.alerts})
        if strangers:
            raise StoreError(f"alert{'s' if len(strangers) > 1 else ''} {', '.join(map(str, strangers))} "
                             f"not in group {group_id}; `farm regressions group show {group_id}` lists its alerts")
        chosen = [a for a in view.alerts if a.id in wanted]
    now = utcnow()
    for alert in chosen:
        alert.state, alert.updated_at = AlertState(state), now
        if note:
            alert.note = text_for_store(note)
    view.group.updated_at = now
    view.triaged = tuple(a.id for a in chosen)
    session.flush()
    return view


def _states_said(view: AlertGroupView) -> str:
    return ", ".join(f"{n} {state}" for state, n in view.states.items() if n) or "no alerts"


# An http(s) link to a named host, or "" (no link): what a bug link may be (the API states it in
# its OpenAPI as this pattern, so a client can check before sending).
BUG_URL_PATTERN = r"^(https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?([/?#][^\s\x00]*)?)?$"


def valid_bug_url(url: str) -> str:
    """`url` when it is an http or https link to a host ("" clears the link); else StoreError."""
    url = url.strip()
    if len(url) > 1024 or not re.fullmatch(BUG_URL_PATTERN, url, flags=re.IGNORECASE):
        raise StoreError(f"bug link {url!r} is not an http(s) URL: give one like https://bugs.example.com/123 "
                         "(at most 1,024 characters), or \"\" to clear it")
    return url


def update_alert_group(session: Session, group_id: int, *, owner: str | None = None, bug_url: str | None = None,
                       note: str | None = None) -> AlertGroupView:
    """Set a group's owner, bug link (validated: http or https) and note; None leaves one as it
    is, "" clears it."""
    view = get_alert_group(session, group_id)
    if bug_url is not None:
        view.group.bug_url = valid_bug_url(bug_url)
    if owner is not None:
        if len(owner.strip()) > 255:
            raise StoreError("an owner is at most 255 characters")
        view.group.owner = text_for_store(owner.strip())
    if note is not None:
        view.group.note = text_for_store(note)
    view.group.updated_at = utcnow()
    session.flush()
    return view
