"""Hosts and devices: registration, when each host was last heard (its workers stamp it; a host
silent too long has its devices taken offline), the device state machine's events, leases (one
timed job per physical adapter), and the outcome counts that quarantine a failing device.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import case, func, literal, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.util import identity_key

from agent.protocol import DeviceInfo, to_dict

from . import notifications
from .device_states import PROBED_STATES, DeviceEvent, accepting, moves, refusal, transition
from .models import (
    Deployment,
    Device,
    DeviceState,
    DeviceStateChange,
    Host,
    Job,
    JobKind,
    JobState,
    Run,
    TransportKind,
    utcnow,
)
from .rows import InvalidTransition, by_id_or_name, insert_or_get

__all__ = [
    "QUARANTINE_AFTER_INFRA_FAILURES", "TIMED_KINDS", "TRANSPORT_STATES", "acquire_device_lease",
    "adapter_group_of", "all_devices", "apply_device_event", "count_job_outcome", "device_history",
    "devices_due_for_probe", "devices_named", "devices_of_transport", "expire_device_leases", "find_device", "get_device", "get_or_create_host",
    "in_service_devices", "release_device_lease", "remove_device", "set_device_state", "take_silent_hosts_offline",
    "upsert_device",
]


# What a transport's error state means for the device's health record (transports/base.py).
TRANSPORT_STATES: dict[str, DeviceState] = {
    "ready": DeviceState.available,
    "busy": DeviceState.busy,
    "offline": DeviceState.offline,
    "unauthorized": DeviceState.unauthorized,
    "unresponsive": DeviceState.offline,
    "incompatible": DeviceState.available,  # reachable; a matching build fixes it
    "error": DeviceState.offline,
}


# Jobs that measure time: they need their GPU to themselves (acquire_device_lease).
TIMED_KINDS = (JobKind.latency, JobKind.tune)


def get_or_create_host(session: Session, name: str) -> Host:
    host = session.scalar(select(Host).where(Host.name == name))
    if host is None:
        host = insert_or_get(session, Host(name=name), select(Host).where(Host.name == name))
    host.last_seen = utcnow()
    session.flush()
    return host


def upsert_device(
    session: Session,
    serial: str,
    transport: TransportKind | str,
    address: str = "",
    *,
    info: DeviceInfo | None = None,
    host: str | None = None,
    engine_host: str | None = None,
) -> Device:
    """Create or update the device `serial`; `info` (when given) refreshes its identity and
    marks it seen; `engine_host` (python, browser) when given. A new device starts offline until
    something reports it available."""
    query = select(Device).where(Device.serial == serial)
    device = session.scalar(query)
    if device is None:
        device = insert_or_get(
            session, Device(serial=serial, transport=TransportKind(transport), address=address,
                            engine_host=engine_host or "python"), query
        )
    device.transport = TransportKind(transport)
    if engine_host is not None:
        device.engine_host = engine_host
    if address:
        device.address = address
    if host is not None:
        device.host = get_or_create_host(session, host)
    if info is not None:
        adapter = info.adapter or {}
        device.model, device.manufacturer = info.model, info.manufacturer
        device.os, device.os_version = info.os, info.os_version
        device.gpu_vendor = str(adapter.get("vendor") or "")
        device.gpu_architecture = str(adapter.get("architecture") or "")
        device.gpu_device = str(adapter.get("device") or "")
        device.gpu_driver = str(adapter.get("description") or "")
        device.gpu_backend = str(adapter.get("backend") or "")
        device.virtual = info.virtual
        device.adapter_group = info.adapter_id or None
        device.info = to_dict(info)
        device.last_seen = utcnow()
    session.flush()
    return device


def get_device(session: Session, ref: int | str) -> Device:
    """A device by id or serial; StoreError naming it when unknown."""
    return by_id_or_name(session, Device, Device.serial, ref, "device")


def find_device(session: Session, serial: str) -> Device | None:
    """The device called `serial`, or None."""
    return session.scalar(select(Device).where(Device.serial == serial))


def all_devices(session: Session) -> list[Device]:
    """Every device, quarantined ones too, by serial."""
    return list(session.scalars(select(Device).order_by(Device.serial)))


def device_history(session: Session, device_id: int) -> int:
    """How many jobs, runs and deployments name the device (what removing it would delete)."""
    return sum(session.scalar(select(func.count()).select_from(model).where(model.device_id == device_id)) or 0
               for model in (Job, Run, Deployment))


def devices_named(session: Session, serials) -> list[Device]:
    """The devices of `serials` that exist, by serial."""
    return list(session.scalars(select(Device).where(Device.serial.in_(list(serials))).order_by(Device.serial)))


def remove_device(session: Session, device: Device) -> None:
    """Delete the device row and, through the schema's cascades, what names it."""
    session.delete(device)
    session.flush()


