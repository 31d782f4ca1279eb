"""Data access for the store: every function takes a session, does its reads and writes,
flushes, and leaves the commit to the caller (a CLI command or a Celery task decides where
its transaction ends). Writes that other processes race for (device leases, job state
changes, idempotent creates) are single conditional statements or unique constraints, never
read-then-write in Python, so they hold on SQLite and PostgreSQL alike without row locks
(with_for_update() is silently ignored on SQLite)."""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import case, func, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased
from sqlalchemy.orm.util import identity_key

from agent.protocol import BadValue, DeviceInfo, JobResult, JobSpec, Manifest, check_plain, to_dict
from orchestrator import environment as run_env

from . import notifications
from .device_states import PROBED_STATES, DeviceEvent, accepting, moves, refusal, transition
from .models import (
    BATCH_SERIES,
    Alert,
    AlertState,
    Batch,
    Build,
    BuildFile,
    Deployment,
    DeploymentStatus,
    Device,
    DeviceState,
    DeviceStateChange,
    Host,
    Image,
    Job,
    JobKind,
    JobState,
    KernelTiming,
    Run,
    RunStatus,
    Sample,
    Schedule,
    ThermalReading,
    TransportKind,
    utcnow,
)

log = logging.getLogger(__name__)


class StoreError(Exception):
    """A request the store refuses (unknown id, forbidden transition); the message says why."""


class InvalidTransition(StoreError):
    pass


# ---- hosts and devices --------------------------------------------------------------------

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
        host = _insert_or_get(session, Host(name=name), select(Host).where(Host.name == name))
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
    runtime: str | None = None,
) -> Device:
    """Create or update the device `serial`; `info` (when given) refreshes its identity and
    marks it seen; `runtime` (python, browser) when given. A new device starts offline until
    something reports it available."""
    query = select(Device).where(Device.serial == serial)
    device = session.scalar(query)
    if device is None:
        device = _insert_or_get(
            session, Device(serial=serial, transport=TransportKind(transport), address=address,
                            runtime=runtime or "python"), query
        )
    device.transport = TransportKind(transport)
    if runtime is not None:
        device.runtime = runtime
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
    query = select(Device).where(Device.id == ref if isinstance(ref, int) else Device.serial == ref)
    device = session.scalar(query)
    if device is None:
        raise StoreError(f"no device {ref!r}; `farm devices list` shows the known ones")
    return device


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
    """Move a device through the state machine (orchestrator/db/device_states.py) on `event`,
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
        .where(Device.state == DeviceState.busy,
               or_(Device.lease_holder.is_(None), Device.lease_until.is_(None), Device.lease_until < now))
        .values(**_lease_event(DeviceEvent.lease_expired))
        .returning(Device.id)
        .execution_options(synchronize_session=False)))
    for device_id in ids:
        _expire_device(session, device_id)
    return sorted(ids)


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


# ---- builds and deployments ---------------------------------------------------------------


def manifest_sha256(manifest: Manifest) -> str:
    return hashlib.sha256(manifest.canonical_bytes()).hexdigest()


def create_build(session: Session, manifest: Manifest) -> Build:
    """Record a build and its files; the same manifest again returns the existing build."""
    digest = manifest_sha256(manifest)
    query = select(Build).where(Build.manifest_sha256 == digest)
    build = session.scalar(query)
    if build is not None:
        return build
    clash = session.scalar(select(Build).where(Build.name == manifest.build))
    if clash is not None:
        raise StoreError(f"build {manifest.build!r} already exists with another manifest "
                         f"({clash.manifest_sha256[:12]} != {digest[:12]}): give the new build another id")
    build = Build(
        name=manifest.build,
        version=manifest.version,
        source_revision=manifest.source_revision,
        manifest_sha256=digest,
        created=dt.datetime.fromtimestamp(manifest.created, dt.UTC),
        files=[BuildFile(path=f.path, sha256=f.sha256, size=f.size, mode=f.mode) for f in manifest.files],
    )
    return _insert_or_get(session, build, query)


def get_build(session: Session, ref: int | str | None = None) -> Build:
    """A build by id or name; the newest one when `ref` is None. StoreError when unknown."""
    if ref is None:
        build = session.scalar(select(Build).order_by(Build.created.desc(), Build.id.desc()).limit(1))
        if build is None:
            raise StoreError("no builds yet; `farm builds create --model DIR` makes one")
        return build
    build = session.scalar(select(Build).where(Build.id == ref if isinstance(ref, int) else Build.name == ref))
    if build is None:
        raise StoreError(f"no build {ref!r}; `farm builds list` shows the known ones")
    return build


def build_models(build: Build) -> list[str]:
    """The model folders a build ships (`models/<name>`, as job specs name them)."""
    return sorted({"/".join(f.path.split("/")[:2]) for f in build.files
                   if f.path.startswith("models/") and f.path.count("/") >= 2})


def default_model(build: Build) -> str:
    """The build's model folder when it ships exactly one; StoreError naming them otherwise."""
    models = build_models(build)
    if len(models) != 1:
        raise StoreError(f"build {build.name} ships {len(models)} models ({', '.join(models) or 'none'}): "
                         "name one with --model")
    return models[0]


