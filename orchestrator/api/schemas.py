"""What the farm API sends and accepts, as pydantic models: its OpenAPI document is made from
these, so every field a client reads is named and typed there. Each model is built from the
store's rows by its `of` class method; the fields are those of the CLI's --json output for the
same thing (`farm devices list --json`, `farm jobs show --json`, ...)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from orchestrator import store
from orchestrator.analysis import regressions
from orchestrator.analysis.stats import SeriesKey
from orchestrator.dashboard import views
from orchestrator.store.models import (
    Alert,
    AlertKind,
    AlertState,
    ApiScope,
    Build,
    CheckRun,
    CheckState,
    Device,
    DeviceReservation,
    DeviceScreenshot,
    DeviceState,
    Job,
    JobKind,
    JobState,
    RunStatus,
    TransportKind,
)

Metric = Literal[tuple(regressions.HEADLINE_METRICS)]  # type: ignore[valid-type]
PLAIN = r"^[^\x00]*$"  # PostgreSQL refuses NUL in text
Serial = Annotated[str, Field(min_length=1, max_length=255, pattern=PLAIN)]


class FieldProblem(BaseModel):
    """One bad field of a malformed request."""

    field: str = Field(description="Where: `body.max_rounds`, `query.limit`, `path.alert_id`.")
    problem: str = Field(description="What is wrong with it, in one line.")


class Problem(BaseModel):
    """Every error, whatever its status: what went wrong and, where there is one, what to do."""

    detail: str = Field(description="One line.")
    errors: list[FieldProblem] = Field(default_factory=list,
                                       description="Each bad field of a malformed request (422); else empty.")


class Me(BaseModel):
    """The token a request was made with."""

    id: int
    name: str
    scope: ApiScope
    grants: list[ApiScope]


# ---- builds and devices -------------------------------------------------------------------


class BuildFileOut(BaseModel):
    path: str
    sha256: str
    size: int
    mode: int


class BuildOut(BaseModel):
    id: int
    name: str
    label: str | None = Field(description="The short name people gave it (`farm builds label`), if any.")
    display: str = Field(description="What tables and charts call it: its label, else the distinguishing end of "
                                     "its name among the builds listed with it.")
    version: str
    source_revision: str
    manifest_sha256: str
    created: dt.datetime
    file_count: int
    bytes: int

    @classmethod
    def of(cls, build: Build, display: str | None = None) -> BuildOut:
        return cls(id=build.id, name=build.name, label=build.label, display=display or build.label or build.name,
                   version=build.version, source_revision=build.source_revision,
                   manifest_sha256=build.manifest_sha256, created=build.created, file_count=len(build.files),
                   bytes=sum(f.size for f in build.files))


class BuildDetail(BuildOut):
    files: list[BuildFileOut]

    @classmethod
    def of(cls, build: Build) -> BuildDetail:
        return cls(**BuildOut.of(build).model_dump(),
                   files=[BuildFileOut(path=f.path, sha256=f.sha256, size=f.size, mode=f.mode) for f in build.files])


class Gpu(BaseModel):
    vendor: str
    architecture: str
    device: str
    driver: str
    backend: str


class ScreenshotOut(BaseModel):
    url: str = Field(description="Its PNG (GET, with the same token).")
    taken_at: dt.datetime
    width: int
    height: int
    size: int
    sha256: str
    source: Literal["adb", "devtools"] = Field(description="adb: screencap; devtools: the browser's page.")

    @classmethod
    def of(cls, serial: str, shot: DeviceScreenshot) -> ScreenshotOut:
        return cls(url=f"/v1/devices/{serial}/screenshot", taken_at=shot.taken_at, width=shot.width,
                   height=shot.height, size=shot.size, sha256=shot.sha256, source=shot.source)


class DeviceOut(BaseModel):
    id: int
    serial: str
    transport: TransportKind
    engine_host: str
    address: str
    host: str | None
    state: DeviceState
    state_reason: str
    last_seen: dt.datetime | None
    model: str
    manufacturer: str
    os: str
    os_version: str
    virtual: bool
    gpu: Gpu
    lease_holder: str | None
    lease_until: dt.datetime | None
    reserved_by: str | None = Field(None, description="Who holds it (`farm devices reserve`): schedules skip it and "
                                                      "checks are refused it until reserved_until.")
    reserved_until: dt.datetime | None = None
    reservation_note: str | None = None
    screenshot: ScreenshotOut | None = Field(None, description="Its newest screenshot (`farm devices screenshot`).")
    created_at: dt.datetime

    @classmethod
    def of(cls, d: Device, reservation: DeviceReservation | None = None,
           screenshot: DeviceScreenshot | None = None) -> DeviceOut:
        return cls(id=d.id, serial=d.serial, transport=d.transport, engine_host=d.engine_host, address=d.address,
                   host=d.host.name if d.host is not None else None, state=d.state, state_reason=d.state_reason,
                   last_seen=d.last_seen, model=d.model, manufacturer=d.manufacturer, os=d.os,
                   os_version=d.os_version, virtual=d.virtual,
                   gpu=Gpu(vendor=d.gpu_vendor, architecture=d.gpu_architecture, device=d.gpu_device,
                           driver=d.gpu_driver, backend=d.gpu_backend),
                   lease_holder=d.lease_holder, lease_until=d.lease_until, created_at=d.created_at,
                   reserved_by=reservation.holder if reservation is not None else None,
                   reserved_until=reservation.until if reservation is not None else None,
                   reservation_note=reservation.note if reservation is not None else None,
                   screenshot=ScreenshotOut.of(d.serial, screenshot) if screenshot is not None else None)


# ---- jobs and results ---------------------------------------------------------------------


class RunSummary(BaseModel):
    """One run of a job as listings show it: the medians of its key metrics."""

    run_id: int
    job_id: int
    attempt: int
    device: str
    build: str | None
    kind: JobKind
    status: RunStatus
    error: str | None = None
    started_at: dt.datetime | None
    finished_at: dt.datetime | None
    medians: dict[str, float]


class JobOut(BaseModel):
    id: int
    kind: JobKind
    state: JobState
    device: str
    build: str | None
    batch_id: int | None
    schedule_id: int | None
    attempts: int
    worker_losses: int
    worker: str | None
    created_at: dt.datetime
    started_at: dt.datetime | None
    heartbeat_at: dt.datetime | None
    finished_at: dt.datetime | None
    error: str | None
    progress: dict[str, Any] | None

    @classmethod
    def of(cls, job: Job) -> JobOut:
        return cls(id=job.id, kind=job.kind, state=job.state, device=job.device.serial,
                   build=job.build.name if job.build is not None else None, batch_id=job.batch_id,
                   schedule_id=job.schedule_id, attempts=job.attempts, worker_losses=job.worker_losses,
                   worker=job.worker, created_at=job.created_at, started_at=job.started_at,
                   heartbeat_at=job.heartbeat_at, finished_at=job.finished_at, error=job.error,
                   progress=job.progress)


class JobDetail(JobOut):
    spec: dict[str, Any]
    runs: list[RunSummary]


class MetricStats(BaseModel):
    metric: str
    unit: str
    n: int
    median: float
    min: float
    max: float


class KernelTotal(BaseModel):
    kernel: str
    calls: int
    total_ms: float
    repetitions: int
    ms_per_repetition: float | None


class ThermalOut(BaseModel):
    phase: str
    zone: str
    celsius: float


class ImageOut(BaseModel):
    path: str
    sha256: str
    size: int
    prompt: str
    seed: int | None


class Cooldown(BaseModel):
    wait_s: float | None
    timed_out: bool


class RunDetail(RunSummary):
    """One run in full, as `farm results show --json` gives it."""

    adapter: str
    cooldown: Cooldown
    engine: dict[str, Any]
    environment: dict[str, Any]
    env_key: str
    metrics: list[MetricStats]
    kernels: list[KernelTotal]
    thermal: list[ThermalOut]
    images: list[ImageOut]
    artifacts: list[Any]


# ---- series and alerts --------------------------------------------------------------------



class SeriesVerdict(BaseModel):
    """A series' newest comparison, as the batch analysis made it (orchestrator/analysis/series.py
    latest_verdict): settled (regression, improvement, no_change) or not (inconclusive: the
    interval straddles the minimum effect; not_enough_data; not_analysed)."""

    verdict: Literal["regression", "improvement", "inconclusive", "no_change", "not_enough_data", "not_analysed"]
    settled: bool = Field(description="regression, improvement or no_change: the analysis decided.")
    build: str | None = Field(description="The build compared (the candidate).")
    baseline_build: str | None
    on_latest: bool = Field(description="Whether `build` is the series' newest build.")
    ratio: float | None = Field(description="The build's median / its baseline's.")
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    confidence: float | None = Field(description="Of the interval (0.95).")
    reason: str


class SeriesOut(BaseModel):
    id: str = Field(description="A short hash of the key's canonical JSON.")
    key: SeriesKey  # as the analysis keys it (orchestrator/analysis/stats)
    canonical: str = Field(description="The key as canonical JSON (what series settings are stored by).")
    runs: int = Field(description="Succeeded latency runs in the series.")
    latest_verdict: SeriesVerdict


class SeriesPoint(BaseModel):
    """One build of a series: its samples (all runs of it in the series), their count and median."""

    build: str
    build_id: int
    display: str | None = Field(None, description="What charts call the build: its label, else the distinguishing "
                                                  "end of its name among the series' builds.")
    n: int
    median: float
    min: float
    max: float
    values: list[float]


class SeriesDetail(SeriesOut):
    points: list[SeriesPoint]


def series_of(a: Alert) -> str | None:
    """The id of the latency series an alert sits on (a regression's or an improvement's)."""
    return views.alert_series_id(a) if a.kind in views.SERIES_KINDS else None


class AlertOut(BaseModel):
    id: int
    kind: AlertKind
    state: AlertState
    device: str | None
    build: str | None
    baseline_build: str | None
    metric: str
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    summary: str
    note: str
    series: dict[str, Any]
    detail: dict[str, Any]
    batch: int | None
    series_id: str | None = Field(description="The latency series a regression or improvement is about "
                                              "(/v1/series/{id}); none for a fidelity alert or a data stoppage.")
    group_id: int | None = Field(description="The regression it belongs to (/v1/alert-groups/{id}): every alert "
                                             "of its build pair.")
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, a: Alert) -> AlertOut:
        return cls(id=a.id, kind=a.kind, state=a.state, device=a.device.serial if a.device else None,
                   build=a.build.name if a.build else None,
                   baseline_build=a.baseline_build.name if a.baseline_build else None, metric=a.metric,
                   ratio=a.ratio, ci_low=a.ci_low, ci_high=a.ci_high, p_value=a.p_value, summary=a.summary,
                   note=a.note, series=a.series or {}, detail=a.detail or {}, batch=a.batch_id,
                   series_id=series_of(a), group_id=a.group_id,
                   created_at=a.created_at, updated_at=a.updated_at)


class Triage(BaseModel):
    note: str | None = Field(None, max_length=10_000, description="Why (kept on the alert).")


# ---- alert groups -------------------------------------------------------------------------


def _build_label(build: Build | None) -> str | None:
    """A build as people name it: its short label when it has one, else its name."""
    return None if build is None else (build.label or build.name)


class AlertInGroup(BaseModel):
    """One alert as its group's row lists it."""

    id: int
    kind: AlertKind
    state: AlertState
    device: str | None
    metric: str
    ratio: float | None
    series_id: str | None
    summary: str

    @classmethod
    def of(cls, a: Alert) -> AlertInGroup:
        return cls(id=a.id, kind=a.kind, state=a.state, device=a.device.serial if a.device else None,
                   metric=a.metric, ratio=a.ratio, series_id=series_of(a), summary=a.summary)