def devices_of_transport(session: Session, transport: TransportKind | str) -> list[Device]:
    """Every device reached through `transport`, by serial."""
    return list(session.scalars(select(Device).where(Device.transport == TransportKind(transport))
                                .order_by(Device.serial)))


def devices_due_for_probe(session: Session, now: dt.datetime, heard_since: dt.datetime | None = None) -> list[Device]:
    """Offline and unauthorized devices whose next probe is due and that nothing holds, by id.
    Quarantined devices are never probed: only an operator releases them. With `heard_since`,
    neither are the devices of a host not heard from since then: no worker there would take the
    probe, and they stay due until their host is heard again."""
    query = select(Device).where(Device.state.in_(PROBED_STATES), _unheld(now),
                                 or_(Device.next_probe_at.is_(None), Device.next_probe_at <= now))
    if heard_since is not None:
        silent = select(Host.id).where(Host.last_seen < heard_since)
        query = query.where(or_(Device.host_id.is_(None), Device.host_id.not_in(silent)))
    return list(session.scalars(query.order_by(Device.id)))


def take_silent_hosts_offline(session: Session, heard_since: dt.datetime, now: dt.datetime) -> list[int]:
    """The devices of every host not heard from since `heard_since` (its workers stamp its
    last_seen while they run: orchestrator/jobs/health.py) go offline (unreachable), saying so,
    unless offline or quarantined already: nothing can drive them until their host is back.
    Returns their ids."""
    rows = session.execute(
        select(Device.id, Host.name, Host.last_seen).join(Host, Device.host_id == Host.id)
        .where(Host.last_seen < heard_since,
               Device.state.in_([DeviceState.available, DeviceState.busy, DeviceState.unauthorized]))
        .order_by(Device.id)).all()
    for device_id, host, last_seen in rows:
        silent = (now - last_seen).total_seconds()
        apply_device_event(session, device_id, DeviceEvent.unreachable,
                           f"its host {host} has not been heard from for {silent:.0f} s (its worker is down, or "
                           "cut off from the farm's database)")
    return [device_id for device_id, _, _ in rows]


def in_service_devices(session: Session) -> list[Device]:
    """Every device that is not quarantined, by serial: what `--all` means everywhere."""
    return list(session.scalars(select(Device).where(Device.state != DeviceState.quarantined)
                                .order_by(Device.serial)))


# What set_device_state's target state means as an observation of the device.
_OBSERVED: dict[DeviceState, DeviceEvent] = {
    DeviceState.available: DeviceEvent.answered,
    DeviceState.offline: DeviceEvent.unreachable,
    DeviceState.unauthorized: DeviceEvent.refused,
}


def set_device_state(
    session: Session, device_id: int, state: DeviceState | str, reason: str = "", *, force: bool = False
) -> Device:
    """Record what was observed of a device as the state it implies (available: it answered;
    offline: it did not; unauthorized: it refused this host), through the state machine
    (apply_device_event). `force` is an operator's word: quarantined quarantines, available
    releases. Quarantine is sticky: without `force` an observation leaves a quarantined device
    as it is, so a flapping phone that a person quarantined is not put back into service by the
    next successful poll. `busy` is never set: taking the device's lease records it."""
    state = DeviceState(state)
    if force and state in (DeviceState.quarantined, DeviceState.available):
        event = DeviceEvent.quarantine if state == DeviceState.quarantined else DeviceEvent.release
    elif state in _OBSERVED:
        event = _OBSERVED[state]
    else:
        raise InvalidTransition(f"a device is not set {state} by hand: "
                                + ("busy is recorded by taking its lease (acquire_device_lease)" if state ==
                                   DeviceState.busy else "an operator quarantines it (force=True)"))
    return apply_device_event(session, device_id, event, reason)