def record_deployment(
    session: Session,
    build_id: int,
    device_id: int,
    status: DeploymentStatus | str,
    *,
    bytes_sent: int = 0,
    files_sent: int = 0,
    files_skipped: int = 0,
    duration_s: float | None = None,
    error: str | None = None,
    deployment_id: int | None = None,
    batch_id: int | None = None,
) -> Deployment:
    """Start a deployment (no `deployment_id`) or update one; a final status stamps finished_at."""
    status = DeploymentStatus(status)
    if deployment_id is None:
        deployment = Deployment(build_id=build_id, device_id=device_id, batch_id=batch_id)
        session.add(deployment)
    else:
        deployment = session.get(Deployment, deployment_id)
        if deployment is None:
            raise StoreError(f"no deployment {deployment_id}")
    deployment.status = status
    deployment.bytes_sent, deployment.files_sent, deployment.files_skipped = bytes_sent, files_sent, files_skipped
    deployment.duration_s, deployment.error = duration_s, error
    if status == DeploymentStatus.succeeded and deployment.bytes_total is None:
        deployment.bytes_total = bytes_sent
    if status in (DeploymentStatus.succeeded, DeploymentStatus.failed):
        deployment.finished_at = utcnow()
    session.flush()
    return deployment


def record_deployment_progress(session: Session, deployment_id: int, bytes_sent: int,
                               bytes_total: int | None) -> None:
    """A running deployment's bytes so far (one UPDATE; a finished one is left alone)."""
    session.execute(
        update(Deployment)
        .where(Deployment.id == deployment_id, Deployment.status == DeploymentStatus.running)
        .values(bytes_sent=bytes_sent, bytes_total=bytes_total)
        .execution_options(synchronize_session=False)
    )
    session.flush()


def record_job_progress(session: Session, job_id: int, attempt: int, progress: dict[str, Any]) -> None:
    """A running job's progress (one UPDATE, only while that attempt runs)."""
    session.execute(
        update(Job).where(Job.id == job_id, Job.state == JobState.running, Job.attempts == attempt)
        .values(progress=progress).execution_options(synchronize_session=False)
    )
    session.flush()


def create_deployment(session: Session, build_id: int, device_id: int, *, batch_id: int | None = None,
                      due_at: dt.datetime | None = None, allow_downgrade: bool = False) -> Deployment:
    """A pending deployment whose message must start it by `due_at` (now when None: the caller
    sends it right after its commit, or the reconciler will)."""
    deployment = Deployment(build_id=build_id, device_id=device_id, batch_id=batch_id,
                            status=DeploymentStatus.pending, due_at=due_at or utcnow(),
                            allow_downgrade=allow_downgrade)
    session.add(deployment)
    session.flush()
    return deployment


def get_deployment(session: Session, deployment_id: int) -> Deployment:
    deployment = session.get(Deployment, deployment_id)
    if deployment is None:
        raise StoreError(f"no deployment {deployment_id}")
    return deployment


def _update_row(session: Session, model, row_id: int, conditions: list, values: dict[str, Any]) -> bool:
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


