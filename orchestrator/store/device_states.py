"""The device health state machine, as data: what can happen to a device (DeviceEvent), and
for each state the events it accepts and the state each one leads to (DEVICE_TRANSITIONS).
Everything that records a device's state goes through this one table: store.apply_device_event
on a loaded row, and the lease statements of store.acquire_device_lease and
store.release_device_lease, which compile their part of it into SQL so the state changes in
the same statement as the lease. docs/devices.md shows the same table (a test keeps the two
equal). A (state, event) pair missing from the table is refused."""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from .models import DeviceState


class DeviceEvent(StrEnum):
    answered = "answered"  # a probe or a job's transport reached the device
    unreachable = "unreachable"  # nobody answers at its address, or it stopped answering
    refused = "refused"  # it answers, but refuses this host (RSA key not accepted, bad token)
    lease_taken = "lease_taken"  # a job or deployment took (or renewed) the device's lease
    lease_released = "lease_released"  # its holder gave the lease back
    lease_expired = "lease_expired"  # its holder vanished without giving it back (the health check sees it)
    infra_failures = "infra_failures"  # the third job in a row ended infra_failed on it (store.count_job_outcome)
    quarantine = "quarantine"  # an operator took it out of service (`farm devices quarantine`)
    release = "release"  # an operator put it back (`farm devices release`)


class Transition(NamedTuple):
    to: DeviceState
    why: str
    ignored: bool = False  # allowed, but changes nothing: neither the state nor its reason


# Shorter names for the table's rows.
AVAILABLE, BUSY, OFFLINE = DeviceState.available, DeviceState.busy, DeviceState.offline
UNAUTHORIZED, QUARANTINED = DeviceState.unauthorized, DeviceState.quarantined
E = DeviceEvent
T = Transition

# (state, event) -> what follows. Observations (answered, unreachable, refused) carry a reason,
# recorded with the state; lease events clear the reason when they change the state.
DEVICE_TRANSITIONS: dict[tuple[DeviceState, DeviceEvent], Transition] = {
    (AVAILABLE, E.answered): T(AVAILABLE, "it still answers"),
    (AVAILABLE, E.unreachable): T(OFFLINE, "it stopped answering"),
    (AVAILABLE, E.refused): T(UNAUTHORIZED, "it no longer accepts this host"),
    (AVAILABLE, E.lease_taken): T(BUSY, "a job or deployment holds it"),
    (AVAILABLE, E.lease_released): T(AVAILABLE, "released after an operator freed it mid-job", ignored=True),

    (BUSY, E.answered): T(BUSY, "its holder still has it", ignored=True),
    (BUSY, E.unreachable): T(OFFLINE, "its job or deployment lost it"),
    (BUSY, E.refused): T(UNAUTHORIZED, "its job or deployment was refused"),
    (BUSY, E.lease_taken): T(BUSY, "renewed, or taken over after it expired"),
    (BUSY, E.lease_released): T(AVAILABLE, "its holder gave it back"),
    (BUSY, E.lease_expired): T(AVAILABLE, "its holder vanished; nothing holds it"),

    (OFFLINE, E.answered): T(AVAILABLE, "it answers again"),
    (OFFLINE, E.unreachable): T(OFFLINE, "still gone (the reason is the latest error)"),
    (OFFLINE, E.refused): T(UNAUTHORIZED, "it answers, but refuses this host"),
    (OFFLINE, E.lease_taken): T(BUSY, "a job or deployment tries it; its outcome decides what follows"),
    (OFFLINE, E.lease_released): T(OFFLINE, "its job found it offline, then gave it back", ignored=True),

    (UNAUTHORIZED, E.answered): T(AVAILABLE, "the phone accepted this host's key"),
    (UNAUTHORIZED, E.unreachable): T(OFFLINE, "it stopped answering"),
    (UNAUTHORIZED, E.refused): T(UNAUTHORIZED, "still refused (the reason is the latest error)"),
    (UNAUTHORIZED, E.lease_taken): T(BUSY, "a job or deployment tries it; its outcome decides what follows"),
    (UNAUTHORIZED, E.lease_released): T(UNAUTHORIZED, "its job was refused, then gave it back", ignored=True),

    (QUARANTINED, E.answered): T(QUARANTINED, "only an operator releases it", ignored=True),
    (QUARANTINED, E.unreachable): T(QUARANTINED, "only an operator releases it", ignored=True),
    (QUARANTINED, E.refused): T(QUARANTINED, "only an operator releases it", ignored=True),
    (QUARANTINED, E.lease_released): T(QUARANTINED, "quarantined while a job held it", ignored=True),
    (QUARANTINED, E.infra_failures): T(QUARANTINED, "already out of service", ignored=True),
    (QUARANTINED, E.quarantine): T(QUARANTINED, "the operator's new reason replaces the old one"),
    (QUARANTINED, E.release): T(AVAILABLE, "an operator put it back in service"),
}
# Every state in service is taken out of it the same two ways.
for _state in (AVAILABLE, BUSY, OFFLINE, UNAUTHORIZED):
    DEVICE_TRANSITIONS[(_state, E.infra_failures)] = T(QUARANTINED, "three jobs in a row failed for infrastructure reasons")
    DEVICE_TRANSITIONS[(_state, E.quarantine)] = T(QUARANTINED, "an operator took it out of service")
DEVICE_TRANSITIONS = dict(sorted(DEVICE_TRANSITIONS.items(),  # by state, then event, as declared
                                key=lambda pair: (list(DeviceState).index(pair[0][0]), list(E).index(pair[0][1]))))

# Why a pair missing from the table is refused, by event.
REFUSALS: dict[DeviceEvent, str] = {
    E.release: "it is {state}, not quarantined, and only a quarantined device is released",
    E.lease_taken: "it is {state}, and a quarantined device takes no work until an operator releases it",
    E.lease_expired: "it is {state}, and only a busy device has a lease to expire",
}


# The states the health check probes, with back-off, until the device answers.
PROBED_STATES = frozenset({OFFLINE, UNAUTHORIZED})


def transition(state: DeviceState | str, event: DeviceEvent | str) -> Transition | None:
    """What `event` does to a device in `state`; None when the table refuses it."""
    return DEVICE_TRANSITIONS.get((DeviceState(state), DeviceEvent(event)))


def refusal(state: DeviceState | str, event: DeviceEvent | str) -> str:
    """Why `event` is refused in `state`, in words."""
    state, event = DeviceState(state), DeviceEvent(event)
    why = REFUSALS.get(event, "it is {state}, and the state machine has no {event} from there")
    return f"{event} refused: {why.format(state=state, event=event)} (docs/devices.md)"


def moves(event: DeviceEvent) -> dict[DeviceState, DeviceState]:
    """The states `event` changes, and what each becomes (ignored and same-state pairs left
    out): what the lease statements compile into SQL."""
    return {state: t.to for (state, e), t in DEVICE_TRANSITIONS.items()
            if e == event and not t.ignored and t.to != state}


def accepting(event: DeviceEvent) -> list[DeviceState]:
    """The states in which `event` is allowed."""
    return [state for (state, e) in DEVICE_TRANSITIONS if e == event]


def markdown_table() -> str:
    """DEVICE_TRANSITIONS as the markdown table docs/devices.md carries."""
    lines = ["| from | event | to | why |", "|------|-------|----|-----|"]
    for (state, event), t in DEVICE_TRANSITIONS.items():
        to = f"{t.to} (ignored)" if t.ignored else str(t.to)
        lines.append(f"| {state} | {event} | {to} | {t.why} |")
    return "\n".join(lines)