def apply_device_event(session: Session, device_id: int, event: DeviceEvent | str, reason: str = "") -> Device:
    """Move a device through the state machine (orchestrator/store/device_states.py) on `event`,
    recording `reason` with its new state; InvalidTransition, naming the device, its state and
    why, for an event the table refuses. An ignored event changes nothing. Entering offline or
    unauthorized from elsewhere starts the health check's back-off afresh; a release clears
    the count of infrastructure failures in a row."""
    device = get_device(session, device_id)
    event = DeviceEvent(event)
    step = transition(device.state, event)
    if step is None:
        raise InvalidTransition(f"device {device.serial!r}: {refusal(device.state, event)}")
    if step.ignored:
        return device
    if step.to in PROBED_STATES and device.state not in PROBED_STATES:
        device.probe_failures, device.next_probe_at = 0, None
    if event == DeviceEvent.release:
        device.infra_failures_in_row = 0
    entering_quarantine = step.to == DeviceState.quarantined and device.state != DeviceState.quarantined
    if step.to != device.state:
        session.add(DeviceStateChange(device_id=device.id, from_state=str(device.state), to_state=str(step.to),
                                      event=str(event), reason=reason))
    device.state, device.state_reason = step.to, reason
    if entering_quarantine:  # in this transaction: heard of exactly when the quarantine commits
        notifications.record_event(session, notifications.quarantine_event(device, reason))
    if event in (DeviceEvent.answered, DeviceEvent.refused):
        device.last_seen = utcnow()
    session.flush()
    return device


def _lease_event(event: DeviceEvent) -> dict[str, Any]:
    """The state and reason columns after `event`, as SQL over the row's current state: the
    lease statements change the state in the same statement as the lease."""
    changes = moves(event)
    if not changes:
        return {}
    state_type = Device.__table__.c.state.type
    return {
        "state": case({s: literal(to, state_type) for s, to in changes.items()}, value=Device.state,
                      else_=Device.state),
        "state_reason": case({s: "" for s in changes}, value=Device.state, else_=Device.state_reason),
    }


def acquire_device_lease(session: Session, device_id: int, holder: str, seconds: float, *,
                         timed: bool = False) -> bool:
    """Take (or renew) the device's lease for `seconds`; False when someone else holds an
    unexpired one or the device is quarantined. One conditional UPDATE: the database decides,
    and the device is recorded busy in the same statement (device_states: lease_taken).

    A device in an adapter group shares its GPU with the group's other devices: a `timed`
    holder (its job measures time) needs every other device of the group free, and no one
    takes a device while a timed holder has another device of its group. The group's rows are
    locked first, in id order (PostgreSQL; SQLite's BEGIN IMMEDIATE already serialises
    writers), so two devices of a group are never taken past each other."""
    now = utcnow()
    group = session.scalar(select(Device.adapter_group).where(Device.id == device_id))
    if group is not None:
        members = session.execute(
            select(Device.id, Device.lease_holder, Device.lease_until, Device.lease_timed)
            .where(Device.adapter_group == group).order_by(Device.id).with_for_update()).all()
        others = [m for m in members if m.id != device_id and m.lease_holder is not None
                  and m.lease_until is not None and m.lease_until >= now]
        if others and (timed or any(m.lease_timed for m in others)):
            return False
    result = session.execute(
        update(Device)
        .where(
            Device.id == device_id,
            Device.state.in_(accepting(DeviceEvent.lease_taken)),
            or_(Device.lease_holder.is_(None), Device.lease_until < now, Device.lease_holder == holder),
        )
        .values(lease_holder=holder, lease_until=now + dt.timedelta(seconds=seconds), lease_timed=timed,
                **_lease_event(DeviceEvent.lease_taken))
        .execution_options(synchronize_session=False)
    )
    session.flush()
    _expire_device(session, device_id)
    return result.rowcount == 1


