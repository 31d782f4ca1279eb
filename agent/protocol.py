"""The one contract between the orchestrator and the agents: JobSpec (what to run), JobResult
(what came back: raw samples, per-kernel timings, thermal readings, artifacts), DeviceInfo
(what the device is) and the bundle Manifest (what a build ships). Every document carries
`protocol`; a document of another protocol version is refused on both sides with an error
naming both versions, because a silently misread result would poison the regression history.
A field added with a default keeps the version: a document of an older agent, which lacks it,
still parses (JobResult.environment came this way), while the older side refuses the newer
document's unknown field; so the orchestrator is upgraded before the agents it deploys.

Plain dataclasses and JSON, so the device side needs nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

PROTOCOL_VERSION = 1
PROTOCOL_HEADER = "X-Farm-Protocol"  # the HTTP header carrying PROTOCOL_VERSION both ways

# What `farm-agent` exits with, as every transport reads it. 127 is the shell's "command not
# found" (no agent on the device), not the agent's own.
EXIT_FAILED = 1  # the job ran and failed (its JobResult says why)
EXIT_BAD_INPUT = 2  # a document the agent refuses (malformed spec, unknown kind, bad bundle folder)
EXIT_BUSY = 75  # another job holds the device lock
EXIT_NOT_FOUND = 127
LOG_TAIL_CHARS = 4000  # how much of the end of job.log travels with a failure

# Build and job ids become folder names on devices and hosts: plain names only, so none can
# climb out of the folder it is joined to.
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,127}")
NAME_RULE = "use letters, digits and ._+- (not starting with '.' or '-', at most 128 characters)"

JobKind = Literal["generate", "latency", "tune"]
JOB_KINDS: tuple[str, ...] = typing.get_args(JobKind)
JobStatus = Literal["succeeded", "failed"]


class ProtocolError(ValueError):
    """A document that does not follow the protocol (version, kind, field or type)."""


class BadValue(ProtocolError):
    """A value that follows the types but that nothing downstream can take: a number that is
    not finite (NaN, Infinity: no store keeps it, no timer ever expires on it), a string with a
    NUL character (PostgreSQL refuses it), a number out of its field's bounds."""


# Bounds of a job's numbers: what the engine and a device can do, with room to spare.
MAX_STEPS = 1000  # the schedulers' training timesteps: more steps than that repeat timesteps
MAX_SIDE = 4096  # pixels a side (SD 1.4 is made for 512; 4096 is already far past a phone's memory)
MAX_REPETITIONS = 1_000_000  # runs of one kind in one job (its time limit ends it sooner)
MAX_GUIDANCE = 100.0  # classifier-free guidance scale (7.5 is usual; 1 turns it off)
MAX_TIME_S = 7 * 86400.0  # a job's time limit, a tune's budget, a cool-down's longest wait
MAX_SEED = 2**64 - 1
MIN_GPU_BUDGET, MAX_GPU_BUDGET = 2**20, 2**40  # a job's GPU memory budget: 1 MiB to 1 TiB