class AlertGroupOut(BaseModel):
    """One regression: the alerts one build raised against one baseline, triaged together."""

    id: int
    build: str | None
    baseline_build: str | None
    build_label: str | None = Field(description="The build's label, else its name.")
    baseline_label: str | None = Field(description="The baseline's label, else its name.")
    owner: str
    bug_url: str
    note: str
    devices: list[str]
    metrics: list[str]
    kinds: dict[str, int] = Field(description="How many alerts of each kind.")
    states: dict[str, int] = Field(description="How many alerts in each state (every state named).")
    size: int = Field(description="How many alerts.")
    open: bool = Field(description="Whether any alert is new or acknowledged.")
    worst_ratio: float | None = Field(description="The ratio furthest from 1 (of the regressions, when any).")
    worst_alert: int | None
    created_at: dt.datetime
    updated_at: dt.datetime
    alerts: list[AlertInGroup]

    @classmethod
    def of(cls, v: store.AlertGroupView) -> AlertGroupOut:
        g, worst = v.group, v.worst
        return cls(id=g.id, build=g.build.name if g.build else None,
                   baseline_build=g.baseline_build.name if g.baseline_build else None,
                   build_label=_build_label(g.build), baseline_label=_build_label(g.baseline_build),
                   owner=g.owner, bug_url=g.bug_url, note=g.note, devices=v.devices, metrics=v.metrics,
                   kinds=v.kinds, states=v.states, size=len(v.alerts), open=v.open,
                   worst_ratio=worst.ratio if worst else None, worst_alert=worst.id if worst else None,
                   created_at=g.created_at, updated_at=g.updated_at, alerts=[AlertInGroup.of(a) for a in v.alerts])


