"""The farm's SQL schema as SQLAlchemy 2 typed models: hosts and their devices, builds and their
files, profiles, deployments, jobs, and what a job's runs measured (raw samples, per-kernel
timings, images, thermal readings), plus the nightly schedules. Alembic migrations are written
from this metadata; the app never calls create_all.

Portability between SQLite (the embedded default) and PostgreSQL (production) decides the
types: enums are VARCHAR plus a CHECK constraint (no native enum types to migrate), JSON is
sqlalchemy.JSON, and every timestamp is timezone-aware UTC (`UTCDateTime`), because SQLite
keeps no zone and a naive/aware mix breaks every comparison the lease and stale-job queries do.
"""

from __future__ import annotations

import datetime as dt
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Double,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from .enums import (  # noqa: F401  (the enums are imported from here too)
    AlertKind,
    AlertState,
    DeliveryState,
    DeploymentStatus,
    DeviceState,
    JobKind,
    JobState,
    RunStatus,
    SubscriptionKind,
    TransportKind,
)

# Fixed names, so migrations can refer to constraints on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC timestamp on every backend: stored as UTC, read back aware."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one (UTC)")
        value = value.astimezone(dt.UTC)
        # SQLite stores text without a zone; keep one fixed format so text order is time order.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value, dialect):
        if value is None:
            return None
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        dt.datetime: UTCDateTime(),
        float: Double(),
        dict[str, Any]: JSON(),
        list[Any]: JSON(),
    }


def _enum(cls: type[StrEnum], name: str) -> Enum:
    """A portable enum: a VARCHAR with a CHECK constraint named ck_<table>_<name>."""
    return Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=max(len(m.value) for m in cls) + 8,  # room for a new value without a migration
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


# ---- fleet --------------------------------------------------------------------------------


class Host(Base):
    """A machine running a worker; phones are plugged into one host and driven from its queue."""

    __tablename__ = "hosts"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    last_seen: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    devices: Mapped[list[Device]] = relationship(back_populates="host")


class Device(Base):
    """One physical (or virtual) device. GPU identity is copied out of DeviceInfo.adapter into
    columns because regression series are keyed by it; the whole last DeviceInfo is kept too."""

    __tablename__ = "devices"

    id: Mapped[int] = mapped_column(primary_key=True)
    serial: Mapped[str] = mapped_column(String(255), unique=True)
    host_id: Mapped[int | None] = mapped_column(ForeignKey("hosts.id", ondelete="SET NULL"))
    transport: Mapped[TransportKind] = mapped_column(_enum(TransportKind, "transport"))
    address: Mapped[str] = mapped_column(String(255), default="")
    # What hosts the engine on it: "python" (farm-agent and wgpu-native on the device) or
    # "browser" (the device's web browser, which runs every job on the browser executor;
    # orchestrator/transports/browser.py)
    engine_host: Mapped[str] = mapped_column(String(16), default="python", server_default="python")
    # identity (from DeviceInfo)
    model: Mapped[str] = mapped_column(String(255), default="")
    manufacturer: Mapped[str] = mapped_column(String(255), default="")
    os: Mapped[str] = mapped_column(String(64), default="")
    os_version: Mapped[str] = mapped_column(String(255), default="")
    gpu_vendor: Mapped[str] = mapped_column(String(255), default="")
    gpu_architecture: Mapped[str] = mapped_column(String(255), default="")
    gpu_device: Mapped[str] = mapped_column(String(255), default="")
    gpu_driver: Mapped[str] = mapped_column(String(255), default="")  # adapter description
    gpu_backend: Mapped[str] = mapped_column(String(64), default="")
    virtual: Mapped[bool] = mapped_column(default=False)
    # Devices with one adapter_group run on one physical GPU (DeviceInfo.adapter_id): a timed
    # job there runs alone, and nothing starts beside it.
    adapter_group: Mapped[str | None] = mapped_column(String(64), index=True)
    info: Mapped[dict[str, Any] | None]  # the last DeviceInfo, as sent
    # health
    state: Mapped[DeviceState] = mapped_column(_enum(DeviceState, "state"), default=DeviceState.offline)
    state_reason: Mapped[str] = mapped_column(Text, default="")
    last_seen: Mapped[dt.datetime | None]
    # orchestrator/jobs/health.py: jobs ended infra_failed since the last one that ran (the third
    # quarantines it), and the health check's back-off while it is offline or unauthorized
    infra_failures_in_row: Mapped[int] = mapped_column(default=0, server_default="0")
    probe_failures: Mapped[int] = mapped_column(default=0, server_default="0")
    next_probe_at: Mapped[dt.datetime | None]  # None: probe at the next health check
    # one job at a time: whoever holds an unexpired lease drives the device
    lease_holder: Mapped[str | None] = mapped_column(String(255))
    lease_until: Mapped[dt.datetime | None]
    lease_timed: Mapped[bool] = mapped_column(default=False, server_default=false())  # its holder is timed
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    host: Mapped[Host | None] = relationship(back_populates="devices")