def _update_deployment(session: Session, deployment_id: int, conditions: list, values: dict[str, Any]) -> bool:
    return _update_row(session, Deployment, deployment_id, conditions, values)


def _redispatch(session: Session, model, row_id: int, waiting: list, due_at: dt.datetime,
                new_message: bool) -> int | None:
    """Move a waiting row's deadline to `due_at`; with `new_message` its message is replaced:
    the dispatch sequence goes up and older messages are dropped when they arrive. Returns the
    sequence number the message must carry, or None when the row no longer waits."""
    values: dict[str, Any] = {"due_at": due_at}
    if new_message:
        values["dispatch_seq"] = model.dispatch_seq + 1
    if not _update_row(session, model, row_id, waiting, values):
        return None
    return session.scalar(select(model.dispatch_seq).where(model.id == row_id))


def start_deployment(session: Session, deployment_id: int, seq: int | None) -> int | None:
    """pending -> running for the message carrying dispatch sequence `seq` (any when None);
    returns the attempt number, or None when another execution or a newer message has it."""
    conditions = [Deployment.status == DeploymentStatus.pending]
    if seq is not None:
        conditions.append(Deployment.dispatch_seq == seq)
    now = utcnow()
    if not _update_deployment(session, deployment_id, conditions,
                              {"status": DeploymentStatus.running, "attempts": Deployment.attempts + 1,
                               "heartbeat_at": now, "started_at": now, "due_at": None, "error": None}):
        return None
    return session.scalar(select(Deployment.attempts).where(Deployment.id == deployment_id))


def heartbeat_deployment(session: Session, deployment_id: int) -> None:
    _update_deployment(session, deployment_id, [Deployment.status == DeploymentStatus.running],
                       {"heartbeat_at": utcnow()})


def finish_deployment(session: Session, deployment_id: int, attempt: int, status: DeploymentStatus, *,
                      error: str | None = None, bytes_sent: int = 0, files_sent: int = 0,
                      files_skipped: int = 0, duration_s: float | None = None, note: str | None = None) -> bool:
    """running -> succeeded/failed, only for the execution of attempt `attempt` (one the
    reconciler gave up on cannot settle a newer one). False when it no longer owns it."""
    values: dict[str, Any] = {"status": status, "error": error, "bytes_sent": bytes_sent, "files_sent": files_sent,
                              "files_skipped": files_skipped, "duration_s": duration_s, "finished_at": utcnow(),
                              "note": note}
    if status == DeploymentStatus.succeeded:
        values["bytes_total"] = func.coalesce(Deployment.bytes_total, bytes_sent)
    return _update_deployment(session, deployment_id, [Deployment.status == DeploymentStatus.running,
                                                       Deployment.attempts == attempt], values)


def requeue_deployment(session: Session, deployment_id: int, attempt: int, due_at: dt.datetime, error: str) -> bool:
    """A running deployment whose worker is gone goes back to pending (due by `due_at`)."""
    return _update_deployment(session, deployment_id, [Deployment.status == DeploymentStatus.running,
                                                       Deployment.attempts == attempt],
                              {"status": DeploymentStatus.pending, "due_at": due_at, "error": error,
                               "heartbeat_at": None})


def redispatch_deployment(session: Session, deployment_id: int, due_at: dt.datetime, *,
                          new_message: bool) -> int | None:
    """Like redispatch_job, for a pending deployment."""
    return _redispatch(session, Deployment, deployment_id, [Deployment.status == DeploymentStatus.pending], due_at,
                       new_message)


def pending_deployments(session: Session, device_ids: list[int]) -> list[Deployment]:
    """The deployments to these devices that wait to start (for a busy device or GPU), oldest first."""
    return list(session.scalars(select(Deployment).where(
        Deployment.device_id.in_(device_ids), Deployment.status == DeploymentStatus.pending).order_by(Deployment.id)))


def find_due_deployments(session: Session, now: dt.datetime, stale_before: dt.datetime) -> list[Deployment]:
    """Pending deployments past their deadline and running ones whose worker went silent."""
    last_heard = func.coalesce(Deployment.heartbeat_at, Deployment.started_at)
    return list(session.scalars(
        select(Deployment).where(or_(
            (Deployment.status == DeploymentStatus.pending) & or_(Deployment.due_at.is_(None), Deployment.due_at < now),
            (Deployment.status == DeploymentStatus.running) & (last_heard < stale_before),
        )).order_by(Deployment.id)))