class AlertGroupDetail(AlertGroupOut):
    full_alerts: list[AlertOut] = Field(description="Every alert of the group as /v1/alerts/{id} gives it.")

    @classmethod
    def of(cls, v: store.AlertGroupView) -> AlertGroupDetail:
        return cls(**AlertGroupOut.of(v).model_dump(), full_alerts=[AlertOut.of(a) for a in v.alerts])


class GroupTriage(BaseModel):
    model_config = {"extra": "forbid"}

    note: str | None = Field(None, max_length=10_000, description="Why (kept on each alert triaged).")
    alert_ids: list[Annotated[int, Field(ge=1, le=2**31 - 1)]] | None = Field(
        None, max_length=10_000, description="Only these alerts of the group (default: the group's open ones: new or acknowledged).")


class GroupUpdate(BaseModel):
    """What a PATCH sets; a field left out stays as it is, "" clears it."""

    model_config = {"extra": "forbid"}

    owner: str | None = Field(None, max_length=255, pattern=PLAIN)
    bug_url: str | None = Field(None, max_length=1024, pattern=store.BUG_URL_PATTERN,
                                description="An http(s) link to the bug, or \"\" to clear it.")
    note: str | None = Field(None, max_length=10_000, pattern=PLAIN)

    @field_validator("bug_url", mode="before")  # before the pattern: the store's one-line reason
    @classmethod
    def _http_link(cls, url: object) -> object:
        if not isinstance(url, str):
            return url
        try:
            return store.valid_bug_url(url)
        except store.StoreError as exc:
            raise ValueError(str(exc)) from None