def _bounded(_obj, name: str, value, low, high, *, low_open: bool = False) -> None:
    """BadValue unless `value` is a finite number in [low, high] ((low, high] with low_open)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{name}: expected a number, got {value!r}")
    if not math.isfinite(value):
        raise BadValue(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        side = "(" if low_open else "["
        raise BadValue(f"{name} must be in {side}{_number(low)}, {_number(high)}], got {_number(value)}")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e21 else f"{x:g}"


def check_plain(value: Any, where: str) -> None:
    """BadValue for a non-finite number or a NUL character anywhere in `value` (parsed JSON:
    dicts, lists, strings, numbers), naming where."""
    if isinstance(value, float) and not math.isfinite(value):
        raise BadValue(f"{where} must be a finite number, got {value!r}")
    if isinstance(value, str) and "\x00" in value:
        raise BadValue(f"{where}: contains a NUL character")
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(key, f"{where} (a key)")
            check_plain(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")


# ---- job specification --------------------------------------------------------------------


INIT_IMAGE_MAX_BYTES = 8 * 2**20  # an init image travels inside the job spec
INIT_IMAGE_MAX_CHARS = 32 + (INIT_IMAGE_MAX_BYTES + 2) // 3 * 4
INIT_IMAGE_URI = re.compile(r"data:image/(png|jpeg);base64,[A-Za-z0-9+/=]*")


@dataclass
class Cooldown:
    """Wait, before the job, until the device's hottest thermal reading is at most
    `max_celsius`, polling every `poll_s`, for at most `max_wait_s`; or until the device's own
    temperature trend says waiting no longer cools it: over the last `settle_window_s` it fell
    by less than `settle_c_per_min` (a device that idles above `max_celsius`, or one warmed by
    a neighbour's work, has settled and is not cooler a minute later)."""

    max_celsius: float = 40.0
    max_wait_s: float = 300.0
    poll_s: float = 5.0
    settle_window_s: float = 30.0
    settle_c_per_min: float = 0.5

    def __post_init__(self):
        _bounded(self, "Cooldown.max_celsius", self.max_celsius, -273.15, 150.0, low_open=True)  # any real temperature
        _bounded(self, "Cooldown.max_wait_s", self.max_wait_s, 0.0, MAX_TIME_S)
        _bounded(self, "Cooldown.poll_s", self.poll_s, 0.0, 3600.0, low_open=True)
        _bounded(self, "Cooldown.settle_window_s", self.settle_window_s, 0.0, MAX_TIME_S)
        _bounded(self, "Cooldown.settle_c_per_min", self.settle_c_per_min, 0.0, 1000.0)


EXECUTORS = ("native", "plan", "browser")  # engine.load.EXECUTORS, without importing the engine


@dataclass
class JobSpec:
    """What one job runs. `model` is a model folder relative to the installed build (or an
    absolute path on the device); `build` is the id of the installed build to run it with."""

    job_id: str
    kind: JobKind
    model: str
    build: str | None = None
    precision: Literal["fp32", "fp16", "f16-storage"] = "fp16"
    height: int | None = None  # None: the model's native size
    width: int | None = None
    # "auto" (this GPU's tuned profile if the build has one, else its family's), "family",
    # "reference", a shipped profile name, a path in the build, or "tuned" with the document
    # below (the farm sends the newest profile tuned on the device's GPU).
    profile: str = "auto"
    profile_document: dict[str, Any] | None = None
    # generate and latency
    prompt: str = "a photograph of an astronaut riding a horse"
    negative_prompt: str = ""
    seed: int = 0
    steps: int = 20
    scheduler: str = "pndm"
    guidance_scale: float = 7.5
    # latency
    warmup: int = 1
    repetitions: int = 5
    unet_repetitions: int = 10
    kernel_timings: bool = True
    # profiled UNet steps for per-kernel GPU times, apart from the timed ones (profiling splits
    # passes); None: as many as unet_repetitions
    kernel_repetitions: int | None = None
    # tune
    tune_repeats: int = 5
    tune_time_budget_s: float = 600.0
    # every kind
    time_limit_s: float = 3600.0
    cooldown: Cooldown | None = None
    # img2img (generate only): the starting image, noised to `strength` (1.0: fully) and then
    # denoised. A data: URI of a PNG or JPEG (what `farm jobs submit --init-image` sends, so
    # the image travels with the job), a path in the build, or a path on the device.
    init_image: str | None = None
    strength: float = 0.8
    # Who runs the model (EXECUTORS): "native" (the eager engine on the device's GPU), "plan"
    # (engine plans replayed there) or "browser" (a WebGPU page runs the plans: what the farm
    # sends to a phone's browser). The farm sets it when the job is submitted (a device whose
    # host kind is browser gets "browser"); an agent run by hand runs native unless told.
    executor: str = "native"
    # The most GPU memory the job's plans may hold, in bytes (plan and browser executors: their
    # weights are staged when only that fits; a plan that cannot fit fails the job at once with
    # the reasons). None: no budget.
    gpu_budget_bytes: int | None = None
    protocol: int = PROTOCOL_VERSION

    def __post_init__(self):
        if not isinstance(self.job_id, str) or not NAME_PATTERN.fullmatch(self.job_id):
            raise ProtocolError(f"JobSpec.job_id {self.job_id!r}: {NAME_RULE}")
        if self.kind not in JOB_KINDS:
            raise ProtocolError(f"unknown job kind {self.kind!r}; known kinds: {', '.join(JOB_KINDS)}")
        for name in ("steps", "repetitions", "unet_repetitions", "tune_repeats"):
            if getattr(self, name) < 1:
                raise ProtocolError(f"JobSpec.{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0 or not self.time_limit_s > 0:
            raise ProtocolError("JobSpec.warmup must be >= 0 and time_limit_s > 0")
        _bounded(self, "JobSpec.steps", self.steps, 1, MAX_STEPS)
        for name in ("repetitions", "unet_repetitions", "tune_repeats", "warmup"):
            _bounded(self, f"JobSpec.{name}", getattr(self, name), 0, MAX_REPETITIONS)
        if self.kernel_repetitions is not None:
            _bounded(self, "JobSpec.kernel_repetitions", self.kernel_repetitions, 1, MAX_REPETITIONS)
        for name in ("height", "width"):
            if getattr(self, name) is not None:
                _bounded(self, f"JobSpec.{name}", getattr(self, name), 8, MAX_SIDE)
        _bounded(self, "JobSpec.seed", self.seed, 0, MAX_SEED)
        _bounded(self, "JobSpec.guidance_scale", self.guidance_scale, 0.0, MAX_GUIDANCE)
        _bounded(self, "JobSpec.time_limit_s", self.time_limit_s, 0.0, MAX_TIME_S, low_open=True)
        _bounded(self, "JobSpec.tune_time_budget_s", self.tune_time_budget_s, 0.0, MAX_TIME_S, low_open=True)
        if not 0.0 < self.strength <= 1.0:
            raise ProtocolError(f"JobSpec.strength must be in (0, 1], got {self.strength}")
        if self.gpu_budget_bytes is not None:
            _bounded(self, "JobSpec.gpu_budget_bytes", self.gpu_budget_bytes, MIN_GPU_BUDGET, MAX_GPU_BUDGET)
        if self.executor not in EXECUTORS:
            raise ProtocolError(f"JobSpec.executor {self.executor!r} is not one of "
                                f"{', '.join(EXECUTORS)}")
        if self.init_image is not None:
            if self.kind != "generate":
                raise ProtocolError(f"JobSpec.init_image is for generate jobs, not {self.kind}")
            if self.init_image.startswith("data:") and not INIT_IMAGE_URI.fullmatch(self.init_image[:64]):
                raise ProtocolError("JobSpec.init_image: a data: URI must be data:image/png;base64,... "
                                    "or data:image/jpeg;base64,...")
            if len(self.init_image) > INIT_IMAGE_MAX_CHARS:
                raise ProtocolError(f"JobSpec.init_image is {len(self.init_image)} characters; at most "
                                    f"{INIT_IMAGE_MAX_CHARS} (an {INIT_IMAGE_MAX_BYTES // 2**20} MiB image)")


AGENT_CONFIG_FILE = "agent.json"  # under the agent's root


@dataclass
class AgentConfig:
    """An agent's own settings, which its host's farm writes under the agent's root
    (AGENT_CONFIG_FILE, readable by its owner only): what belongs to the device rather than to
    a job, kept off command lines and out of the environment. `browser_page` is the control
    URL of the page a farm's hub holds for this device's browser (it carries the hub's key):
    jobs on the browser executor run there; without it the agent starts a headless Chromium."""

    browser_page: str | None = None


# ---- job result ---------------------------------------------------------------------------


@dataclass
class Sample:
    """One raw measurement: no aggregation happens on the device."""

    metric: str  # carries its unit: unet_step_ms, e2e_ms, peak_gpu_bytes, ...
    value: float
    unit: str
    repetition: int = 0


@dataclass
class KernelTiming:
    kernel: str  # the dispatch label, e.g. "conv2d", "attention/flash"
    calls: int
    total_ms: float
    repetition: int = 0


@dataclass
class ThermalReading:
    phase: Literal["before", "after"]
    zone: str
    celsius: float


@dataclass
class Artifact:
    path: str  # relative to the job's output folder
    sha256: str
    size: int
    kind: str = "file"  # image, profile, log, ...


@dataclass
class RunEnvironment:
    """What one run ran on, read by the agent on the device when the run started: a phone that
    updates between two runs records two environments, whatever the device's record says.

    The fields that make two runs' numbers comparable are os, os_version, os_build, kernel,
    driver, the adapter's identity and the WebGPU runtime (orchestrator/store/environment.py keys series
    by them). clocks_mhz and profile are kept with the run but are no part of that key: clocks
    move from one run to the next, and the profile is what the build ships (a new profile is
    the build's doing). Readings the device does not give stay empty, never guessed."""

    os: str = ""  # android, linux, darwin, windows
    os_version: str = ""  # Android's release ("14"); Linux's kernel release; macOS's version
    os_build: str = ""  # Android's ro.build.fingerprint (new with every update); a Linux distribution's name
    kernel: str = ""  # uname's release
    driver: str = ""  # the GPU driver as the adapter describes it (name and version)
    # vendor, architecture, device, backend, adapter_type, vendor_id, device_id, adapter_id
    adapter: dict[str, Any] = field(default_factory=dict)
    # {"kind": "wgpu-native", "version": "29.0.1.1", "binding": "wgpu-py 0.32.0"}, or
    # {"kind": "browser", "name": "Chrome", "version": "131.0.6778.39"} for the browser executor
    runtime: dict[str, str] = field(default_factory=dict)
    clocks_mhz: dict[str, float] = field(default_factory=dict)  # gpu, cpu0, ... where readable
    profile: dict[str, str] = field(default_factory=dict)  # the profile the engine ran: name, sha256
    # "agent": read on the device for this run; "device-record": filled by the control plane
    # from its record of the device, for a result of an agent that did not send one
    source: str = "agent"


@dataclass
class JobResult:
    job_id: str
    kind: JobKind
    status: JobStatus
    error: str | None = None
    started_at: float = 0.0  # unix seconds
    finished_at: float = 0.0
    device: str = ""  # adapter description the job ran on
    engine: dict[str, Any] = field(default_factory=dict)  # profile, precision, decisions, timings
    samples: list[Sample] = field(default_factory=list)
    kernel_timings: list[KernelTiming] = field(default_factory=list)
    thermal: list[ThermalReading] = field(default_factory=list)
    cooldown_wait_s: float | None = None
    cooldown_timed_out: bool = False
    artifacts: list[Artifact] = field(default_factory=list)
    log_tail: str = ""
    environment: RunEnvironment | None = None  # None from agents older than RunEnvironment
    protocol: int = PROTOCOL_VERSION


# ---- device information -------------------------------------------------------------------


@dataclass
class ThermalZone:
    name: str
    celsius: float
    source: str = ""  # /sys/class/thermal/thermal_zone3, dumpsys thermalservice, kgsl, ...


@dataclass
class Battery:
    level_percent: float | None = None
    celsius: float | None = None
    status: str | None = None  # charging, discharging, full, ...
    plugged: str | None = None


@dataclass
class DeviceInfo:
    serial: str
    model: str  # marketing or product model, e.g. "SM-S918B", "MacBookPro18,3"
    manufacturer: str
    os: str  # android, linux, darwin, windows
    os_version: str
    adapter: dict[str, Any]  # engine.device.DeviceCaps.as_dict(): vendor, architecture, device, ...
    cpu: str = ""
    cpu_cores: int = 0
    memory_bytes: int = 0
    thermal: list[ThermalZone] = field(default_factory=list)
    battery: Battery | None = None
    clocks_mhz: dict[str, float] = field(default_factory=dict)  # gpu, cpu0, ... where readable
    properties: dict[str, str] = field(default_factory=dict)  # getprop values used, soc, board...
    virtual: bool = False  # a simulated device (its GPU is still the host's real adapter)
    # Which physical GPU the device's work runs on (deviceinfo.adapter_id): devices reporting
    # the same id share one adapter, and the farm never times two jobs on it at once.
    adapter_id: str = ""
    agent_version: str = ""
    protocol: int = PROTOCOL_VERSION


# ---- bundle manifest ----------------------------------------------------------------------


# A signed build as it travels and as devices keep it (agent/bundle.py makes and checks it):
#     <bundle>/manifest.json  <bundle>/manifest.sig  <bundle>/files/<path>
# and a device's farm key beside its builds, the key manifests are checked with. Files are
# named by their sha256 (sha256_file), which is how a transport tells what a device holds.
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
FILES = "files"
FARM_KEY = "farm.pub"


# A build's files travel and are checked in chunks of this size (the last one shorter): the
# signed manifest lists each chunk's sha256, so a transport cut inside a 1.7 GB weight file
# resumes from its last whole chunk and a page verifies and stores a file a chunk at a time.
CHUNK_SIZE = 4 << 20


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks a file of `size` bytes has (an empty file has none)."""
    return -(-size // chunk_size) if chunk_size else 0


def sha256_file(path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file's bytes, read a chunk at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class ManifestFile:
    path: str  # relative, forward slashes
    sha256: str
    size: int
    mode: int = 0o644
    chunks: list[str] = field(default_factory=list)  # sha256 of each Manifest.chunk_size piece


@dataclass
class Manifest:
    """The list of files of a build; signed (Ed25519 over `canonical_bytes()`) by the farm."""

    build: str
    version: str
    created: float
    files: list[ManifestFile]
    source_revision: str = ""
    protocol: int = PROTOCOL_VERSION
    chunk_size: int = 0  # the size of every file's chunks but its last; 0: no chunks listed

    def canonical_bytes(self) -> bytes:
        return json.dumps(to_dict(self), sort_keys=True, separators=(",", ":")).encode()


# ---- (de)serialisation ----------------------------------------------------------------------


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def to_json(obj, indent: int | None = 2) -> str:
    return json.dumps(to_dict(obj), indent=indent, sort_keys=True)


def from_dict(cls, data: Any, where: str | None = None):
    """Build dataclass `cls` from parsed JSON, checking the protocol version, unknown and
    missing fields and basic types; errors name the offending field."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected an object, got {type(data).__name__}")
    if "protocol" in {f.name for f in dataclasses.fields(cls)}:
        version = data.get("protocol", PROTOCOL_VERSION)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{where} speaks protocol {version}, this side speaks {PROTOCOL_VERSION}: "
                "upgrade the older of the orchestrator and the agent (deploy a new build)"
            )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {', '.join(unknown)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{where}: missing field {f.name!r}")
            continue
        kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{where}.{f.name}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ProtocolError(f"{where}: {exc}") from None


def _no_constant(name: str):
    raise BadValue(f"{name} is not a number JSON has (a NaN or an infinity)")


def from_json(cls, text: str | bytes):
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except BadValue as exc:
        raise BadValue(f"{cls.__name__}: {exc}") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"{cls.__name__}: not valid JSON ({exc})") from None
    return from_dict(cls, data)


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except ProtocolError as exc:
                errors.append(str(exc))
        raise ProtocolError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ProtocolError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object")
        check_plain(list(value), f"{where} (its keys)")
        return {str(k): _coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if tp is Any:
        check_plain(value, where)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise BadValue(f"{where} must be a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp in (str, bool) and not isinstance(value, tp):
        raise ProtocolError(f"{where}: expected {tp.__name__}, got {value!r}")
    if tp is str and "\x00" in value:
        raise BadValue(f"{where}: contains a NUL character")
    return value