# ---- jobs ---------------------------------------------------------------------------------

# queued -> running -> a result state. running -> queued and infra_failed -> queued are the
# retries of infrastructure failures (a dead worker, a lost device); a result is final.
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # queued -> infra_failed: the job could not start (its build's deployment failed).
    # queued -> failed: the job can never run as asked (its plan does not fit its device's
    # browser: engine.fit), so it fails as it is made, never sent.
    JobState.queued: frozenset({JobState.running, JobState.cancelled, JobState.infra_failed, JobState.failed}),
    JobState.running: frozenset(
        {JobState.succeeded, JobState.failed, JobState.infra_failed, JobState.cancelled, JobState.queued}
    ),
    JobState.infra_failed: frozenset({JobState.queued}),
    JobState.succeeded: frozenset(),
    JobState.failed: frozenset(),
    JobState.cancelled: frozenset(),
}
FINAL_STATES = frozenset(s for s, nxt in ALLOWED_TRANSITIONS.items() if not nxt)
# States a job rests in unless someone acts: an infra failure that was not requeued (its
# attempts are used up) ends its batch like a final state does.
SETTLED_STATES = FINAL_STATES | {JobState.infra_failed}


def create_job(
    session: Session,
    kind: JobKind | str,
    spec: JobSpec | dict[str, Any],
    device_id: int,
    build_id: int | None = None,
    idempotency_key: str | None = None,
    *,
    schedule_id: int | None = None,
    batch_id: int | None = None,
    deployment_id: int | None = None,
    after_job_id: int | None = None,
    due_at: dt.datetime | None = None,
) -> Job:
    """Queue a job. With an `idempotency_key`, asking again (a retried CLI call, a schedule
    firing twice) returns the job made the first time, even when both asks race. A job waits
    for `deployment_id` and for `after_job_id` (to succeed) when given; otherwise its message
    must start it by `due_at` (now when None: the caller sends it right after its commit, or
    the reconciler will)."""
    spec_dict = to_dict(spec) if isinstance(spec, JobSpec) else dict(spec)
    job = Job(
        kind=JobKind(kind),
        spec=spec_dict,
        device_id=device_id,
        build_id=build_id,
        schedule_id=schedule_id,
        batch_id=batch_id,
        idempotency_key=idempotency_key,
        deployment_id=deployment_id,
        after_job_id=after_job_id,
        queued_at=utcnow(),
        due_at=None if deployment_id is not None or after_job_id is not None else (due_at or utcnow()),
    )
    if idempotency_key is None:
        session.add(job)
        session.flush()
        return job
    query = select(Job).where(Job.idempotency_key == idempotency_key)
    existing = session.scalar(query)
    return existing if existing is not None else _insert_or_get(session, job, query)


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise StoreError(f"no job {job_id}; `farm jobs list` shows the known ones")
    return job


def text_for_store(text: str) -> str:
    """Free text from a device (an error, a log) as every backend keeps it: PostgreSQL refuses
    NUL characters in text, so each is stored as U+FFFD."""
    return text.replace("\x00", "\ufffd")


