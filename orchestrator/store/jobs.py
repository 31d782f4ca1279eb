"""Jobs: creation, the job state machine (ALLOWED_TRANSITIONS), heartbeats, progress, redispatch,
and the queries the reconciler finds lost or waiting work with.
Every function takes a session and flushes; the caller commits."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session, aliased

from agent.protocol import JobSpec, ProtocolError, from_dict, to_dict

from .devices import TIMED_KINDS
from .models import (
    Build,
    Deployment,
    DeploymentStatus,
    Device,
    Job,
    JobKind,
    JobState,
    utcnow,
)
from .rows import InvalidTransition, StoreError, insert_or_get, redispatch_row, text_for_store

__all__ = [
    "ALLOWED_TRANSITIONS", "FINAL_STATES", "SETTLED_STATES", "create_job", "find_due_queued_jobs",
    "find_job", "find_jobs_after_failed_jobs", "find_jobs_of_failed_deployments", "find_jobs_waiting_too_long",
    "find_stale_running_jobs", "get_job", "heartbeat_job", "job_spec", "jobs_after_job", "jobs_of_batches", "jobs_of_deployment", "latency_specs", "workload",
    "record_job_progress", "redispatch_job", "spec_problem", "transition_job",
]


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


PENDING_ID = "pending"  # a job's JobSpec.job_id until the job has its row's id


def spec_problem(exc: ProtocolError) -> str:
    """What is wrong with a JobSpec, as its field says it ("steps must be at least 1, got 0")."""
    return str(exc).replace("JobSpec.", "").replace("JobSpec: ", "")


def submitted_spec(kind: JobKind | str, spec: JobSpec | dict[str, Any], device: Device,
                   build: Build | None = None) -> JobSpec:
    """The job as the device will run it, validated once, here (the protocol's own checks and
    defaults, agent/protocol.py): its kind, its build's name where it names none, and who runs
    the model. A device whose engine is its browser runs every job on the browser executor;
    the others run what the spec asks (native unless it says plan or browser). StoreError
    names a field that is wrong."""
    fields = to_dict(spec) if isinstance(spec, JobSpec) else dict(spec)
    fields |= {"job_id": PENDING_ID, "kind": str(JobKind(kind))}
    if build is not None:  # the job's build row, whatever a copied spec said
        fields["build"] = build.name
    if device.engine_host == "browser":
        if fields.get("executor", "native") not in ("native", "browser"):
            raise StoreError(f"device {device.serial!r} runs its engine in its browser: its jobs run on the "
                             f"browser executor, not {fields['executor']!r}")
        fields["executor"] = "browser"
    try:
        return from_dict(JobSpec, fields)
    except ProtocolError as exc:
        raise StoreError(f"the job's spec: {spec_problem(exc)}") from None


def workload(spec: dict[str, Any]) -> dict[str, Any]:
    """A stored spec without what names its job (job_id, kind, build: the job's row holds
    those): what a report shows and a rerun of the same work on another job submits."""
    return {k: v for k, v in (spec or {}).items() if k not in ("job_id", "kind", "build")}


def job_spec(job: Job, attempt: int | None = None) -> JobSpec:
    """The JobSpec stored with `job`, as submitted; with `attempt`, named for that attempt (each
    attempt's files on the device are its own). A job stored before specs were stored whole
    gets its kind and id from its row."""
    spec = from_dict(JobSpec, {"job_id": f"job{job.id}", "kind": str(job.kind)} | (job.spec or {}))
    return spec if attempt is None else dataclasses.replace(spec, job_id=f"job{job.id}-a{attempt}")


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
    the reconciler will). The spec is stored whole (submitted_spec: validated, its executor
    resolved for the device), named for the job once it has an id; StoreError for a bad one."""
    device = session.get(Device, device_id)
    if device is None:
        raise StoreError(f"no device {device_id}")
    build = session.get(Build, build_id) if build_id is not None else None
    submitted = submitted_spec(kind, spec, device, build)
    job = Job(
        kind=JobKind(kind),
        spec=to_dict(submitted),
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
    else:
        query = select(Job).where(Job.idempotency_key == idempotency_key)
        existing = session.scalar(query)
        if existing is not None:
            return existing
        job = insert_or_get(session, job, query)
    session.flush()
    if job.spec.get("job_id") == PENDING_ID:  # ours, not a row a racing transaction made first
        job.spec = to_dict(dataclasses.replace(submitted, job_id=f"job{job.id}"))
        session.flush()
    return job


def jobs_of_batches(session: Session, batch_ids) -> list[Job]:
    """The jobs of the batches `batch_ids`, in the order they were made."""
    return list(session.scalars(select(Job).where(Job.batch_id.in_(list(batch_ids))).order_by(Job.id)))


def latency_specs(session: Session, device_id: int, build_id: int) -> list[dict]:
    """The specs of the latency jobs a build ran on a device (each as submitted)."""
    return [spec or {} for spec in session.scalars(select(Job.spec).where(
        Job.device_id == device_id, Job.build_id == build_id, Job.kind == JobKind.latency))]


def find_job(session: Session, job_id: int) -> Job | None:
    """The job `job_id`, or None."""
    return session.get(Job, job_id)


def get_job(session: Session, job_id: int) -> Job:
    job = find_job(session, job_id)
    if job is None:
        raise StoreError(f"no job {job_id}; `farm jobs list` shows the known ones")
    return job


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


def record_job_progress(session: Session, job_id: int, attempt: int, progress: dict[str, Any]) -> None:
    """A running job's progress (one UPDATE, only while that attempt runs)."""
    session.execute(
        update(Job).where(Job.id == job_id, Job.state == JobState.running, Job.attempts == attempt)
        .values(progress=progress).execution_options(synchronize_session=False)
    )
    session.flush()


def redispatch_job(session: Session, job_id: int, due_at: dt.datetime, *, new_message: bool) -> int | None:
    """A queued job's owner moves its deadline to `due_at` (a busy device's retry, a send);
    with `new_message` its message is replaced: the dispatch sequence goes up and older
    messages are dropped when they arrive. Returns the sequence number the message must carry,
    or None when the job is no longer queued."""
    return redispatch_row(session, Job, job_id, [Job.state == JobState.queued], due_at, new_message)


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


def jobs_of_deployment(session: Session, deployment_id: int) -> list[Job]:
    """The queued jobs that wait for the deployment `deployment_id`, in the order they were made."""
    return list(session.scalars(select(Job).where(Job.deployment_id == deployment_id, Job.state == JobState.queued)
                                .order_by(Job.id)))


def jobs_after_job(session: Session, job_id: int) -> list[Job]:
    """The queued jobs that run after the job `job_id` (`after_job_id`), in the order they were made."""
    return list(session.scalars(select(Job).where(Job.after_job_id == job_id, Job.state == JobState.queued)
                                .order_by(Job.id)))


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
