"""Devices people book, and what their screens showed. A reservation (`farm devices reserve`)
says a person holds a device until a time: the suites beat fires skip it and say so, and a
person's check or job refuses it with the holder's name (orchestrator/jobs/jobservice.py). It is
not a lease: a lease is the worker's, held for one job's length, so that one GPU runs one timed
job at a time (store.devices); a reservation is a person's, for hours, and holds nothing while
its device idles. A reservation ends at `until` or when released; its row is kept as history.
Screenshots (`farm devices screenshot`) are rows of device_screenshots; their PNGs lie under the
farm's data dir. Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from .models import Batch, Device, DeviceReservation, DeviceScreenshot, Job, Schedule, utcnow
from .rows import StoreError

__all__ = [
    "DeviceReserved", "active_reservation", "active_reservations", "latest_screenshot", "latest_screenshots",
    "list_reservations", "record_screenshot", "release_reservation", "reservation_line", "reserve_device",
    "newest_batch_skips", "prune_screenshots", "skip_entry", "skipped_by_reservation",
]


class DeviceReserved(StoreError):
    """The device is held by someone else; the message names who, until when and why."""

    def __init__(self, serial: str, reservation: DeviceReservation, fix: str = ""):
        super().__init__(reservation_line(serial, reservation) + (f": {fix}" if fix else ""))
        self.serial, self.reservation = serial, reservation


def _at(when: dt.datetime, now: dt.datetime) -> str:
    """14:00 UTC today, else with its date: how a person reads a time in one line."""
    when, now = when.astimezone(dt.UTC), now.astimezone(dt.UTC)
    return f"{when:%H:%M} UTC" if when.date() == now.date() else f"{when:%Y-%m-%d %H:%M} UTC"


def reservation_line(serial: str, reservation: DeviceReservation, now: dt.datetime | None = None) -> str:
    """'vphone-1 is reserved by ana until 14:00 UTC (camera bug)'."""
    note = f" ({reservation.note})" if reservation.note else ""
    return f"{serial} is reserved by {reservation.holder} until {_at(reservation.until, now or utcnow())}{note}"


def skip_entry(serial: str, reservation: DeviceReservation, now: dt.datetime | None = None) -> dict:
    """What a batch says of a device it skipped because a person held it."""
    return {"device": serial, "holder": reservation.holder, "until": reservation.until.isoformat(),
            "note": reservation.note, "reason": reservation_line(serial, reservation, now)}


def skipped_by_reservation(session: Session, batch: Batch) -> list[dict]:
    """The devices a schedule's batch skipped because a person held them when it was made
    (jobservice.skip_reserved): of the schedule's devices, those reserved at the batch's
    creation that have no job in it. Read from the reservations, which are kept, so the batch
    needs no record of its own and its summary stays None until its analysis (what `farm demo`
    and the tests wait on). [] for a batch no schedule made."""
    schedule = session.get(Schedule, batch.schedule_id) if batch.schedule_id is not None else None
    if schedule is None:
        return []
    at = batch.created_at
    rows = session.execute(
        select(DeviceReservation, Device.serial).join(Device, Device.id == DeviceReservation.device_id)
        .where(DeviceReservation.starts_at <= at, DeviceReservation.until > at,
               or_(DeviceReservation.released_at.is_(None), DeviceReservation.released_at > at),
               DeviceReservation.device_id.not_in(select(Job.device_id).where(Job.batch_id == batch.id)))
        .order_by(Device.serial))
    named = (schedule.suite or {}).get("devices")
    return [skip_entry(serial, r, at) for r, serial in rows
            if not isinstance(named, list) or serial in named]


def newest_batch_skips(session: Session, schedule_id: int) -> tuple[int, list[dict]] | None:
    """(the schedule's newest batch, the devices it skipped because people held them), or None
    before its first firing."""
    batch = session.scalar(select(Batch).where(Batch.schedule_id == schedule_id)
                           .order_by(Batch.created_at.desc(), Batch.id.desc()).limit(1))
    return None if batch is None else (batch.id, skipped_by_reservation(session, batch))


def _live(now: dt.datetime):
    return (DeviceReservation.released_at.is_(None), DeviceReservation.until > now)


def active_reservation(session: Session, device_id: int, now: dt.datetime | None = None) -> DeviceReservation | None:
    """The reservation holding the device now, or None."""
    return session.scalar(select(DeviceReservation).where(DeviceReservation.device_id == device_id,
                                                          *_live(now or utcnow()))
                          .order_by(DeviceReservation.until.desc()).limit(1))


def active_reservations(session: Session, device_ids=None, now: dt.datetime | None = None) -> dict[int, DeviceReservation]:
    """device id -> the reservation holding it now, of `device_ids` (None: every device)."""
    query = select(DeviceReservation).where(*_live(now or utcnow())).order_by(DeviceReservation.until)
    if device_ids is not None:
        query = query.where(DeviceReservation.device_id.in_(list(device_ids)))
    return {r.device_id: r for r in session.scalars(query)}  # the latest-ending wins


def list_reservations(session: Session, *, include_ended: bool = False, since: dt.datetime | None = None,
                 now: dt.datetime | None = None) -> list[tuple[DeviceReservation, str]]:
    """(reservation, device serial), soonest ending first: those holding now, or with
    `include_ended` also those ended since `since` (default: a day ago), newest first."""
    now = now or utcnow()
    query = select(DeviceReservation, Device.serial).join(Device, Device.id == DeviceReservation.device_id)
    if include_ended:
        since = since or now - dt.timedelta(days=1)
        query = query.where(or_(DeviceReservation.until > since, DeviceReservation.created_at > since)) \
            .order_by(DeviceReservation.created_at.desc())
    else:
        query = query.where(*_live(now)).order_by(DeviceReservation.until)
    return [(r, serial) for r, serial in session.execute(query)]


def reserve_device(session: Session, device: Device, holder: str, until: dt.datetime, note: str = "",
                   now: dt.datetime | None = None) -> tuple[DeviceReservation, bool]:
    """Book `device` for `holder` until `until`: (the reservation, True when it extended the
    holder's own). DeviceReserved when someone else holds it. The device's row is locked first
    (PostgreSQL; SQLite has one writer), so two people booking at once do not both get it."""
    now = now or utcnow()
    if until <= now:
        raise StoreError(f"a reservation must end in the future, not at {until.isoformat()}")
    holder = holder.strip()
    if not holder:
        raise StoreError("a reservation needs a holder: --as NAME, or set $USER")
    session.execute(select(Device.id).where(Device.id == device.id).with_for_update())
    held = active_reservation(session, device.id, now)
    if held is not None and held.holder != holder:
        raise DeviceReserved(device.serial, held, f"ask {held.holder}, or wait until it ends")
    if held is not None:
        held.until = until
        if note:
            held.note = note
        session.flush()
        return held, True
    reservation = DeviceReservation(device_id=device.id, holder=holder, note=note, starts_at=now, until=until)
    session.add(reservation)
    session.flush()
    return reservation, False


def release_reservation(session: Session, device: Device, now: dt.datetime | None = None) -> DeviceReservation | None:
    """End the reservation holding `device` now (whoever holds it: the farm trusts its
    operators, as with quarantine); None when none does."""
    now = now or utcnow()
    held = active_reservation(session, device.id, now)
    if held is not None:
        held.released_at = now
        session.flush()
    return held


def record_screenshot(session: Session, device_id: int, path: str, sha256: str, size: int, width: int,
                      height: int, source: str, taken_at: dt.datetime | None = None) -> DeviceScreenshot:
    if source not in ("adb", "devtools"):
        raise StoreError(f"a screenshot's source is adb or devtools, not {source!r}")
    shot = DeviceScreenshot(device_id=device_id, path=path, sha256=sha256, size=size, width=width, height=height,
                            source=source, taken_at=taken_at or utcnow())
    session.add(shot)
    session.flush()
    return shot


def prune_screenshots(session: Session, device_id: int, keep: int) -> list[str]:
    """Forget a device's screenshots but its newest `keep`; returns the paths of those forgotten
    (relative to the data dir), for the caller to delete once this transaction commits."""
    old = list(session.scalars(select(DeviceScreenshot).where(DeviceScreenshot.device_id == device_id)
                               .order_by(DeviceScreenshot.taken_at.desc(), DeviceScreenshot.id.desc()).offset(keep)))
    for shot in old:
        session.delete(shot)
    session.flush()
    return [shot.path for shot in old]


def latest_screenshot(session: Session, device_id: int) -> DeviceScreenshot | None:
    return session.scalar(select(DeviceScreenshot).where(DeviceScreenshot.device_id == device_id)
                          .order_by(DeviceScreenshot.taken_at.desc(), DeviceScreenshot.id.desc()).limit(1))


def latest_screenshots(session: Session, device_ids=None) -> dict[int, DeviceScreenshot]:
    """device id -> its newest screenshot, of `device_ids` (None: every device), in one query."""
    newest = select(func.max(DeviceScreenshot.id)).group_by(DeviceScreenshot.device_id)
    if device_ids is not None:
        newest = newest.where(DeviceScreenshot.device_id.in_(list(device_ids)))
    return {shot.device_id: shot for shot in session.scalars(select(DeviceScreenshot)
                                                             .where(DeviceScreenshot.id.in_(newest)))}
