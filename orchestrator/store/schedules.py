"""Schedules: cron expressions in a time zone (validated, daylight-saving aware), their due
firings, each claimed once.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from .models import (
    Schedule,
    utcnow,
)
from .rows import StoreError, by_id_or_name

__all__ = [
    "all_schedules", "claim_schedule_firing", "create_schedule", "due_schedules", "get_schedule",
    "last_fire_time", "next_fire_time", "validate_cron",
]

log = logging.getLogger(__name__)


def validate_cron(cron: str, timezone: str, now: dt.datetime | None = None) -> None:
    """StoreError unless `cron` is a five-field cron expression that names a date (not "0 0 31 2
    *": February has no 31st) and `timezone` an IANA zone."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from croniter import croniter

    if len(cron.split()) != 5 or not croniter.is_valid(cron):
        raise StoreError(f"invalid cron expression {cron!r}: five fields, minute hour day-of-month "
                         "month day-of-week, e.g. '0 2 * * *' (02:00 every day)")
    try:
        ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise StoreError(f"unknown time zone {timezone!r}: use an IANA name such as UTC or "
                         "Europe/Paris") from None
    next_fire_time(cron, timezone, now or utcnow())  # StoreError when it never fires


# Cron times are wall-clock times in the schedule's zone. A wall time the zone repeats (the
# autumn change's hour) is the first of the two instants; one the zone skips (the spring
# change's hour) is the instant the clocks jump, after which the wall clock reads a later time.
# So each wall time the cron names maps to one instant, never earlier than the wall time before
# it: a repeated hour fires once, a skipped one once (several skipped wall times, once).
_CRON_SEARCH_YEARS = 10  # a cron that names no date within this many years is refused
_REPEATS_AT_MOST = dt.timedelta(hours=3)  # the longest wall-clock span a zone repeats (usually 1 h)


def _wall_to_utc(wall: dt.datetime, zone) -> dt.datetime:
    """The instant a naive wall-clock time of `zone` stands for (see above), in UTC."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(dt.UTC)
    if first.astimezone(zone).replace(tzinfo=None) == wall:
        return first
    # Skipped by the zone: the jump happens between the instants read with the offsets before
    # (fold=0, later) and after (fold=1, earlier) it; find it to the minute.
    low, high = wall.replace(tzinfo=zone, fold=1).astimezone(dt.UTC), first
    while high - low > dt.timedelta(minutes=1):
        middle = low + (high - low) / 2
        if middle.astimezone(zone).replace(tzinfo=None) >= wall:
            high = middle
        else:
            low = middle
    return high.replace(second=0, microsecond=0) if high.second or high.microsecond else high


def _cron_walls(cron: str, start: dt.datetime, forward: bool):
    """The wall-clock times `cron` names, from `start` (naive) on, forward or backward."""
    from croniter import CroniterBadDateError, croniter

    itr = croniter(cron, start)
    limit = start + dt.timedelta(days=366 * _CRON_SEARCH_YEARS) * (1 if forward else -1)
    while True:
        try:
            wall = itr.get_next(dt.datetime) if forward else itr.get_prev(dt.datetime)
        except CroniterBadDateError:
            wall = None
        if wall is None or (wall > limit if forward else wall < limit):
            raise StoreError(f"cron expression {cron!r} names no date within {_CRON_SEARCH_YEARS} years "
                             "(e.g. the 31st of a month that has 30 days): it would never fire")
        yield wall


def next_fire_time(cron: str, timezone: str, after: dt.datetime) -> dt.datetime:
    """The first instant strictly after `after` that `cron`, read as wall-clock time in
    `timezone`, names; in UTC. A repeated hour fires once, a skipped one once (above).
    StoreError for a cron that never fires."""
    from zoneinfo import ZoneInfo

    zone = ZoneInfo(timezone)
    # The mapping never goes back, and `after`'s own wall time maps at or before it: the search
    # starts there.
    start = after.astimezone(zone).replace(tzinfo=None)
    for wall in _cron_walls(cron, start, forward=True):
        fire = _wall_to_utc(wall, zone)
        if fire > after:
            return fire
    raise AssertionError("unreachable")  # _cron_walls raises when it runs out


def last_fire_time(cron: str, timezone: str, at: dt.datetime) -> dt.datetime:
    """The latest instant at or before `at` that `cron` (wall clock in `timezone`) names, in UTC."""
    from zoneinfo import ZoneInfo

    zone = ZoneInfo(timezone)
    # In a repeated hour, wall times after `at`'s own map to its first pass, before `at`.
    start = at.astimezone(zone).replace(tzinfo=None) + _REPEATS_AT_MOST
    for wall in _cron_walls(cron, start, forward=False):
        fire = _wall_to_utc(wall, zone)
        if fire <= at:
            return fire
    raise AssertionError("unreachable")


def all_schedules(session: Session) -> list[Schedule]:
    """Every schedule, by name."""
    return list(session.scalars(select(Schedule).order_by(Schedule.name)))


def get_schedule(session: Session, ref: int | str) -> Schedule:
    return by_id_or_name(session, Schedule, Schedule.name, ref, "schedule")


def create_schedule(session: Session, name: str, cron: str, timezone: str, suite: dict[str, Any],
                    *, enabled: bool = True) -> Schedule:
    validate_cron(cron, timezone)
    if session.scalar(select(Schedule).where(Schedule.name == name)) is not None:
        raise StoreError(f"a schedule named {name!r} already exists")
    schedule = Schedule(name=name, cron=cron, timezone=timezone, suite=suite, enabled=enabled,
                        last_run_at=utcnow())  # fires from now on, not for the past
    session.add(schedule)
    session.flush()
    return schedule


def due_schedules(session: Session, now: dt.datetime) -> list[tuple[Schedule, dt.datetime]]:
    """Enabled schedules whose next firing after their last run is at or before `now`, with
    the latest firing time that is due (a beat that was down fires a missed schedule once, for
    its latest firing, not once per miss). A stored schedule whose cron or zone this version
    cannot read (stored before it was checked, or by hand) is left out with its error in
    `last_error` (flushed) and a log line: it never stops the others."""
    due = []
    for schedule in session.scalars(select(Schedule).where(Schedule.enabled).order_by(Schedule.id)):
        try:
            fire = next_fire_time(schedule.cron, schedule.timezone, schedule.last_run_at or schedule.created_at)
            if fire <= now:
                due.append((schedule, max(fire, last_fire_time(schedule.cron, schedule.timezone, now))))
        except Exception as exc:  # noqa: BLE001  (whatever it is, it is this schedule's alone)
            error = f"cannot fire: {exc if isinstance(exc, StoreError) else f'{type(exc).__name__}: {exc}'}"
            if schedule.last_error != error:
                log.error("schedule %s (%s): %s", schedule.name, schedule.cron, error)
                schedule.last_error = error
    session.flush()
    return due


def claim_schedule_firing(session: Session, schedule_id: int, previous: dt.datetime | None,
                          fired_at: dt.datetime) -> bool:
    """Move the schedule's last_run_at from `previous` to `fired_at`; True for the one beat (or
    run-now) that did, so two beats never fire the same schedule twice."""
    condition = Schedule.last_run_at.is_(None) if previous is None else Schedule.last_run_at == previous
    result = session.execute(
        update(Schedule)
        .where(Schedule.id == schedule_id, condition)
        .values(last_run_at=fired_at, last_error=None)
        .execution_options(synchronize_session=False)
    )
    session.flush()
    return result.rowcount == 1
