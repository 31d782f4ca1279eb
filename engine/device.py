"""The process's one WebGPU device: adapter discovery, the capabilities read once at creation
(adapter identity, features, limits, timestamp period), and the translation of WebGPU errors
into engine exceptions. Everything else asks `DeviceCaps` what the GPU can do instead of
probing the adapter again."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from .errors import AdapterError, GPUError

# Features the engine uses when the adapter offers them; none is mandatory.
WANTED_FEATURES = ("shader-f16", "subgroup", "timestamp-query")

# Limits requested at the adapter's own maximum: the defaults (128 MiB bindings, 16 KiB of
# workgroup storage) are far below what real Stable Diffusion weights and activations need.
# Keys are wgpu-py's names (DeviceCaps.limits); values the JavaScript API's, which a browser
# page reports and a plan's "requires" uses. The one table of both spellings.
JS_LIMIT_NAMES = {
    "max-storage-buffer-binding-size": "maxStorageBufferBindingSize",
    "max-buffer-size": "maxBufferSize",
    "max-compute-workgroup-storage-size": "maxComputeWorkgroupStorageSize",
    "max-compute-invocations-per-workgroup": "maxComputeInvocationsPerWorkgroup",
    "max-compute-workgroup-size-x": "maxComputeWorkgroupSizeX",
    "max-compute-workgroup-size-y": "maxComputeWorkgroupSizeY",
    "max-compute-workgroups-per-dimension": "maxComputeWorkgroupsPerDimension",
    "max-storage-buffers-per-shader-stage": "maxStorageBuffersPerShaderStage",
}
WANTED_LIMITS = tuple(JS_LIMIT_NAMES)

INSTALL_HINT = (
    "install a Vulkan, Metal or D3D12 driver; on Debian/Ubuntu without a GPU, "
    "`apt-get install mesa-vulkan-drivers libvulkan1` provides the lavapipe software adapter"
)


@dataclass(frozen=True)
class DeviceCaps:
    """What the adapter is and what it can do, read once when the device is created."""

    vendor: str
    architecture: str
    device: str
    description: str
    adapter_type: str  # DiscreteGPU, IntegratedGPU, CPU, Unknown
    backend: str  # Vulkan, Metal, D3D12, ...
    vendor_id: int
    device_id: int
    features: frozenset[str]
    limits: dict[str, int] = field(hash=False)
    timestamp_period_ns: float = 1.0
    # GPU memory a page on this device can hold before the browser kills it, where a public
    # source gives one (engine/adapters/); every plan's budget is at most this
    memory_budget_bytes: int | None = None

    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features

    @property
    def has_subgroups(self) -> bool:
        return "subgroup" in self.features

    @property
    def has_timestamps(self) -> bool:
        return "timestamp-query" in self.features

    @property
    def max_binding_bytes(self) -> int:
        return int(self.limits["max-storage-buffer-binding-size"])

    @property
    def max_workgroups(self) -> int:
        return int(self.limits["max-compute-workgroups-per-dimension"])

    def as_dict(self) -> dict:
        return {
            "vendor": self.vendor,
            "architecture": self.architecture,
            "device": self.device,
            "description": self.description,
            "adapter_type": self.adapter_type,
            "backend": self.backend,
            "vendor_id": self.vendor_id,
            "device_id": self.device_id,
            "features": sorted(self.features),
            "limits": dict(sorted(self.limits.items())),
            "timestamp_period_ns": self.timestamp_period_ns,
            **({"memory_budget_bytes": self.memory_budget_bytes} if self.memory_budget_bytes else {}),
        }


ADAPTERS_DIR = Path(__file__).resolve().parent / "adapters"  # phones' browsers, from public sources


def caps_from_dict(doc: dict) -> DeviceCaps:
    """DeviceCaps from their JSON form (`DeviceCaps.as_dict`, `farm engine info --json`, the
    files in engine/adapters). A `source` entry (where the figures come from) is kept out;
    ValueError or TypeError for anything else that is not an adapter description."""
    if not isinstance(doc, dict):
        raise ValueError("an adapter description is a JSON object")
    fields = {k: v for k, v in doc.items() if k != "source"}
    return DeviceCaps(**{**fields, "features": frozenset(fields.get("features", ())),
                         "limits": {k: int(v) for k, v in fields.get("limits", {}).items()}})


class GPU:
    """The wgpu device plus its capabilities. Create it through `get_gpu()`."""

    def __init__(self, adapter, device, caps: DeviceCaps):
        self.adapter = adapter
        self.device = device
        self.queue = device.queue
        self.caps = caps
        # what every PipelineCache of this device compiled: modules by WGSL source, pipelines by
        # (source, constants, entry point)
        self.compiled: tuple[dict[str, object], dict[tuple, object]] = ({}, {})
        # whether the engine's own kernels compile without WebGPU's run-time checks: wherever
        # wgpu-native runs them (not Dawn, not a browser), unless FARM_SHADER_CHECKS=1 keeps the
        # checks (docs/engine.md, "Run-time checks")
        self.unchecked = kernels_unchecked()

    def shader_module(self, code: str, label: str):
        """The module of one of the engine's kernels. WebGPU's run-time checks clamp every index
        into its array and bound every loop, for code a browser cannot trust; the engine's
        kernels guard their own indices (every variant is tested against numpy on partial tiles
        with poisoned outputs), so where wgpu-native runs them they compile without: on the H100
        SD 1.4's UNet step went from 56.5 to 48.5 ms (docs/benchmarks.md). Results may move by
        rounding only (a loop contracted differently once its clamps are gone)."""
        if not self.unchecked:
            return self.device.create_shader_module(label=label, code=code)
        return _unchecked_module(self.device, code, label)


def kernels_unchecked() -> bool:
    """Whether a device of this process compiles the engine's kernels without WebGPU's run-time
    checks: wgpu-native is the wgpu in use and FARM_SHADER_CHECKS is not 1."""
    return os.environ.get("FARM_SHADER_CHECKS") != "1" and _native_trusted_call() is not None


# wgpu-native's wgpuDeviceCreateShaderModuleTrusted, where the wgpu in use is wgpu-native's
def _native_trusted_call():
    try:
        import wgpu

        if not type(wgpu.gpu).__module__.startswith(("wgpu.backends.wgpu_native", "wgpu._classes")):
            return None  # another implementation (Dawn's) is installed as wgpu: never load wgpu-native beside it
        from wgpu.backends.wgpu_native import _ffi
    except Exception:  # no wgpu, or a backend that cannot load here
        return None
    if not type(wgpu.gpu).__module__.startswith("wgpu.backends.wgpu_native"):
        return None
    return getattr(_ffi.lib, "wgpuDeviceCreateShaderModuleTrusted", None)


def _unchecked_module(device, code: str, label: str):
    """A WGSL module compiled with no run-time checks (WGPUShaderRuntimeChecks none): the
    kernel's own guards are all that keep its indices in bounds. Built as wgpu-py builds a
    checked one."""
    from wgpu.backends.wgpu_native import _api
    from wgpu.backends.wgpu_native._ffi import ffi, lib

    source = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(code))
    source[0].chain.next = ffi.NULL
    source[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    descriptor = _api.new_struct_p("WGPUShaderModuleDescriptor *",
                                   nextInChain=ffi.cast("WGPUChainedStruct *", source),
                                   label=_api.to_c_string_view(label))
    handle = lib.wgpuDeviceCreateShaderModuleTrusted(device._internal, descriptor, 0)
    if handle == ffi.NULL:
        raise GPUError(f"compiling {label} unchecked failed")
    return _api.GPUShaderModule(label, handle, device)


def _timestamp_period(queue) -> float:
    # wgpu-py does not expose wgpuQueueGetTimestampPeriod; the native call is the only source
    # of the tick length, which is not 1 ns on every backend.
    try:
        from wgpu.backends.wgpu_native import _ffi

        return float(_ffi.lib.wgpuQueueGetTimestampPeriod(queue._internal))
    except Exception:
        return 1.0


def _request_adapter(power_preference: str):
    import wgpu

    try:
        adapter = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
    except Exception as exc:  # wgpu raises a plain RuntimeError when no driver loads
        raise AdapterError(f"no WebGPU adapter could be found ({exc}); {INSTALL_HINT}") from exc
    if adapter is None:
        raise AdapterError(f"no WebGPU adapter could be found; {INSTALL_HINT}")
    return adapter


def create_gpu(power_preference: str = "high-performance") -> GPU:
    """Open the adapter and a device with every wanted feature it has and its real limits."""
    try:
        import wgpu
    except ImportError as exc:
        raise AdapterError(f"the wgpu package could not be imported ({exc}); pip install wgpu") from exc

    adapter = _request_adapter(power_preference)
    features = [f for f in WANTED_FEATURES if f in adapter.features]
    if os.environ.get("FARM_DISABLE_F16") == "1" and "shader-f16" in features:
        features.remove("shader-f16")  # lets tests exercise the fp32 fallback on any adapter
    limits = {name: adapter.limits[name] for name in WANTED_LIMITS if name in adapter.limits}
    try:
        device = adapter.request_device_sync(required_features=features, required_limits=limits)
    except wgpu.GPUError as exc:
        raise AdapterError(f"the adapter refused a device with features {features}: {exc}") from exc
    info = adapter.info
    caps = DeviceCaps(
        vendor=str(info.get("vendor", "")),
        architecture=str(info.get("architecture", "")),
        device=str(info.get("device", "")),
        description=str(info.get("description", "")),
        adapter_type=str(info.get("adapter_type", "")),
        backend=str(info.get("backend_type", "")),
        vendor_id=int(info.get("vendor_id", 0) or 0),
        device_id=int(info.get("device_id", 0) or 0),
        features=frozenset(features),
        limits={k: int(v) for k, v in device.limits.items() if isinstance(v, int)},
        timestamp_period_ns=_timestamp_period(device.queue),
    )
    return GPU(adapter, device, caps)


@cache
def get_gpu() -> GPU:
    """The process's one device, created on first use."""
    return create_gpu()


def gpu_call(what: str, fn, *args, **kwargs):
    """Run one wgpu call and turn WebGPU's errors into GPUError naming what was attempted."""
    import wgpu

    try:
        return fn(*args, **kwargs)
    except wgpu.GPUError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first if line.strip())[:600]
        raise GPUError(f"WebGPU error while {what}: {detail}") from exc