class DeviceReservation(Base):
    """A person holds a device until `until`: schedules, suites and checks leave it alone (they
    skip it or wait, and say so). Ended early by `released_at`; kept afterwards as history."""

    __tablename__ = "device_reservations"
    __table_args__ = (Index("ix_device_reservations_device_until", "device_id", "until"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    holder: Mapped[str] = mapped_column(String(255))
    note: Mapped[str] = mapped_column(Text, default="")
    starts_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    until: Mapped[dt.datetime]
    released_at: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class DeviceScreenshot(Base):
    """What a device's screen showed at `taken_at` (`farm devices screenshot`): a PNG kept on
    the control plane at `path`, taken by `source` ("adb": screencap; "devtools": the browser
    page through Chromium's DevTools protocol)."""

    __tablename__ = "device_screenshots"
    __table_args__ = (Index("ix_device_screenshots_device_taken", "device_id", "taken_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    width: Mapped[int] = mapped_column(default=0)
    height: Mapped[int] = mapped_column(default=0)
    source: Mapped[str] = mapped_column(String(16))
    taken_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


# ---- builds and profiles ------------------------------------------------------------------


class DeviceStateChange(Base):
    """A device's state changed (store.apply_device_event: a probe's answer or silence, a
    refusal, three infrastructure failures, an operator's quarantine or release, an expired
    lease): the state it left and entered, the event and the reason. Taking and giving back a
    lease (available <-> busy, in the lease's own statement) is every job's cycle and is not
    recorded here."""

    __tablename__ = "device_state_changes"
    __table_args__ = (Index("ix_device_state_changes_device_at", "device_id", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    from_state: Mapped[str] = mapped_column(String(24))
    to_state: Mapped[str] = mapped_column(String(24))
    event: Mapped[str] = mapped_column(String(24))
    reason: Mapped[str] = mapped_column(Text, default="")


class Build(Base):
    """A content-addressed bundle; `name` is the manifest's build id, `manifest_sha256` the
    hash of its canonical bytes (what was signed)."""

    __tablename__ = "builds"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # What people call it in tables, charts and commands ("A", "B", "rc1"): given at `builds
    # create --label` or derived; unique, so that it names the build wherever a build is named.
    label: Mapped[str | None] = mapped_column(String(32), unique=True)
    version: Mapped[str] = mapped_column(String(64))
    source_revision: Mapped[str] = mapped_column(String(128), default="")
    manifest_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created: Mapped[dt.datetime] = mapped_column(default=utcnow)

    files: Mapped[list[BuildFile]] = relationship(
        back_populates="build", cascade="all, delete-orphan", order_by="BuildFile.path"
    )


class BuildFile(Base):
    __tablename__ = "build_files"
    __table_args__ = (UniqueConstraint("build_id", "path"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64), index=True)  # which builds share a blob
    size: Mapped[int] = mapped_column(BigInteger)
    mode: Mapped[int] = mapped_column(default=0o644)

    build: Mapped[Build] = relationship(back_populates="files")


class Profile(Base):
    """A kernel-selection profile (engine/profiles JSON) tuned on one GPU by a tune job, as
    the farm registered it (orchestrator/analysis/profiles.py): the GPU, driver and engine it was
    tuned with, its content hash (engine.profiles.profile_sha256), the run that made it, the
    gain its tune estimated from kernel times against the GPU family's profile, and the gain
    a latency run of each measured (None until one has: never called measured before)."""

    __tablename__ = "profiles"
    __table_args__ = (UniqueConstraint("name", "sha256"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    sha256: Mapped[str] = mapped_column(String(64))
    gpu_vendor: Mapped[str] = mapped_column(String(255), default="")
    gpu_architecture: Mapped[str] = mapped_column(String(255), default="")
    gpu_device: Mapped[str] = mapped_column(String(255), default="")
    gpu_driver: Mapped[str] = mapped_column(String(255), default="", server_default="")
    gpu_backend: Mapped[str] = mapped_column(String(64), default="", server_default="")
    engine_version: Mapped[str] = mapped_column(String(255), default="", server_default="")  # the build's
    tuned_on_device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id", ondelete="SET NULL"))
    tune_run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"), unique=True)
    family: Mapped[str] = mapped_column(String(255), default="", server_default="")  # the profile it is measured against
    estimated_gain: Mapped[float | None]  # from the tune's kernel times: an estimate
    measured_gain: Mapped[float | None]  # family / tuned UNet step median, from latency runs on this GPU
    measured_gain_ci: Mapped[list[Any] | None]  # [low, high], 95%
    measured_in_batch_id: Mapped[int | None] = mapped_column(ForeignKey("batches.id", ondelete="SET NULL"))
    promoted_at: Mapped[dt.datetime | None]  # shipped by the builds made since (`farm profiles promote`)
    data: Mapped[dict[str, Any]]
    created: Mapped[dt.datetime] = mapped_column(default=utcnow)

    tuned_on: Mapped[Device | None] = relationship()


class Deployment(Base):
    """One build pushed to one device. Like a job, a deployment that waits on a message has an
    owner and a deadline: `pending` ones are due to start by `due_at` (or the reconciler sends
    them again, with a new `dispatch_seq`), `running` ones say they are alive in `heartbeat_at`
    (orchestrator/jobs/dispatch.py)."""

    __tablename__ = "deployments"
    __table_args__ = (
        Index("ix_deployments_device_build", "device_id", "build_id"),
        Index("ix_deployments_status_due", "status", "due_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    batch_id: Mapped[int | None] = mapped_column(ForeignKey("batches.id", ondelete="SET NULL"), index=True)
    status: Mapped[DeploymentStatus] = mapped_column(
        _enum(DeploymentStatus, "status"), default=DeploymentStatus.pending
    )
    bytes_sent: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_total: Mapped[int | None] = mapped_column(BigInteger)  # what this deployment has to send
    files_sent: Mapped[int] = mapped_column(default=0)
    files_skipped: Mapped[int] = mapped_column(default=0)
    duration_s: Mapped[float | None]
    error: Mapped[str | None] = mapped_column(Text)
    # An older build than the device's current one becomes current only with this (farm deploy
    # --allow-downgrade); without it, it is installed beside the current one, and `note` says so.
    allow_downgrade: Mapped[bool] = mapped_column(default=False, server_default=false())
    note: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(default=0, server_default="0")
    dispatch_seq: Mapped[int] = mapped_column(default=0, server_default="0")  # which message may start it
    due_at: Mapped[dt.datetime | None]  # pending: resent when still pending then
    heartbeat_at: Mapped[dt.datetime | None]  # running: its worker's last sign of life
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]


# ---- jobs and what they measured ----------------------------------------------------------


BATCH_SERIES, BATCH_CHECK = "series", "check"  # Batch.purpose


class Batch(Base):
    """Jobs submitted together and analysed together: one firing of a schedule, one `farm jobs
    submit`, one `farm demo`. `finished_at` is stamped once, by whichever job ends last (a
    conditional UPDATE), and then the batch's analysis is sent; `summary` is what it found."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_schedule_created", "schedule_id", "created_at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    schedule_id: Mapped[int | None] = mapped_column(ForeignKey("schedules.id", ondelete="SET NULL"))
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="SET NULL"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    # Rounds of more repetitions an inconclusive analysis may launch (each a batch of its own
    # that reruns the candidate and its baseline): with 10 repetitions a run, 3 rounds reach
    # compare()'s 40-repetition bound.
    max_extra_rounds: Mapped[int] = mapped_column(default=3)
    # The metrics whose inconclusive comparison asks for a more-repetitions round (None: every
    # headline metric); the demo rounds only on the UNet step it reports.
    round_metrics: Mapped[list[Any] | None]
    # "series": its runs are the series' measurements, analysed when it ends; "check": a `farm
    # check`'s runs, judged by the check alone, never in a series (a pull request's build that
    # never lands must not become the baseline of the next nightly) and never analysed.
    purpose: Mapped[str] = mapped_column(String(16), default=BATCH_SERIES, server_default=BATCH_SERIES)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]
    summary: Mapped[dict[str, Any] | None]

    build: Mapped[Build | None] = relationship()
    jobs: Mapped[list[Job]] = relationship(back_populates="batch", order_by="Job.id")


class Job(Base):
    """One unit of work for one device. `attempts` counts executions (each a Run when it
    brought back a result); `heartbeat_at` is refreshed by the worker running it, so jobs of a
    dead worker can be found and requeued. A queued job is owned by the deployment it waits for
    (`deployment_id`, until that deployment succeeded) or by its message, which must have
    started it by `due_at`; otherwise the reconciler sends a new message with the next
    `dispatch_seq`, and older messages are dropped when they arrive (orchestrator/jobs/dispatch.py)."""

    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_state_heartbeat", "state", "heartbeat_at"),
        Index("ix_jobs_device_created", "device_id", "created_at"),
        Index("ix_jobs_state_id", "state", "id"),  # `farm jobs list --state`, newest first
        Index("ix_jobs_build", "build_id"),
        Index("ix_jobs_state_due", "state", "due_at"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[JobKind] = mapped_column(_enum(JobKind, "kind"))
    spec: Mapped[dict[str, Any]]  # the whole JobSpec as a dict (store.job_spec reads it back)
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="SET NULL"))
    schedule_id: Mapped[int | None] = mapped_column(ForeignKey("schedules.id", ondelete="SET NULL"))
    batch_id: Mapped[int | None] = mapped_column(ForeignKey("batches.id", ondelete="SET NULL"), index=True)
    deployment_id: Mapped[int | None] = mapped_column(ForeignKey("deployments.id", ondelete="SET NULL"))
    # A job that needs another's outcome (a latency run of the profile a tune job makes) waits
    # for it: sent when it succeeds, ended when it fails.
    after_job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    state: Mapped[JobState] = mapped_column(_enum(JobState, "state"), default=JobState.queued)
    attempts: Mapped[int] = mapped_column(default=0)
    # Of those attempts, the ones that ended because their worker died (not the device's fault).
    worker_losses: Mapped[int] = mapped_column(default=0, server_default="0")
    # The agent's last phase and step while it runs ({"phase", "done", "total", "attempt", "at"}),
    # as the transport relayed them; kept after the job ends (where it stopped, if it failed).
    progress: Mapped[dict[str, Any] | None]
    dispatch_seq: Mapped[int] = mapped_column(default=0, server_default="0")
    queued_at: Mapped[dt.datetime | None] = mapped_column(default=utcnow)  # since when it waits to run
    due_at: Mapped[dt.datetime | None]
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    worker: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    heartbeat_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    log_tail: Mapped[str] = mapped_column(Text, default="")
    error: Mapped[str | None] = mapped_column(Text)

    device: Mapped[Device] = relationship()
    build: Mapped[Build | None] = relationship()
    batch: Mapped[Batch | None] = relationship(back_populates="jobs")
    deployment: Mapped[Deployment | None] = relationship()
    runs: Mapped[list[Run]] = relationship(back_populates="job", order_by="Run.attempt")


class Run(Base):
    """One execution attempt of a job that came back with a JobResult. Device and build are
    copied from the job so the series queries need no join through jobs. `environment` is what
    the run ran on (protocol.RunEnvironment as a dict: OS, kernel, driver, adapter, WebGPU runtime,
    clocks, profile; from the device's record, marked so, when the agent sent none) and
    `env_key` its short key (orchestrator/store/environment.py), which series are keyed by; both are
    empty on runs stored before migration 0009."""

    __tablename__ = "runs"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt"),
        Index("ix_runs_device_build", "device_id", "build_id"),
        Index("ix_runs_build", "build_id"),
        Index("ix_runs_device_env_key", "device_id", "env_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="SET NULL"))
    status: Mapped[RunStatus] = mapped_column(_enum(RunStatus, "status"))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    adapter: Mapped[str] = mapped_column(String(255), default="")  # JobResult.device
    engine: Mapped[dict[str, Any]]  # profile, precision, kernel decisions, stage timings
    cooldown_wait_s: Mapped[float | None]
    cooldown_timed_out: Mapped[bool] = mapped_column(default=False)
    artifacts: Mapped[list[Any]]  # every Artifact, as sent
    log_tail: Mapped[str] = mapped_column(Text, default="")
    environment: Mapped[dict[str, Any]] = mapped_column(default=dict)
    env_key: Mapped[str] = mapped_column(String(32), default="")
    # Retention (orchestrator/store/retention.py): when its samples and kernel timings became summaries,
    # what those stand for (per metric n, min, max), when its log files were deleted; None: not yet.
    downsampled_at: Mapped[dt.datetime | None]
    retained: Mapped[dict[str, Any] | None]
    logs_deleted_at: Mapped[dt.datetime | None]

    job: Mapped[Job] = relationship(back_populates="runs")
    samples: Mapped[list[Sample]] = relationship(cascade="all, delete-orphan", passive_deletes=True)
    kernel_timings: Mapped[list[KernelTiming]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True
    )
    images: Mapped[list[Image]] = relationship(cascade="all, delete-orphan", passive_deletes=True)
    thermal: Mapped[list[ThermalReading]] = relationship(
        cascade="all, delete-orphan", passive_deletes=True
    )


class Sample(Base):
    """One raw measurement; the metric name carries its unit (unet_step_ms, peak_gpu_bytes)."""

    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_metric_run", "metric", "run_id"), Index("ix_samples_run", "run_id"))

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    metric: Mapped[str] = mapped_column(String(128))
    unit: Mapped[str] = mapped_column(String(32))
    value: Mapped[float]
    repetition: Mapped[int] = mapped_column(default=0)


class KernelTiming(Base):
    __tablename__ = "kernel_timings"
    __table_args__ = (
        Index("ix_kernel_timings_run", "run_id"),
        Index("ix_kernel_timings_kernel_run", "kernel", "run_id"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kernel: Mapped[str] = mapped_column(String(255))
    calls: Mapped[int]
    total_ms: Mapped[float]
    repetition: Mapped[int] = mapped_column(default=0)


class Image(Base):
    """A generated image kept on the control plane; `path` is where it was fetched to."""

    __tablename__ = "images"
    __table_args__ = (Index("ix_images_run", "run_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    path: Mapped[str] = mapped_column(String(1024))
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt: Mapped[str] = mapped_column(Text, default="")
    seed: Mapped[int | None] = mapped_column(BigInteger)


class ThermalReading(Base):
    __tablename__ = "thermal_readings"
    __table_args__ = (Index("ix_thermal_readings_run", "run_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    phase: Mapped[str] = mapped_column(String(16))  # before, after
    zone: Mapped[str] = mapped_column(String(255))
    celsius: Mapped[float]


# ---- schedules ----------------------------------------------------------------------------


class Schedule(Base):
    """A recurring suite (nightly latency runs): a cron expression read in `timezone`."""

    __tablename__ = "schedules"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    cron: Mapped[str] = mapped_column(String(255))
    timezone: Mapped[str] = mapped_column(String(64), default="UTC")
    enabled: Mapped[bool] = mapped_column(default=True)
    suite: Mapped[dict[str, Any]]  # build selector, devices, job specs
    last_run_at: Mapped[dt.datetime | None]
    # Why the last firing could not launch its suite (None: it did); `farm schedules list` shows it.
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


# ---- regression tracking ------------------------------------------------------------------


class Alert(Base):
    """Something the analysis found, for a person to triage. `series` is the key the samples
    were grouped by (device, OS/driver, model, resolution, steps, precision, profile, metric);
    `ratio` is new median / baseline median with its bootstrap interval."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index("ix_alerts_state_created", "state", "created_at"),
        Index("ix_alerts_device_created", "device_id", "created_at"),
        Index("ix_alerts_build", "build_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[AlertKind] = mapped_column(_enum(AlertKind, "kind"))
    state: Mapped[AlertState] = mapped_column(_enum(AlertState, "state"), default=AlertState.new)
    device_id: Mapped[int | None] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    baseline_build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="SET NULL"))
    batch_id: Mapped[int | None] = mapped_column(ForeignKey("batches.id", ondelete="SET NULL"))
    metric: Mapped[str] = mapped_column(String(128), default="")
    series: Mapped[dict[str, Any]]
    ratio: Mapped[float | None]
    ci_low: Mapped[float | None]
    ci_high: Mapped[float | None]
    p_value: Mapped[float | None]
    summary: Mapped[str] = mapped_column(Text, default="")  # one line a person reads first
    detail: Mapped[dict[str, Any]]  # attribution, samples counts, images, thermal flags
    note: Mapped[str] = mapped_column(Text, default="")  # the triager's words
    # the regression this cell belongs to: every alert of one build pair (AlertGroup)
    group_id: Mapped[int | None] = mapped_column(ForeignKey("alert_groups.id", ondelete="SET NULL"),
                                                 index=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    device: Mapped[Device | None] = relationship()
    build: Mapped[Build | None] = relationship(foreign_keys=[build_id])
    baseline_build: Mapped[Build | None] = relationship(foreign_keys=[baseline_build_id])


class AlertGroup(Base):
    """One regression as people triage it: the alerts one build raised against one baseline (a
    build range, with the devices and metrics inside), triaged together: one owner, one bug,
    one note, and its alerts acknowledged, invalidated or fixed in bulk."""

    __tablename__ = "alert_groups"
    __table_args__ = (Index("ix_alert_groups_build", "build_id", "baseline_build_id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    baseline_build_id: Mapped[int | None] = mapped_column(ForeignKey("builds.id", ondelete="SET NULL"))
    owner: Mapped[str] = mapped_column(String(255), default="")
    bug_url: Mapped[str] = mapped_column(String(1024), default="")
    note: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    build: Mapped[Build | None] = relationship(foreign_keys=[build_id])
    baseline_build: Mapped[Build | None] = relationship(foreign_keys=[baseline_build_id])


class ChangePoint(Base):
    """Where a series' level moved, found by change-point detection over its whole history
    (`farm regressions scan`; orchestrator/analysis/regressions.py scan_change_points): `build` is the first
    build of the new segment, `ratio` its median over the previous segment's. One row per series
    and build; a later scan updates it."""

    __tablename__ = "change_points"
    __table_args__ = (UniqueConstraint("series_key", "build_id"),
                      Index("ix_change_points_device_detected", "device_id", "detected_at"))

    id: Mapped[int] = mapped_column(primary_key=True)
    series_key: Mapped[str] = mapped_column(Text)  # SeriesKey.canonical()
    series: Mapped[dict[str, Any]]
    device_id: Mapped[int] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id", ondelete="CASCADE"))
    metric: Mapped[str] = mapped_column(String(128))
    median_before: Mapped[float]
    median_after: Mapped[float]
    ratio: Mapped[float | None]
    p_value: Mapped[float]
    builds_in_history: Mapped[int]
    detected_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    device: Mapped[Device] = relationship()
    build: Mapped[Build] = relationship()


class SeriesSetting(Base):
    """Per-series overrides of the analysis: the minimum effect that counts as a change, and the
    run-to-run drift to assume until the series' history estimates its own (None: not set
    here)."""

    __tablename__ = "series_settings"

    id: Mapped[int] = mapped_column(primary_key=True)
    series_key: Mapped[str] = mapped_column(String(1024), unique=True)  # canonical JSON of the key
    min_effect: Mapped[float | None]
    drift: Mapped[float | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


# ---- notifications ------------------------------------------------------------------------


class Subscription(Base):
    """Who hears of which events (`farm notify add`): a webhook, Slack or email target and its
    filters; an empty filter list matches everything (alert_kinds empty: every kind but
    improvement). `secret` signs a webhook's bodies (shown once, when it is added)."""

    __tablename__ = "notification_subscriptions"

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[SubscriptionKind] = mapped_column(_enum(SubscriptionKind, "kind"))
    target: Mapped[str] = mapped_column(Text)  # URL or email address
    secret: Mapped[str] = mapped_column(String(128), default="")
    devices: Mapped[list[str]] = mapped_column(JSON, default=list)
    metrics: Mapped[list[str]] = mapped_column(JSON, default=list)
    alert_kinds: Mapped[list[str]] = mapped_column(JSON, default=list)
    min_severity: Mapped[str] = mapped_column(String(16), default="info")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Delivery(Base):
    """One event sent to one subscription: at most one row per (event_key, subscription), so an
    analysis run twice or two workers racing never send an event twice. `event` is what the
    message says, fixed when the event happened."""

    __tablename__ = "notification_deliveries"
    __table_args__ = (UniqueConstraint("event_key", "subscription_id"),
                      Index("ix_notification_deliveries_state_next", "state", "next_attempt_at"))

    id: Mapped[int] = mapped_column(primary_key=True)
    subscription_id: Mapped[int] = mapped_column(
        ForeignKey("notification_subscriptions.id", ondelete="CASCADE"), index=True)
    event_key: Mapped[str] = mapped_column(String(255))  # "alert:<id>", "quarantined:<device id>:<time>"
    event: Mapped[dict[str, Any]]
    state: Mapped[DeliveryState] = mapped_column(_enum(DeliveryState, "state"), default=DeliveryState.pending)
    attempts: Mapped[int] = mapped_column(default=0)
    last_error: Mapped[str] = mapped_column(Text, default="")
    next_attempt_at: Mapped[dt.datetime | None]  # when the sweep sends a pending one again
    claimed_until: Mapped[dt.datetime | None]  # a sender holds it until then
    delivered_at: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)

    subscription: Mapped[Subscription] = relationship()


# ---- the farm API -------------------------------------------------------------------------


class ApiScope(StrEnum):
    """What a bearer token of the farm API may do (orchestrator/api/tokens.py). `triage` and
    `run` each include `read`; `run` does not include `triage`: a CI runner's token that starts
    checks should not be able to dismiss the alerts its own candidate raised."""

    read = "read"
    triage = "triage"
    run = "run"


class CheckState(StrEnum):
    running = "running"
    done = "done"  # judged: exit_code 0 (pass), 1 (regression) or 2 (undecided)
    bad_input = "bad_input"  # exit code 3: an unknown build, device or metric
    failed = "failed"  # exit code 4: a job failed, or time ran out
    interrupted = "interrupted"  # the API process stopped while it ran (exit code 4)


class ApiToken(Base):
    """A bearer token of the farm API. Only the sha256 of the token is kept (it is 32 random
    bytes, so a plain hash is enough to make the stored value useless to a reader of the
    database), with its first characters to tell tokens apart in a listing."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), default="")
    scope: Mapped[ApiScope] = mapped_column(_enum(ApiScope, "scope"))
    prefix: Mapped[str] = mapped_column(String(16))
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]


class CheckRun(Base):
    """A `farm check` started through the API (POST /v1/checks), run in a thread of the API
    process: the request, its state, the last progress line, and once it ends its exit code,
    outcome and report (orchestrator/services/check.py), or the error that ended it."""

    __tablename__ = "check_runs"
    __table_args__ = (Index("ix_check_runs_state", "state"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    state: Mapped[CheckState] = mapped_column(_enum(CheckState, "state"), default=CheckState.running)
    request: Mapped[dict[str, Any]]
    progress: Mapped[str] = mapped_column(Text, default="")
    exit_code: Mapped[int | None]
    outcome: Mapped[str | None] = mapped_column(String(32))
    report: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    token_id: Mapped[int | None] = mapped_column(ForeignKey("api_tokens.id", ondelete="SET NULL"))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]