# ---- checks -------------------------------------------------------------------------------


class CheckIn(BaseModel):
    """What `farm check` takes, as a request body: the candidate, its baseline (default: each
    device's series' last accepted build, else the build made before the candidate), the
    devices (serials, or `all`), the metrics to gate on and the budget."""

    model_config = {"extra": "forbid"}

    build: str = Field(min_length=1, max_length=128, pattern=PLAIN, description="The candidate build (id, label or name).")
    baseline: str | None = Field(None, min_length=1, max_length=128, pattern=PLAIN)
    devices: list[Serial] | Literal["all"] = Field(min_length=1, description="Device serials, or \"all\".")
    metrics: list[Metric] | None = Field(None, min_length=1, description="Default: every headline metric.")
    max_rounds: int = Field(2, ge=0, le=10, description="More-repetitions rounds after the first.")
    pairs: int = Field(2, ge=1, le=10, description="Baseline/candidate runs per device, interleaved.")
    precision: Literal["fp32", "fp16", "f16-storage"] = "fp16"
    steps: int = Field(4, ge=1, le=1000)
    size: int | None = Field(None, ge=8, le=4096, description="Image height and width (default: the model's).")
    repetitions: int = Field(5, ge=5, le=100)
    unet_repetitions: int = Field(10, ge=5, le=200)
    images: bool = Field(True, description="One generation of each build per device, for image fidelity.")
    timeout_s: float = Field(3600.0, ge=1, le=86_400, description="Give up (exit code 4) after this long.")


class CheckOut(BaseModel):
    """A check and, once it ended, its verdict: exit_code 0 pass, 1 regression, 2 undecided,
    3 bad input, 4 could not run (orchestrator/services/check.py)."""

    id: int
    state: CheckState
    request: dict[str, Any]
    progress: str
    exit_code: int | None
    outcome: str | None
    error: str | None
    report: dict[str, Any] | None
    started_by: int | None = Field(description="The id of the API token that started it.")
    created_at: dt.datetime
    finished_at: dt.datetime | None

    @classmethod
    def of(cls, c: CheckRun) -> CheckOut:
        return cls(id=c.id, state=c.state, request=c.request, progress=c.progress, exit_code=c.exit_code,
                   outcome=c.outcome, error=c.error, report=c.report, started_by=c.token_id,
                   created_at=c.created_at, finished_at=c.finished_at)


# ---- what the dashboard's pages read (orchestrator/dashboard/views.py) ---------------------


class AlertRef(BaseModel):
    """An alert as a chart marker or a verdict shows it."""

    id: int
    kind: AlertKind
    state: AlertState
    build: str | None
    baseline_build: str | None
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    summary: str


class OverviewDevice(BaseModel):
    serial: str
    model: str
    state: DeviceState
    state_reason: str
    gpu: str
    reserved_by: str | None = Field(None, description="Who holds it (`farm devices reserve`), until reserved_until.")
    reserved_until: dt.datetime | None = None
    reservation_note: str | None = None


class OverviewMetric(BaseModel):
    metric: str
    unit: str = Field(description="From the metric's name: ms, bytes, dB, s.")


