"""The job service: submission, the one place where work enters the farm. Which devices a
submission runs on (targeting, the quarantine rule), jobs queued for `farm jobs submit`,
deployments for `farm deploy`, suites (deploy, then jobs, then the batch's analysis) for
`farm regressions`, the demo, the more-repetitions rounds and the schedules beat fires, and
cancellation. The CLI and the Celery tasks call these functions; the work they write is
sent after the commit and delivered as orchestrator/jobs/dispatch.py promises."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery

from agent.protocol import JobSpec, ProtocolError, from_dict
from orchestrator import store
from orchestrator.analysis import profiles
from orchestrator.infra.settings import Settings
from orchestrator.jobs.celery_app import session_for, settings_of
from orchestrator.jobs.dispatch import Sends, grace
from orchestrator.store import Session
from orchestrator.store.models import (
    BATCH_SERIES,
    Batch,
    Deployment,
    Device,
    DeviceState,
    Job,
    JobState,
)

log = logging.getLogger(__name__)


# ---- targeting and limits -----------------------------------------------------------------


def target_devices(session: Session, devices: Sequence[str] | str, *, refuse_quarantined: bool,
                   holder: str = "", skipped: list[dict[str, Any]] | None = None) -> list[Device]:
    """The devices a submission runs on: "all" is every device that is not quarantined;
    otherwise the serials named, each once, in order. StoreError names an unknown serial, or
    says that no device is left.

    The quarantine rule: a quarantined device runs nothing. `farm jobs submit` refuses one
    named (`refuse_quarantined`), so the operator hears it at once. A suite does not: a schedule
    or a more-repetitions round names its devices long before it runs, and one quarantined
    device must not stop the others' runs; its jobs end infra_failed, with why, when they come
    to run (orchestrator/jobs/worker.py).

    The reservation rule (`farm devices reserve`): a person asking now (`refuse_quarantined`:
    `farm jobs submit`, `farm check`) is refused a reserved device they name, with its holder and
    end, so the holder's debugging is not disturbed and the asker hears why at once. "all" leaves
    reserved devices out, each one's line appended to `skipped` (a CI gate runs `farm check
    --all`: one person's booking must not fail everyone's pipeline), and is refused only when
    every device is reserved. A suite skips them too (_create_suite). The holder asking
    (`holder`: who asks, as the CLI knows them) runs on what they hold: that is what they
    reserved it for."""
    if devices == "all":
        targets = store.in_service_devices(session)
        if not targets:
            raise store.StoreError("no devices that are not quarantined; `farm devices list` shows them, "
                                   "`farm devices add` registers one")
    else:
        targets = [store.get_device(session, serial) for serial in dict.fromkeys(devices)]
    if not targets:
        raise store.StoreError("no devices to run on; `farm devices add` registers one")
    for device in targets:
        if refuse_quarantined and device.state == DeviceState.quarantined:
            reason = device.state_reason or "no reason given"
            raise store.StoreError(f"device {device.serial!r} is quarantined ({reason}); "
                                   f"`farm devices release {device.serial}` first")
    if refuse_quarantined and devices == "all":
        targets, left_out = skip_reserved(session, targets, "a request for all devices", holder)
        if skipped is not None:
            skipped.extend(left_out)
    elif refuse_quarantined:
        held = store.active_reservations(session, [d.id for d in targets])
        for device in targets:
            if device.id in held and not (holder and held[device.id].holder == holder):
                raise store.DeviceReserved(device.serial, held[device.id],
                                           "leave it out (name the other devices), or wait until it ends")
    return targets


def skip_reserved(session: Session, targets: list[Device], what: str,
                  holder: str = "") -> tuple[list[Device], list[dict[str, Any]]]:
    """A suite's devices less those a person other than `holder` holds now: (the rest, one entry
    per device skipped with its holder, end, note and the line that says so, logged here): the
    holder's own suite (their `farm check`) runs on what they hold. StoreError when every device
    is held: the suite would run nothing."""
    held = {device_id: r for device_id, r in store.active_reservations(session, [d.id for d in targets]).items()
            if not (holder and r.holder == holder)}
    skipped = [store.skip_entry(d.serial, held[d.id]) for d in targets if d.id in held]
    for entry in skipped:
        log.info("%s skips %s", what, entry["reason"])
    if skipped and len(skipped) == len(targets):
        raise store.StoreError("every device it runs on is reserved: " + "; ".join(e["reason"] for e in skipped))
    return [d for d in targets if d.id not in held], skipped


def check_time_limit(settings: Settings, spec: dict[str, Any]) -> None:
    """Refuse a job longer than the farm's longest job time: Redis would deliver its message
    again while it still runs (celery_app.visibility_timeout_s)."""
    limit = float(spec.get("time_limit_s") or JobSpec.time_limit_s)
    if limit > settings.max_job_time_s:
        raise store.StoreError(f"a time limit of {limit:g} s is over the farm's max_job_time_s "
                               f"({settings.max_job_time_s:g} s); ask for less or raise FARM_MAX_JOB_TIME_S")



# ---- submitting ---------------------------------------------------------------------------


def fit_refusals(settings: Settings, build_name: str, kind: str, spec: dict[str, Any],
                 devices: Sequence[Device]) -> dict[str, list[str]]:
    """Why a generate or latency job of `spec` cannot run on each of `devices` whose engine is a
    browser page: the job's engine plan, recorded here for the adapter that device's discovery
    recorded (limits and features), does not fit it or the job's GPU budget (engine.fit).
    `farm jobs submit` queues nothing then; a suite (a schedule's firing) fails those jobs as
    it makes them.
    {serial: reasons}, for the devices that cannot run it only; a device with no recorded
    adapter limits, or a build whose model folder is not on this host, is not judged here (the
    page judges it before it allocates anything)."""
    from engine.device import caps_from_dict
    from engine.errors import EngineError
    from engine.fit import fit_plan
    from engine.models.config import load_model_config
    from engine.plan import record_plan_within
    from engine.profiles import shipped_profiles

    pages = [d for d in devices if d.engine_host == "browser" and ((d.info or {}).get("adapter") or {}).get("limits")]
    try:  # the protocol's defaults, defined once (agent/protocol.py)
        job = from_dict(JobSpec, {"job_id": "fit", "kind": kind, "model": ""} | spec)
    except ProtocolError:
        return {}  # not judged here: the job's creation names what is wrong with it
    model_dir = settings.data_dir / "builds" / build_name / job.model
    if kind not in ("generate", "latency") or not pages or not job.model or not (model_dir / "model_index.json").is_file():
        return {}
    config = load_model_config(model_dir)
    profile = job.profile
    if profile not in ("auto", "family", "reference", *(p.name for p in shipped_profiles())):
        profile = "auto"  # a tuned or in-build profile: the family's stands in for it
    refusals: dict[str, list[str]] = {}
    judged: dict[str, list[str]] = {}  # the adapter's JSON -> its reasons
    for device in pages:
        adapter = device.info["adapter"]
        key = repr(sorted(adapter.items()))
        if key not in judged:
            try:
                caps = caps_from_dict(adapter)
                plan = record_plan_within(
                    config, caps, job.gpu_budget_bytes, precision=job.precision,
                    height=job.height or config.native_size[0], width=job.width or config.native_size[1],
                    steps=job.steps, scheduler=job.scheduler, guidance_scale=job.guidance_scale, profile=profile)
                judged[key] = fit_plan(plan, caps, job.gpu_budget_bytes).reasons
            except (EngineError, ValueError, TypeError) as exc:
                judged[key] = [f"no plan can be made for its adapter: {exc}"]
        if judged[key]:
            refusals[device.serial] = judged[key]
    return refusals


def queue_jobs(session: Session, settings: Settings, name: str, build_id: int, kind: str, spec: dict[str, Any],
               device_ids: list[int]) -> tuple[Batch, list[int]]:
    """One job per device as one batch (the build already deployed), for `farm jobs submit`;
    flushes only. The caller commits, then sends them with send_jobs (or the reconciler does
    once they are due). StoreError for a time limit the farm does not accept."""
    check_time_limit(settings, spec)
    batch = store.create_batch(session, name, build_id=build_id)
    job_ids = [store.create_job(session, kind, spec, device_id, build_id, batch_id=batch.id,
                                due_at=grace(settings)).id for device_id in device_ids]
    return batch, job_ids


def send_jobs(app: Celery, job_ids: list[int], *, strict: bool = False) -> list[int]:
    """Send run_job for each queued job (to its device's host queue) with a fresh deadline;
    what the CLI and tests use to start jobs that wait on no deployment. With `strict`, a broker
    that cannot be reached raises (the CLI says so) instead of leaving it to the reconciler.
    Returns the ids sent."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        for job_id in job_ids:
            sends.job(session, settings, job_id, store.redispatch_job(session, job_id, grace(settings),
                                                                      new_message=True))
    sends.send(app, strict=strict)
    return [job_id for job_id, *_ in sends.jobs]


def deploy_build(app: Celery, build_id: int, device_ids: list[int], batch_id: int, *,
                 allow_downgrade: bool = False) -> list[int]:
    """Deployments of a build to devices, recorded pending and sent; returns their ids. With
    `allow_downgrade` the build becomes current even where the device's is newer."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        ids = []
        for device_id in device_ids:
            deployment = store.create_deployment(session, build_id, device_id, batch_id=batch_id,
                                                 due_at=grace(settings), allow_downgrade=allow_downgrade)
            ids.append(deployment.id)
            sends.deployment(session, settings, deployment.id, deployment.dispatch_seq)
    sends.send(app)
    return ids


def _create_suite(session: Session, settings: Settings, sends: Sends, name: str, jobs: list[dict], *,
                  build: int | str | None, devices: list[str] | str, schedule_id: int | None,
                  idempotency_key: str | None, max_extra_rounds: int | None,
                  round_metrics: list[str] | None = None, purpose: str = BATCH_SERIES, holder: str = "") -> int:
    build_row = store.get_build(session, build)
    # A reserved device is skipped, and the batch says so (store.skipped_by_reservation, and its
    # analysis' summary): a schedule named its devices long before a person booked one. A
    # person's check was refused it before (target_devices).
    targets, _ = skip_reserved(session, target_devices(session, devices, refuse_quarantined=False), name, holder)
    if not jobs:
        raise store.StoreError("a suite needs at least one job")
    for entry in jobs:
        check_time_limit(settings, entry.get("spec") or {})
        if entry.get("engine_host") not in (None, "python", "browser"):
            raise store.StoreError(f"a job entry's engine_host is python or browser, not {entry['engine_host']!r}")
    batch = store.create_batch(session, name, build_id=build_row.id, schedule_id=schedule_id,
                               idempotency_key=idempotency_key,
                               max_extra_rounds=3 if max_extra_rounds is None else max_extra_rounds,
                               round_metrics=round_metrics, purpose=purpose)
    if idempotency_key is not None and batch.jobs:
        return batch.id  # launched before: the reconciler sends whatever of it has not run
    entry_builds = [build_row if entry.get("build") is None else store.get_build(session, entry["build"])
                    for entry in jobs]
    models: dict[int, str] = {}
    specs = []
    for entry, job_build in zip(jobs, entry_builds, strict=True):
        spec = dict(entry.get("spec") or {})
        if not spec.get("model"):
            if job_build.id not in models:
                models[job_build.id] = store.default_model(job_build)
            spec["model"] = models[job_build.id]
        specs.append(spec)
    # A job whose plan cannot fit a page's adapter would only fail on the phone: it fails here,
    # as it is made, with the reasons, and the rest of the suite runs.
    refusals = [fit_refusals(settings, job_build.name, entry["kind"], spec, targets)
                for entry, job_build, spec in zip(jobs, entry_builds, specs, strict=True)]
    for device in targets:
        deployments: dict[int, Deployment] = {}
        tune_job: int | None = None  # a "tuned" latency job runs after the device's tune job
        for index, (entry, job_build) in enumerate(zip(jobs, entry_builds, strict=True)):
            if entry.get("engine_host") not in (None, device.engine_host):
                continue  # an entry for the devices of another engine host
            spec = dict(specs[index])
            key = f"{idempotency_key}:{device.serial}:{index}" if idempotency_key else None
            if device.serial in refusals[index]:
                job = store.create_job(session, entry["kind"], spec, device.id, job_build.id, key,
                                       schedule_id=schedule_id, batch_id=batch.id)
                store.transition_job(session, job.id, JobState.failed, error=(
                    f"does not fit {device.serial}'s browser: {'; '.join(refusals[index][device.serial])}"))
                sends.batches.add(batch.id)
                continue
            if job_build.id not in deployments:
                deployments[job_build.id] = store.create_deployment(session, job_build.id, device.id,
                                                                    batch_id=batch.id, due_at=grace(settings))
            after = tune_job if spec.get("profile") == profiles.TUNED else None
            job = store.create_job(session, entry["kind"], spec, device.id, job_build.id, key,
                                   schedule_id=schedule_id, batch_id=batch.id,
                                   deployment_id=deployments[job_build.id].id, after_job_id=after)
            if entry["kind"] == "tune":
                tune_job = job.id
        for deployment in deployments.values():
            sends.deployment(session, settings, deployment.id, deployment.dispatch_seq)
    return batch.id


def launch_suite(
    app: Celery,
    name: str,
    jobs: list[dict],
    *,
    build: int | str | None = None,
    devices: list[str] | str = "all",
    schedule_id: int | None = None,
    idempotency_key: str | None = None,
    max_extra_rounds: int | None = None,
    round_metrics: list[str] | None = None,
    purpose: str = BATCH_SERIES,
    holder: str = "",
) -> int:
    """Start a batch (`purpose`: Batch.purpose, a check's or the series'): for each device (serials, or "all" devices not quarantined), deploy the
    build (newest when None) and then run every job of `jobs` ({"kind": ..., "spec": {...}},
    the spec's model defaulting to the build's) on it; each device's chain runs on its host's
    queue, all devices in parallel; the last job to settle sends the batch's analysis. With an
    `idempotency_key` (a schedule's firing), launching again changes nothing. An inconclusive
    analysis may launch `max_extra_rounds` follow-up batches with more repetitions (default 3),
    for the `round_metrics` only when given.
    A job entry may name its own "build" (id or name): the follow-up batches rerun the baseline
    build that way, next to the candidate. An entry with an "engine_host" (python, browser) runs
    on the devices whose engine that hosts only. Everything is written in one transaction and sent
    after it. A device someone reserved is skipped, unless `holder` holds it (their own check).
    Returns the batch id."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        batch_id = _create_suite(session, settings, sends, name, jobs, build=build, devices=devices,
                                 schedule_id=schedule_id, idempotency_key=idempotency_key,
                                 max_extra_rounds=max_extra_rounds, round_metrics=round_metrics, purpose=purpose,
                                 holder=holder)
    sends.send(app)
    return batch_id


# ---- schedules ----------------------------------------------------------------------------


def _schedule_suite(session: Session, settings: Settings, sends: Sends, schedule_id: int,
                    fired_at: dt.datetime) -> int:
    schedule = store.get_schedule(session, schedule_id)
    suite = dict(schedule.suite)
    stamp = fired_at.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return _create_suite(session, settings, sends, f"{schedule.name} {stamp}", suite.get("jobs") or [],
                         build=suite.get("build"), devices=suite.get("devices") or "all", schedule_id=schedule_id,
                         idempotency_key=f"schedule{schedule_id}:{stamp}", max_extra_rounds=None)


def fire_schedule(app: Celery, schedule_id: int, fired_at: dt.datetime) -> int:
    """Launch schedule `schedule_id`'s suite for its firing at `fired_at` (idempotent per firing)."""
    settings, sends = settings_of(app), Sends()
    with session_for(app) as session, session.begin():
        batch_id = _schedule_suite(session, settings, sends, schedule_id, fired_at)
    sends.send(app)
    return batch_id


def fire_due_schedules(app: Celery) -> list[int]:
    """Beat's tick: fire every enabled schedule that is due. A firing is claimed and its suite
    written in one transaction, so two beats, or a beat killed mid-tick, fire it exactly once.
    Returns the batches launched."""
    settings, batches = settings_of(app), []
    now = store.utcnow()
    with session_for(app) as session, session.begin():
        due = [(s.id, s.last_run_at, fire) for s, fire in store.due_schedules(session, now)]
    for schedule_id, previous, fire in due:
        sends = Sends()
        try:
            with session_for(app) as session, session.begin():
                if not store.claim_schedule_firing(session, schedule_id, previous, fire):
                    continue
                batches.append(_schedule_suite(session, settings, sends, schedule_id, fire))
        except Exception as exc:  # noqa: BLE001  (no build yet, no devices...: this firing is skipped, the next may work)
            error = str(exc) if isinstance(exc, store.StoreError) else f"{type(exc).__name__}: {exc}"
            log.error("schedule %s could not fire at %s: %s", schedule_id, fire.isoformat(), error)
            try:
                with session_for(app) as session, session.begin():
                    if store.claim_schedule_firing(session, schedule_id, previous, fire):
                        store.get_schedule(session, schedule_id).last_error = \
                            f"its firing at {fire:%Y-%m-%d %H:%M} UTC launched nothing: {error}"
            except Exception:  # noqa: BLE001  (the store itself failed: the next tick tries again)
                log.exception("schedule %s: could not record its failed firing", schedule_id)
            continue
        sends.send(app)
    return batches


# ---- cancelling ----------------------------------------------------------------------------


def cancel_job(session: Session, job_id: int) -> Job:
    """Cancel a queued or running job (flushes only; the caller commits, then settles its batch
    with dispatch.settle_batch: it may have been the batch's last open job). A queued job's
    task finds it cancelled and skips it; a running one is stopped on its device by its worker,
    whose next heartbeat finds the job no longer running (orchestrator.jobs.worker._Heartbeat), and
    whatever that run ended with is refused by the guarded transition, so the job stays
    cancelled."""
    job = store.get_job(session, job_id)
    session.refresh(job)
    if job.state not in (JobState.queued, JobState.running):
        raise store.InvalidTransition(f"job {job_id} is {job.state}: only queued or running jobs can be "
                                      "cancelled")
    return store.transition_job(session, job_id, JobState.cancelled, error="cancelled by operator")


def cancel_unsent(session: Session, job_ids: Sequence[int], reason: str) -> tuple[list[int], list[int]]:
    """Cancel the jobs of a submission whose sending failed (flushes only). Some may have gone
    out before the broker failed, and a worker may run one already: only jobs no worker has
    started (attempt 0) are cancelled, with `reason`; a running one goes on. Returns the ids
    cancelled and the ids that went on."""
    cancelled, went_on = [], []
    for job_id in job_ids:
        try:
            store.transition_job(session, job_id, JobState.cancelled, error=reason, attempt=0)
            cancelled.append(job_id)
        except store.InvalidTransition:
            went_on.append(job_id)
    return cancelled, went_on
