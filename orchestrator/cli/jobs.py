"""`farm jobs ...`: submit generate, latency and tune jobs to devices (one batch, one job per
device, sent to the workers of the hosts the devices are plugged into), follow them until they
end, and list, show, cancel and read the logs of jobs. Reads go through
orchestrator/store/queries.py; the job rows and their transitions through the store."""

from __future__ import annotations

import datetime as dt
import io
import math
import time
from pathlib import Path
from typing import Any

import typer

from orchestrator.store.models import Build, Job, JobKind, JobState

from . import common, completion, labels, validate
from .output import Table, Text, console, err_console, escape, styled

app = typer.Typer(help="Submit, follow and inspect jobs.", no_args_is_help=True)

# What `submit --wait` ends with when a job is still not final at --timeout, or one did not
# succeed: the farm could not do the work (common.py's exit-code table).
EXIT_TIMEOUT = common.COULD_NOT_RUN
POLL_S = 0.5
# A job seen infra_failed has used its attempts: a retry is queued in the same transaction.
ENDED = frozenset({JobState.succeeded, JobState.failed, JobState.infra_failed, JobState.cancelled})

_STATE_STYLE = {"queued": "cyan", "running": "yellow", "succeeded": "green", "failed": "red",
                "infra_failed": "red", "cancelled": "magenta"}


def _state(state: JobState | str) -> Text:
    return styled(state, _STATE_STYLE.get(str(state), "white"))