class LatestPoint(BaseModel):
    build: str
    display: str = Field(description="What people call the build: its label, else the end of its name that "
                                     "tells it from the other builds shown.")
    median: float
    n: int


class OverviewCell(BaseModel):
    """One series of a device and headline metric: its latest build's median and the verdict
    on it (the alert on its latest build, else its newest open alert, else none)."""

    series_id: str
    device: str
    metric: str
    unit: str
    spec: str = Field(description="model, resolution, steps, precision and profile, as words.")
    environment: str = Field(description="OS and driver (the key's os_driver).")
    builds: int
    runs: int
    latest: LatestPoint
    latest_verdict: SeriesVerdict = Field(description="The series' newest comparison, decided or not.")
    verdict: AlertRef | None = Field(description="The alert on the latest build, else the newest open one.")
    verdict_on_latest: bool


class Overview(BaseModel):
    devices: list[OverviewDevice]
    metrics: list[OverviewMetric]
    cells: list[OverviewCell]


class Annotation(BaseModel):
    build: str
    kind: Literal["deploy", "change_point", "environment"]
    text: str
    series_id: str | None = Field(None, description="environment: the series measured before the change.")


class SeriesEvents(BaseModel):
    alerts: list[AlertRef] = Field(description="Regression and improvement alerts on the series, oldest build first.")
    annotations: list[Annotation]


class KernelLine(BaseModel):
    kernel: str
    ms: list[float | None] = Field(description="Per build, in `builds`' order: its time per timed repetition "
                                               "(None: the build did not run it).")


class KernelMove(BaseModel):
    """One kernel's change between two builds: the median over repetitions of its total time in
    one repetition (0 where a build did not run it), as an alert's attribution has it."""

    kernel: str
    baseline_ms: float
    candidate_ms: float
    delta_ms: float = Field(description="candidate_ms - baseline_ms.")
    share: float = Field(description="Its part of the net change (negative: it moved against it).")


class ComparedBuilds(BaseModel):
    baseline_build: str
    build: str


class SeriesKernels(BaseModel):
    """Where a series' time goes, build by build, and which kernels moved between the two builds
    its newest verdict compares."""

    unit: str
    builds: list[str] = Field(description="The series' builds that recorded kernel timings, oldest first.")
    kernels: list[KernelLine] = Field(description="The kernels slowest in the newest build and every kernel in "
                                                  "`moves`, then the rest summed as \"other\".")
    compared: ComparedBuilds | None = Field(description="The builds `moves` compares: the newest verdict's when "
                                                        "both timed kernels, else the two newest that did.")
    moves: list[KernelMove] = Field(description="The kernels that moved most between them, biggest change first.")


class AlertSide(BaseModel):
    """One build's samples of the alert's series."""

    build: str
    n: int
    median: float
    values: list[float]


class ImageRef(BaseModel):
    id: int
    url: str = Field(description="GET it with the token: the image's bytes.")
    file: str = Field(description="Its file name in an offline dashboard's data/images/.")
    build: str | None
    prompt: str
    seed: int | None
    sha256: str


class GalleryImage(ImageRef):
    device: str
    job: int
    workload: str = Field(description="model, resolution, steps, precision and profile of the job that made it")


class BuildGallery(BaseModel):
    """The images a build's generate jobs made, newest first."""

    build: str
    created: dt.datetime
    images: list[GalleryImage]


class AlertImages(BaseModel):
    before: ImageRef | None = None
    after: ImageRef | None = None


class AlertContext(BaseModel):
    series_id: str | None = Field(description="The series the alert is about, when it has points.")
    unit: str
    before: AlertSide | None = Field(description="The baseline build's samples in the series.")
    after: AlertSide | None = Field(description="The alert's build's samples in the series.")
    images: AlertImages


class RecentRun(BaseModel):
    run_id: int
    status: RunStatus
    error: str | None
    kind: JobKind
    build: str | None
    started_at: str | None
    finished_at: str | None


class StateChange(BaseModel):
    at: dt.datetime
    from_state: str
    to_state: str
    event: str
    reason: str


class DeviceHealth(BaseModel):
    serial: str
    runs: dict[str, int] = Field(description="Runs by status.")
    total_runs: int
    failure_rate: float | None
    state: DeviceState
    state_reason: str
    infra_failures_in_row: int
    probe_failures: int
    last_run_finished: dt.datetime | None = Field(description="When its newest run ended (the device's clock).")
    recent: list[RecentRun]
    stoppages: list[AlertRef] = Field(description="Data-stoppage alerts about the device.")
    history: list[StateChange] = Field(description="Its newest state changes, newest first (not its lease's busy "
                                                   "and available).")