def transition_job(
    session: Session,
    job_id: int,
    state: JobState | str,
    *,
    error: str | None = None,
    log_tail: str | None = None,
    worker: str | None = None,
    attempt: int | None = None,
    due_at: dt.datetime | None = None,
    worker_lost: bool = False,
) -> Job:
    """Move a job to `state` if the rules allow it from its current state. The UPDATE is
    conditional on the state it was read in, so of two workers racing to start the same job
    exactly one wins; the other gets InvalidTransition. With `attempt`, also conditional on the
    job still being at that attempt: an execution that the reconciler replaced (its worker
    seemed dead, the job runs again) can no longer settle the new attempt. A job going back to
    queued is due by `due_at` (now when None). `worker_lost`: the attempt ended because its
    worker died, and counts in `worker_losses`."""
    job = get_job(session, job_id)
    session.refresh(job)
    target, current = JobState(state), job.state
    if target not in ALLOWED_TRANSITIONS[current]:
        raise InvalidTransition(f"job {job_id} cannot go from {current} to {target}")
    if attempt is not None and job.attempts != attempt:
        raise InvalidTransition(f"job {job_id} is at attempt {job.attempts}, not {attempt}; not moved to {target}")
    now = utcnow()
    values: dict[str, Any] = {"state": target}
    if target == JobState.running:
        values.update(attempts=Job.attempts + 1, started_at=now, heartbeat_at=now, finished_at=None,
                      worker=worker, error=None, due_at=None)
    elif target == JobState.queued:
        values.update(worker=None, heartbeat_at=None, queued_at=now, due_at=due_at or now)
    else:
        values.update(finished_at=now, due_at=None)
    if worker_lost:
        values["worker_losses"] = Job.worker_losses + 1
    if error is not None:
        values["error"] = text_for_store(error)
    if log_tail is not None:
        values["log_tail"] = text_for_store(log_tail)
    conditions = [Job.id == job_id, Job.state == current]
    if attempt is not None:
        conditions.append(Job.attempts == attempt)
    result = session.execute(
        update(Job)
        .where(*conditions)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        session.expire(job)
        raise InvalidTransition(f"job {job_id} changed state concurrently (was {current}); not moved to {target}")
    session.flush()
    session.refresh(job)
    return job


def heartbeat_job(session: Session, job_id: int, attempt: int | None = None) -> bool:
    """The worker running a job (attempt `attempt`) says it is alive; see
    find_stale_running_jobs. False when the job is no longer running at that attempt
    (cancelled, or given to another worker): its worker must stop it."""
    conditions = [Job.id == job_id, Job.state == JobState.running]
    if attempt is not None:
        conditions.append(Job.attempts == attempt)
    result = session.execute(
        update(Job).where(*conditions).values(heartbeat_at=utcnow()).execution_options(synchronize_session=False)
    )
    session.flush()
    return result.rowcount == 1


def redispatch_job(session: Session, job_id: int, due_at: dt.datetime, *, new_message: bool) -> int | None:
    """A queued job's owner moves its deadline to `due_at` (a busy device's retry, a send);
    with `new_message` its message is replaced: the dispatch sequence goes up and older
    messages are dropped when they arrive. Returns the sequence number the message must carry,
    or None when the job is no longer queued."""
    return _redispatch(session, Job, job_id, [Job.state == JobState.queued], due_at, new_message)


def _waits_on_deployment(job):  # `job`: Job or an alias of it
    return select(Deployment.id).where(
        Deployment.id == job.deployment_id,
        Deployment.status.in_([DeploymentStatus.pending, DeploymentStatus.running])).exists()


def _waits(job):
    """`job` (Job or an alias) is owned by what it waits for: a deployment still under way, or
    the job it runs after (`after_job_id`) while that one is queued or running."""
    prior = aliased(Job)
    waits_on_job = select(prior.id).where(prior.id == job.after_job_id,
                                          prior.state.in_([JobState.queued, JobState.running])).exists()
    return or_(_waits_on_deployment(job), waits_on_job)


def find_due_queued_jobs(session: Session, now: dt.datetime, device_id: int | list[int] | None = None,
                         limit: int = 500) -> list[Job]:
    """Queued jobs that need a message now, at most one per device, the first submitted first (a
    job sent again after its worker died keeps its place in line):
    past their deadline (never sent, their message lost with a dead worker, their deployment
    ended without sending them, or waiting for their device), on a device that no one holds
    (no live lease) and towards which no other job's message is on its way. A job that found
    its device busy waits with a deadline already past, so the first free moment sends it."""
    other = aliased(Job)
    in_flight = select(other.id).where(
        other.device_id == Job.device_id, other.id != Job.id, other.state == JobState.queued,
        other.due_at >= now, ~_waits(other)).exists()
    held = select(Device.id).where(Device.id == Job.device_id, Device.lease_holder.is_not(None),
                                   Device.lease_until >= now).exists()
    # The device's GPU is busy for this job: another device of its adapter group is leased, by
    # a timed holder, or at all when this job is timed (acquire_device_lease's rule).
    mine, peer = aliased(Device), aliased(Device)
    adapter_busy = select(peer.id).where(
        mine.id == Job.device_id, mine.adapter_group.is_not(None), peer.adapter_group == mine.adapter_group,
        peer.id != mine.id, peer.lease_holder.is_not(None), peer.lease_until >= now,
        or_(peer.lease_timed, Job.kind.in_(TIMED_KINDS))).exists()
    conditions = [Job.state == JobState.queued, or_(Job.due_at.is_(None), Job.due_at < now),
                  ~_waits(Job), ~held, ~adapter_busy, ~in_flight]
    if device_id is not None:
        conditions.append(Job.device_id.in_(device_id if isinstance(device_id, list) else [device_id]))
    rank = func.row_number().over(partition_by=Job.device_id, order_by=(Job.created_at, Job.id)).label("rank")
    firsts = select(Job.id, rank).where(*conditions).subquery()
    ids = select(firsts.c.id).where(firsts.c.rank == 1)
    return list(session.scalars(select(Job).where(Job.id.in_(ids)).order_by(Job.id).limit(limit)))


def find_jobs_waiting_too_long(session: Session, queued_before: dt.datetime, limit: int = 500) -> list[Job]:
    """Queued jobs (not waiting on a deployment or another job) queued before `queued_before`."""
    return list(session.scalars(
        select(Job).where(Job.state == JobState.queued,
                          func.coalesce(Job.queued_at, Job.created_at) < queued_before,
                          ~_waits(Job)).order_by(Job.id).limit(limit)))


def find_jobs_after_failed_jobs(session: Session, limit: int = 500) -> list[Job]:
    """Queued jobs whose prior job (`after_job_id`) ended without succeeding (that job's end
    ends them; this finds any it missed)."""
    prior = aliased(Job)
    failed = select(prior.id).where(prior.id == Job.after_job_id, prior.state.in_(
        [JobState.failed, JobState.cancelled, JobState.infra_failed])).exists()
    return list(session.scalars(select(Job).where(Job.state == JobState.queued, failed)
                                .order_by(Job.id).limit(limit)))


def find_jobs_of_failed_deployments(session: Session, limit: int = 500) -> list[Job]:
    """Queued jobs whose deployment failed (the deployment ends them; this finds any it missed)."""
    failed = select(Deployment.id).where(Deployment.id == Job.deployment_id,
                                         Deployment.status == DeploymentStatus.failed).exists()
    return list(session.scalars(select(Job).where(Job.state == JobState.queued, failed)
                                .order_by(Job.id).limit(limit)))


def find_stale_running_jobs(session: Session, older_than: dt.timedelta) -> list[Job]:
    """Jobs still marked running whose worker has not been heard from for `older_than`
    (a killed worker leaves them so): candidates for requeue or infra_failed."""
    cutoff = utcnow() - older_than
    last_heard = func.coalesce(Job.heartbeat_at, Job.started_at)
    return list(
        session.scalars(
            select(Job).where(Job.state == JobState.running, last_heard < cutoff).order_by(Job.id)
        )
    )


# ---- results ------------------------------------------------------------------------------


def record_result(session: Session, job_id: int, result: JobResult, attempt: int | None = None,
                  artifacts_dir: Path | None = None) -> Run:
    """Store what one attempt of a job brought back: a Run with its raw samples, kernel
    timings, thermal readings and images (an image's path is where the transport fetched it:
    `artifacts_dir` / its path in the result). Idempotent per (job, attempt): recording the same
    attempt again (a redelivered task) returns the stored run and writes nothing. The job's
    state is left to transition_job, in the same transaction. The run keeps the environment
    the agent read (result.environment), or, from an agent that sent none, what the device's
    record says now, marked source "device-record"."""
    try:  # what no backend keeps the same way (SQLite stores NaN as NULL, PostgreSQL refuses NUL)
        check_plain(to_dict(result), "result")
    except BadValue as exc:
        raise StoreError(f"the device's result cannot be stored: {exc}") from None
    job = get_job(session, job_id)
    attempt = job.attempts if attempt is None else attempt
    query = select(Run).where(Run.job_id == job_id, Run.attempt == attempt)
    existing = session.scalar(query)
    if existing is not None:
        return existing
    spec = job.spec or {}
    environment = result_environment(job.device, result)
    run = Run(
        job_id=job_id,
        attempt=attempt,
        device_id=job.device_id,
        build_id=job.build_id,
        status=RunStatus(result.status),
        error=result.error,
        started_at=_from_unix(result.started_at),
        finished_at=_from_unix(result.finished_at),
        adapter=result.device,
        engine=result.engine,
        cooldown_wait_s=result.cooldown_wait_s,
        cooldown_timed_out=result.cooldown_timed_out,
        artifacts=[to_dict(a) for a in result.artifacts],
        log_tail=result.log_tail,
        environment=environment,
        env_key=run_env.environment_key(environment),
    )
    stored = _insert_or_get(session, run, query)
    if stored is not run:  # another process stored this attempt first
        return stored
    _bulk(session, Sample, ({"run_id": run.id, "metric": s.metric, "unit": s.unit, "value": s.value,
                            "repetition": s.repetition} for s in result.samples))
    _bulk(session, KernelTiming, ({"run_id": run.id, "kernel": k.kernel, "calls": k.calls,
                                  "total_ms": k.total_ms, "repetition": k.repetition}
                                 for k in result.kernel_timings))
    _bulk(session, ThermalReading, ({"run_id": run.id, "phase": t.phase, "zone": t.zone,
                                    "celsius": t.celsius} for t in result.thermal))
    _bulk(session, Image, ({"run_id": run.id, "path": str(artifacts_dir / a.path) if artifacts_dir else a.path, "sha256": a.sha256, "size": a.size,
                           "prompt": spec.get("prompt", ""), "seed": spec.get("seed")}
                          for a in result.artifacts if a.kind == "image"))
    if result.log_tail:
        job.log_tail = result.log_tail
    session.flush()
    session.expire(run, ["samples", "kernel_timings", "thermal", "images"])
    return run


def result_environment(device: Device, result: JobResult | None = None) -> dict[str, Any]:
    """The environment of a run on `device`: the one `result` carries, else the device's record
    (marked source "device-record"), with the profile name the result's engine reports."""
    if result is not None and result.environment is not None:
        return to_dict(result.environment)
    profile = str((result.engine or {}).get("profile") or "") if result is not None else ""
    return run_env.from_device_record(os=device.os, os_version=device.os_version, driver=device.gpu_driver,
                                      info=device.info, profile=profile)


def _from_unix(seconds: float) -> dt.datetime | None:
    return dt.datetime.fromtimestamp(seconds, dt.UTC) if seconds else None


def _bulk(session: Session, model, rows: Iterable[dict]) -> None:
    rows = list(rows)
    if rows:
        session.execute(model.__table__.insert(), rows)


def _insert_or_get(session: Session, obj, query):
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


# ---- batches ------------------------------------------------------------------------------


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
    return _insert_or_get(session, batch, select(Batch).where(Batch.idempotency_key == idempotency_key))


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


def extra_round(idempotency_key: str | None) -> int:
    """Which more-repetitions round a batch is, from its idempotency key ("more:ROOT:N:DEVICE";
    0: the original batch)."""
    if idempotency_key and idempotency_key.startswith("more:"):
        return int(idempotency_key.split(":")[2])
    return 0


# ---- alerts -------------------------------------------------------------------------------


def get_alert(session: Session, alert_id: int) -> Alert:
    alert = session.get(Alert, alert_id)
    if alert is None:
        raise StoreError(f"no alert {alert_id}; `farm regressions list --all` shows them")
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


# ---- schedules ----------------------------------------------------------------------------


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


def get_schedule(session: Session, ref: int | str) -> Schedule:
    query = select(Schedule).where(Schedule.id == ref if isinstance(ref, int) else Schedule.name == ref)
    schedule = session.scalar(query)
    if schedule is None:
        raise StoreError(f"no schedule {ref!r}; `farm schedules list` shows the known ones")
    return schedule


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