def _when(value: dt.datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"


def _fmt_metric(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric.endswith("_bytes"):
        return f"{value / 2**20:,.0f} MiB"
    return f"{value:,.1f}"


def progress_note(progress: dict | None) -> str:
    """A running job's progress in a few words: "unet_step 4/10"."""
    if not progress or not progress.get("phase"):
        return ""
    steps = f" {progress['done']}/{progress['total']}" if progress.get("total") else ""
    return f"{progress['phase']}{steps}"


def job_dict(job: Job, runs: list[dict] | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": job.id,
        "kind": str(job.kind),
        "state": str(job.state),
        "device": job.device.serial,
        "build": job.build.name if job.build is not None else None,
        "batch_id": job.batch_id,
        "schedule_id": job.schedule_id,
        "attempts": job.attempts,
        "worker_losses": job.worker_losses,  # attempts that ended because their worker died
        "worker": job.worker,
        "created_at": common.iso(job.created_at),
        "started_at": common.iso(job.started_at),
        "heartbeat_at": common.iso(job.heartbeat_at),
        "finished_at": common.iso(job.finished_at),
        "error": job.error,
        "progress": job.progress,  # the agent's last phase and step, as relayed while it ran
    }
    if runs is not None:
        data["spec"] = job.spec
        data["runs"] = runs
    return data


# ---- submit -------------------------------------------------------------------------------


def _build_spec(kind: JobKind, build: Build, model: str | None, **fields: Any) -> dict[str, Any]:
    """The job's spec as stored (a JobSpec without job_id and kind, which the task fills in),
    read through the protocol the way the worker will read it, so a bad value fails here and
    not on the device."""
    from agent.protocol import JobSpec, ProtocolError, from_dict, to_dict
    from engine.schedulers import SCHEDULERS
    from orchestrator import store

    if fields["scheduler"] not in SCHEDULERS:
        common.fail(f"--scheduler {fields['scheduler']!r}: choose one of {', '.join(SCHEDULERS)}")
    cooldown_c, cooldown_wait = fields.pop("cooldown_celsius"), fields.pop("cooldown_wait_s")
    if cooldown_wait is not None and cooldown_c is None:
        common.fail("--cooldown-wait needs --cooldown CELSIUS")
    fields["height"], fields["width"] = fields.pop("resolution") or (None, None)
    if cooldown_c is not None:
        fields["cooldown"] = {"max_celsius": cooldown_c} | ({} if cooldown_wait is None else
                                                            {"max_wait_s": cooldown_wait})
    fields |= {"job_id": "submit", "kind": str(kind), "model": model, "build": build.name}
    try:
        spec = from_dict(JobSpec, fields)
    except ProtocolError as exc:
        common.fail(store.spec_problem(exc))
    data = to_dict(spec)
    del data["job_id"], data["kind"]
    return data


def _budget_bytes(mb: float) -> int:
    if not math.isfinite(mb) or mb <= 0:
        common.fail(f"--gpu-budget-mb {mb}: expected a positive number of MB")
    return int(mb * 1e6)


def _init_image_uri(path: Path) -> str:
    """An init image as the data: URI the job carries: a PNG or JPEG, read and checked here so
    a bad file fails before it is queued."""
    import base64

    from PIL import Image, UnidentifiedImageError

    from agent.protocol import INIT_IMAGE_MAX_BYTES

    path = path.expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        common.fail(f"--init-image {path}: {exc.strerror or exc}")
    if len(data) > INIT_IMAGE_MAX_BYTES:
        common.fail(f"--init-image {path}: {len(data)} bytes; at most {INIT_IMAGE_MAX_BYTES} (it travels with the job)")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image_format = image.format
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        common.fail(f"--init-image {path}: not a readable image ({exc})")
    if image_format not in ("PNG", "JPEG"):
        common.fail(f"--init-image {path}: a {image_format} image; give a PNG or JPEG")
    return f"data:image/{image_format.lower()};base64,{base64.b64encode(data).decode()}"


@app.command()
def submit(
    kind: JobKind = typer.Argument(..., help="generate, latency or tune."),
    build_name: str = typer.Option(None, "--build", help="Build to run: id, label or name (default: the newest "
                                   "build).", autocompletion=completion.builds),
    devices: list[str] = typer.Option(None, "--device", help="Device serial (repeatable).",
                                      autocompletion=completion.devices),
    all_devices: bool = typer.Option(False, "--all", help="Every device that is not quarantined."),
    name: str = typer.Option(None, "--name", help="Batch name (default: <kind> <build> <UTC time>)."),
    model: str = typer.Option(None, "--model", help="Model folder in the build (default: its only "
                              "models/<name>).", callback=validate.path_in_build),
    prompt: str = typer.Option("a photograph of an astronaut riding a horse", "--prompt"),
    negative_prompt: str = typer.Option("", "--negative-prompt"),
    seed: int = typer.Option(0, "--seed"),
    steps: int = typer.Option(20, "--steps", help="Denoising steps."),
    scheduler: str = typer.Option("pndm", "--scheduler", help="pndm, ddim, euler, euler_ancestral, dpmpp_2m."),
    guidance_scale: float = typer.Option(7.5, "--guidance-scale"),
    precision: str = validate.precision_option(),
    resolution: str = validate.resolution_option(),
    profile: str = typer.Option("auto", "--profile", help="auto, reference, a shipped profile name or "
                                "a path in the build.", callback=validate.path_in_build),
    warmup: int = typer.Option(1, "--warmup", help="latency/tune: untimed warm-up runs."),
    repetitions: int = validate.repetitions_option(),
    unet_repetitions: int = validate.unet_repetitions_option(),
    kernel_timings: bool = typer.Option(True, "--kernel-timings/--no-kernel-timings",
                                        help="latency: per-kernel GPU times."),
    kernel_repetitions: int = typer.Option(None, "--kernel-repetitions",
                                           help="latency: profiled UNet steps for the per-kernel times "
                                           "(default: as many as --unet-repetitions)."),
    tune_repeats: int = typer.Option(5, "--tune-repeats", help="tune: timed runs per variant."),
    tune_budget: float = typer.Option(600.0, "--tune-budget", help="tune: seconds at most."),
    time_limit: float = typer.Option(3600.0, "--time-limit", help="Seconds a job may run on the device."),
    gpu_budget_mb: float = typer.Option(None, "--gpu-budget-mb", help="GPU memory the job's plans may hold, "
                                        "in MB (10^6 bytes; plan and browser executors): weights are staged "
                                        "when only that fits, and a plan that cannot fit fails at once."),
    cooldown: float = typer.Option(None, "--cooldown", help="Wait until the device is at most this "
                                   "many degrees C before running."),
    cooldown_wait: float = typer.Option(None, "--cooldown-wait", help="Longest cool-down wait, seconds."),
    init_image: Path = typer.Option(None, "--init-image", help="generate: start from this PNG or JPEG "
                                    "(img2img); it travels with the job.", dir_okay=False),
    strength: float = typer.Option(None, "--strength", help="generate with --init-image: how far the "
                                   "image is noised before denoising, in (0, 1] (default 0.8)."),
    wait: bool = typer.Option(False, "--wait", help="Follow the jobs until they end; exit 0 only if "
                              f"all succeeded ({common.COULD_NOT_RUN} when one did not or on --timeout)."),
    timeout: float = typer.Option(None, "--timeout", min=1, help="With --wait: give up (exit 4) after this many "
                                  "seconds; the jobs go on."),
    as_json: bool = common.JSON_OPTION,
):
    """Queue one job per device as one batch and send them to the workers."""

    from orchestrator import store
    from orchestrator.jobs import jobservice
    from orchestrator.jobs.celery_app import make_celery

    if bool(devices) == all_devices:
        common.fail("name the devices with --device SERIAL (repeatable) or pass --all, not both")
    if timeout is not None and not wait:
        common.fail("--timeout only applies with --wait")
    if init_image is not None and kind != JobKind.generate:
        common.fail(f"--init-image is for generate jobs, not {kind}")
    if strength is not None and init_image is None:
        common.fail("--strength needs --init-image")
    settings = common.cli_settings()
    with common.open_store(settings) as sessions:
        with sessions() as session:
            try:
                build = store.get_build(session, build_name)
                model = model or store.default_model(build)
                skipped: list[dict] = []
                targets = jobservice.target_devices(session, "all" if all_devices else devices,
                                                    refuse_quarantined=True, holder=common.current_user(),
                                                    skipped=skipped)
            except store.StoreError as exc:
                common.fail(str(exc))
            for entry in skipped:
                err_console.print(f"left out: {entry['reason']}", highlight=False, markup=False)
            spec = _build_spec(kind, build, model, prompt=prompt, negative_prompt=negative_prompt, seed=seed,
                               steps=steps, scheduler=scheduler, guidance_scale=guidance_scale,
                               precision=precision, resolution=resolution, profile=profile, warmup=warmup,
                               repetitions=repetitions, unet_repetitions=unet_repetitions,
                               kernel_timings=kernel_timings, kernel_repetitions=kernel_repetitions,
                               tune_repeats=tune_repeats,
                               tune_time_budget_s=tune_budget, time_limit_s=time_limit,
                               gpu_budget_bytes=None if gpu_budget_mb is None else _budget_bytes(gpu_budget_mb),
                               cooldown_celsius=cooldown, cooldown_wait_s=cooldown_wait,
                               init_image=_init_image_uri(init_image) if init_image else None,
                               strength=0.8 if strength is None else strength)
            # A page that cannot hold the job's plan would only fail on the phone: said here instead.
            refusals = jobservice.fit_refusals(settings, build.name, str(kind), spec, targets)
            if refusals:
                common.fail("nothing queued: the job does not fit " + "; ".join(
                    f"{serial} ({', '.join(reasons)})" for serial, reasons in refusals.items())
                    + ". Leave those devices out, or change the job (--gpu-budget-mb, --resolution, --precision)")
            stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            try:
                batch, job_ids = jobservice.queue_jobs(session, settings, name or f"{kind} {build.name} {stamp}",
                                                       build.id, kind, spec, [device.id for device in targets])
            except store.StoreError as exc:
                common.fail(str(exc))
            session.commit()
            batch_id, batch_name, build_label = batch.id, batch.name, build.name
            serials = [d.serial for d in targets]

        # Sent after the commit, so a worker never looks for a job that is not there yet.
        try:
            jobservice.send_jobs(make_celery(settings), job_ids, strict=True)
        except Exception as exc:  # noqa: BLE001  (a broker that cannot be reached, in any of its forms)
            with sessions() as session:
                cancelled, running = jobservice.cancel_unsent(session, job_ids, f"not sent: {exc}")
                session.commit()
            went_on = f"; job(s) {', '.join(map(str, running))} had reached a worker and go on" if running else ""
            common.could_not_run(f"could not send the jobs to the workers ({type(exc).__name__}: {exc}); "
                 f"batch {batch_id}'s {len(cancelled)} unsent job(s) are cancelled{went_on}")

        submitted = {"batch_id": batch_id, "batch": batch_name, "build": build_label, "kind": str(kind),
                     "jobs": [{"id": j, "device": s} for j, s in zip(job_ids, serials, strict=True)]}
        if not as_json:
            console.print(f"batch {batch_id} ({batch_name}): {len(job_ids)} {kind} job(s) of build "
                          f"[bold]{build_label}[/] queued: " + ", ".join(f"{j} on {s}" for j, s in
                                                                        zip(job_ids, serials, strict=True)),
                          highlight=False, soft_wrap=True)
        if not wait:
            if as_json:
                common.print_json(submitted)
            return
        states, timed_out = _follow(sessions, settings, job_ids, timeout, quiet=as_json)

    succeeded = all(s[2] == JobState.succeeded for s in states)
    if as_json:
        submitted["jobs"] = [{"id": j, "device": d, "state": str(st), "attempts": a, "error": e}
                             for j, d, st, a, e, _ in states]
        submitted["timed_out"] = timed_out
        common.print_json(submitted)
    elif timed_out:
        console.print(f"[bold red]error:[/] gave up waiting after {timeout:g} s; the jobs go on "
                      f"(`farm jobs list --batch {batch_id}`)", highlight=False, soft_wrap=True)
    elif not succeeded:
        failed = [f"{j} on {d}: {st}" + (f" ({e.splitlines()[0]})" if e else "") for j, d, st, _, e, _p in states
                  if st != JobState.succeeded]
        console.print("[bold red]error:[/] " + "; ".join(failed), highlight=False, soft_wrap=True)
    if timed_out or not succeeded:
        raise typer.Exit(EXIT_TIMEOUT)


def _follow(sessions, settings, job_ids: list[int], timeout: float | None, quiet: bool):
    """Poll the jobs' states (a short transaction each time) until every job has ended or
    `timeout` passes, through the shared watch (orchestrator/services/progress.py): a live table
    on a terminal, a line per change when piped, a host no worker serves named within seconds
    and with every reminder; returns the last states and whether it timed out."""
    from orchestrator import store
    from orchestrator.services import progress as watched
    from orchestrator.store import queries

    from .watching import Reporter

    started = time.monotonic()
    states: list = []

    def read(session) -> list:
        states[:] = queries.job_states(session, job_ids)
        return watched.job_steps([store.get_job(session, job_id) for job_id in job_ids])

    def render(states) -> Table:
        done = sum(1 for s in states if s[2] in ENDED)
        table = Table("job", "device", "state", "attempts", "note",
                      title=f"{done}/{len(states)} ended, {time.monotonic() - started:.0f} s")
        for job_id, serial, state, attempts, error, progress in states:
            note = (error or "").splitlines()[0][:80] if error else (
                progress_note(progress) if state == JobState.running else "")
            table.add_row(str(job_id), serial, _state(state), str(attempts), note)
        return table

    # --json: nothing but the document on stdout (the Reporter says a missing worker on stderr)
    with Reporter("jobs", quiet=quiet, view=lambda p: render(states)) as reporter:
        ending = watched.watch(sessions, settings, read, reporter, timeout_s=timeout, poll_s=POLL_S)
    return states, ending.reason != "done"


# ---- inspect ------------------------------------------------------------------------------


@app.command("list")
def list_jobs(
    state: JobState = typer.Option(None, "--state", help="Only jobs in this state."),
    device: str = typer.Option(None, "--device", help="Only jobs of this device (serial).",
                               autocompletion=completion.devices),
    build: str = typer.Option(None, "--build", help="Only jobs of this build (id, label or name).",
                              autocompletion=completion.builds),
    batch: int = typer.Option(None, "--batch", help="Only jobs of this batch (id).", parser=validate.record_id),
    limit: int = typer.Option(50, "--limit", min=1, help="At most this many, newest first."),
    as_json: bool = common.JSON_OPTION,
):
    """List jobs, newest first."""
    from orchestrator import store
    from orchestrator.store import queries

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        device_id = common.get_or_fail(store.get_device, session, device).id if device else None
        build_id = common.get_or_fail(store.get_build, session, build).id if build else None
        jobs = queries.list_jobs(session, state=state, device_id=device_id, build_id=build_id, batch_id=batch,
                                 limit=limit)
        rows = [job_dict(j) for j in jobs]
        shown = labels.build_names(session, [r["build"] for r in rows])
    if common.print_json_or_empty(rows, as_json, "no jobs" + (" match" if any((state, device, build, batch)) else
                                                       "; submit some with `farm jobs submit KIND --all`")):
        return
    table = Table("id", "kind", "device", "build", "batch", "state", "attempts", "created", "finished")
    for j, r in zip(jobs, rows, strict=True):
        table.add_row(str(r["id"]), r["kind"], r["device"], shown.get(r["build"] or "", "-"), str(r["batch_id"] or "-"),
                      _state(r["state"]), str(r["attempts"]), _when(j.created_at), _when(j.finished_at))
    console.print(table)
    labels.legend(shown)


@app.command()
def show(job_id: int = typer.Argument(..., help="Job id.", parser=validate.record_id), as_json: bool = common.JSON_OPTION):
    """Show one job: spec, state, attempts, timestamps, and its runs with their key medians."""
    from orchestrator import store
    from orchestrator.store import queries

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            job = store.get_job(session, job_id)
        except store.StoreError as exc:
            common.fail(str(exc))
        meds = queries.medians(session, [r.id for r in job.runs], queries.KEY_METRICS)
        runs = [{"id": r.id, "attempt": r.attempt, "status": str(r.status), "error": r.error,
                 "started_at": common.iso(r.started_at), "finished_at": common.iso(r.finished_at), "adapter": r.adapter,
                 "medians": meds.get(r.id, {})} for r in job.runs]
        data = job_dict(job, runs)
    if as_json:
        common.print_json(data)
        return
    table = Table(show_header=False, box=None)
    for key, value in data.items():
        if key in ("spec", "runs"):
            continue
        shown = progress_note(value) or "-" if key == "progress" else str(value)
        table.add_row(key, _state(value) if key == "state" else "-" if value in (None, "") else shown)
    console.print(table)
    spec = Table("spec", "value", box=None)
    for key, value in data["spec"].items():
        spec.add_row(key, "-" if value is None else str(value))
    console.print(spec)
    if not runs:
        console.print("no runs yet")
        return
    metrics = [m for m in queries.KEY_METRICS if any(m in r["medians"] for r in runs)]
    table = Table("run", "attempt", "status", "finished", *metrics, "error")
    for r in runs:
        table.add_row(str(r["id"]), str(r["attempt"]), _state(r["status"]),
                      (r["finished_at"] or "-")[:19].replace("T", " "),
                      *(_fmt_metric(m, r["medians"].get(m)) for m in metrics),
                      (r["error"] or "").splitlines()[0][:60] if r["error"] else "")
    console.print(table)


@app.command()
def cancel(job_id: int = typer.Argument(..., help="Job id.", parser=validate.record_id)):
    """Cancel a queued or running job.

    A running job is stopped on its device within seconds (its worker's next heartbeat); what
    it had done is not recorded."""
    from orchestrator import store
    from orchestrator.jobs.jobservice import cancel_job

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            job = cancel_job(session, job_id)
        except store.StoreError as exc:
            common.fail(str(exc))
        session.commit()
        batch_id = job.batch_id
    console.print(f"job {job_id} cancelled", highlight=False)
    if batch_id is not None:  # it may have been its batch's last open job: the analysis follows
        from orchestrator.jobs.celery_app import make_celery
        from orchestrator.jobs.dispatch import settle_batch

        settle_batch(make_celery(common.cli_settings()), batch_id)


@app.command()
def logs(
    job_id: int = typer.Argument(..., help="Job id.", parser=validate.record_id),
    lines: int = typer.Option(None, "--lines", "-n", min=1, help="Only the last N lines of each log."),
):
    """Print the log tail of a job and of each of its runs."""
    from orchestrator import store

    def tail(text: str) -> str:
        out = text.rstrip("\n").splitlines()
        return "\n".join(out[-lines:] if lines else out)

    with common.open_store(common.cli_settings()) as sessions, sessions() as session:
        try:
            job = store.get_job(session, job_id)
        except store.StoreError as exc:
            common.fail(str(exc))
        runs = list(job.runs)
        console.print(f"[bold]job {job.id}[/] {job.kind} on {escape(job.device.serial)}: {_state(job.state).markup}, "
                      f"{job.attempts} attempt(s)", highlight=False)
        if job.error:
            console.print(f"error: {job.error}", highlight=False, soft_wrap=True, markup=False)
        for run in runs:
            console.print(f"[bold]--- run {run.id} (attempt {run.attempt}, {run.status}) ---[/]", highlight=False)
            if run.error:
                console.print(f"error: {run.error}", highlight=False, soft_wrap=True, markup=False)
            typer.echo(tail(run.log_tail) if run.log_tail else "(no log)")
        # The job keeps the last log it was given; it is a run's own unless no run came back.
        if job.log_tail and (not runs or job.log_tail != runs[-1].log_tail):
            console.print("[bold]--- job ---[/]", highlight=False)
            typer.echo(tail(job.log_tail))
        elif not runs and not job.log_tail:
            console.print("no log yet", highlight=False)