def adapter_group_of(session: Session, device_id: int) -> list[int]:
    """The device and the devices that share its GPU (its adapter group), by id."""
    group = session.scalar(select(Device.adapter_group).where(Device.id == device_id))
    if group is None:
        return [device_id]
    return list(session.scalars(select(Device.id).where(Device.adapter_group == group).order_by(Device.id)))


def release_device_lease(session: Session, device_id: int, holder: str) -> bool:
    """Give the lease back; False when `holder` did not hold it (it expired and was taken). A
    busy device is available again in the same statement (lease_released); one that its holder
    found offline or unauthorized, or that was quarantined meanwhile, stays so."""
    result = session.execute(
        update(Device)
        .where(Device.id == device_id, Device.lease_holder == holder)
        .values(lease_holder=None, lease_until=None, lease_timed=False, **_lease_event(DeviceEvent.lease_released))
        .execution_options(synchronize_session=False)
    )
    session.flush()
    _expire_device(session, device_id)
    return result.rowcount == 1


def expire_device_leases(session: Session, now: dt.datetime) -> list[int]:
    """Busy devices that nothing holds any more (their holder died without giving the lease
    back, and no one took it since) are available again (lease_expired); returns their ids."""
    ids = list(session.scalars(
        update(Device)
        .where(Device.state == DeviceState.busy, _unheld(now))
        .values(**_lease_event(DeviceEvent.lease_expired))
        .returning(Device.id)
        .execution_options(synchronize_session=False)))
    for device_id in ids:
        _expire_device(session, device_id)
    return sorted(ids)


def _unheld(now: dt.datetime):
    """The condition on Device that no lease holds it at `now` (none taken, or it ran out)."""
    return or_(Device.lease_holder.is_(None), Device.lease_until.is_(None), Device.lease_until < now)


def _expire_device(session: Session, device_id: int) -> None:
    # The UPDATE bypassed the ORM: drop stale lease and state values of an already loaded Device.
    device = session.identity_map.get(identity_key(Device, device_id))
    if device is not None:
        session.expire(device, ["lease_holder", "lease_until", "lease_timed", "state", "state_reason"])


# A device whose jobs end infra_failed this many times in a row is quarantined.
QUARANTINE_AFTER_INFRA_FAILURES = 3


def count_job_outcome(session: Session, device_id: int, outcome: JobState | str, error: str | None = None) -> int:
    """Count how a job ended on its device: infra_failed adds one to the device's failures in
    a row, succeeded or failed (the device ran it) starts the count again, anything else (a job
    requeued for another attempt) leaves it. The QUARANTINE_AFTER_INFRA_FAILURES-th in a row
    quarantines the device with the count and the last error as its reason (infra_failures).
    Returns the count."""
    if outcome in (JobState.succeeded, JobState.failed):
        values = {"infra_failures_in_row": 0}
    elif outcome == JobState.infra_failed:
        values = {"infra_failures_in_row": Device.infra_failures_in_row + 1}
    else:
        return get_device(session, device_id).infra_failures_in_row
    count = session.execute(update(Device).where(Device.id == device_id).values(**values)
                            .returning(Device.infra_failures_in_row)
                            .execution_options(synchronize_session=False)).scalar_one()
    device = session.identity_map.get(identity_key(Device, device_id))
    if device is not None:
        session.expire(device, ["infra_failures_in_row"])
    if count >= QUARANTINE_AFTER_INFRA_FAILURES:
        lines = (error or "").strip().splitlines()
        last = lines[0][:300] if lines else "no error recorded"
        apply_device_event(session, device_id, DeviceEvent.infra_failures,
                           f"{count} jobs in a row failed for infrastructure reasons; last: {last}")
    return count
