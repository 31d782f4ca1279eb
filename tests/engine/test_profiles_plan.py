"""Every shipped profile runs every preset: SD 1.4 at 512x512 (with and without guidance, fp16
and fp32) and the tiny model are planned with each profile in engine/profiles for an adapter of
its family, with that family's limits, and the plan must ask for nothing the adapter lacks.
Planning needs no GPU (a preset's shapes, no weights), so a profile whose constants cannot run
on its own family (a split-K product whose partials overflow the core's scratch, tiles over the
workgroup storage) is caught here rather than by the first user with that GPU."""

from __future__ import annotations

import warnings

import pytest

from engine.device import JS_LIMIT_NAMES, DeviceCaps
from engine.make_model import preset_model_config
from engine.plan import record_plan
from engine.profiles import shipped_profiles

GiB, MiB = 1 << 30, 1 << 20


def adapter(vendor: str, device: str, vendor_id: int, adapter_type: str, backend: str, *, binding: int,
            buffer: int, workgroup_storage: int, invocations: int, f16: bool = True) -> DeviceCaps:
    return DeviceCaps(
        vendor=vendor, architecture="", device=device, description="", adapter_type=adapter_type,
        backend=backend, vendor_id=vendor_id, device_id=0,
        features=frozenset({"shader-f16"} if f16 else set()),
        limits={"max-storage-buffer-binding-size": binding, "max-buffer-size": buffer,
                "max-compute-workgroup-storage-size": workgroup_storage,
                "max-compute-invocations-per-workgroup": invocations,
                "max-compute-workgroups-per-dimension": 65535, "max-storage-buffers-per-shader-stage": 8},
    )


# One adapter per profile, as the engine meets that family: GPU hosts natively through wgpu,
# phones through their browsers' WebGPU (../shared/notes/browser-facts.md has the sources).
FAMILY_ADAPTERS = {
    # NVIDIA's Vulkan driver: 48 KiB of shared memory per workgroup on every GPU since Volta.
    "nvidia": adapter("nvidia", "NVIDIA GeForce RTX 4090", 0x10DE, "DiscreteGPU", "Vulkan", binding=2 * GiB,
                      buffer=16 * GiB, workgroup_storage=49152, invocations=1024),
    # What wgpu-native reports on the lent H100 (benchmarks/memory_estimate.py's H100).
    "tuned-nvidia-h100-80gb-hbm3": adapter("nvidia", "NVIDIA H100 80GB HBM3", 0x10DE, "DiscreteGPU", "Vulkan",
                                           binding=4 * GiB - 1, buffer=1 << 40, workgroup_storage=49152,
                                           invocations=1024),
    "amd": adapter("amd", "AMD Radeon RX 7900 XTX", 0x1002, "DiscreteGPU", "Vulkan", binding=2 * GiB,
                   buffer=16 * GiB, workgroup_storage=65536, invocations=1024),
    "intel": adapter("intel", "Intel(R) Arc(tm) A770 Graphics", 0x8086, "DiscreteGPU", "Vulkan", binding=GiB,
                     buffer=8 * GiB, workgroup_storage=65536, invocations=1024),
    # Chrome on Android: Dawn's limit tiers for an Adreno 640 class and newer.
    "adreno": adapter("qualcomm", "Adreno (TM) 740", 0x5143, "IntegratedGPU", "Vulkan", binding=512 * MiB,
                      buffer=GiB, workgroup_storage=32768, invocations=1024),
    "adreno6xx": adapter("qualcomm", "Adreno (TM) 650", 0x5143, "IntegratedGPU", "Vulkan", binding=512 * MiB,
                         buffer=GiB, workgroup_storage=32768, invocations=1024),
    # A Mali-G78 class in Chrome: 256 MiB bindings, 256 invocations per workgroup.
    "mali": adapter("arm", "Mali-G78", 0x13B5, "IntegratedGPU", "Vulkan", binding=256 * MiB, buffer=GiB,
                    workgroup_storage=32768, invocations=256),
    # Safari (WebKit's HardwareCapabilities.mm): bindings and buffers capped at 1 GiB.
    "apple": adapter("apple", "Apple A17 Pro GPU", 0, "IntegratedGPU", "Metal", binding=GiB, buffer=GiB,
                     workgroup_storage=32768, invocations=1024),
    # Mesa's lavapipe as wgpu reports it on this project's machines (Mesa 22.3.6).
    "software": adapter("llvmpipe", "llvmpipe (LLVM 15.0.6, 256 bits)", 0x10005, "CPU", "Vulkan",
                        binding=128 * MiB, buffer=2 * GiB - 1, workgroup_storage=32768, invocations=1024),
}
LIMIT_NAMES = {js: ours for ours, js in JS_LIMIT_NAMES.items()}  # JavaScript's name -> the adapter's
CASES = [("sd14", precision, guidance) for precision in ("fp16", "fp32") for guidance in (7.5, 1.0)] + \
        [("tiny", "fp32", 7.5), ("tiny", "fp16", 1.0)]
# The planner does not split the VAE decoder's 256 MiB f32 activations for an adapter that binds
# at most 128 MiB: in fp16 the decoder stores them as halves instead (record_plan), in fp32 the
# plan needs 256 MiB bindings (strict, so that a split turns these cases red until the mark goes).
BINDING_SPLIT_MISSING = {("software", "sd14", "fp32")}


def test_every_shipped_profile_has_a_family_adapter_that_it_matches():
    names = {p.name for p in shipped_profiles()}
    assert names == set(FAMILY_ADAPTERS), "give each shipped profile an adapter of its family here"
    for profile in shipped_profiles():
        assert profile.matches(FAMILY_ADAPTERS[profile.name]), profile.name


@pytest.mark.parametrize("preset,precision,guidance", CASES)
@pytest.mark.parametrize("name", sorted(FAMILY_ADAPTERS))
def test_every_shipped_profile_plans_every_preset_within_its_familys_limits(request, name, preset, precision,
                                                                             guidance):
    if (name, preset, precision) in BINDING_SPLIT_MISSING:
        request.applymarker(pytest.mark.xfail(strict=True, reason="issue 29: bindings above 128 MiB"))
    profile = next(p for p in shipped_profiles() if p.name == name)
    caps = FAMILY_ADAPTERS[name]
    config = preset_model_config(preset)
    height, width = (512, 512) if preset == "sd14" else config.native_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a variant's fallback to reference is allowed, not an error
        doc = record_plan(config, caps, precision=precision, height=height, width=width, steps=20,
                          guidance_scale=guidance, profile=profile.to_json(), model_name=preset, hashes=False)
    assert doc["dtype"] == ("f16" if precision == "fp16" else "f32")
    assert doc["profile"]["name"] == name
    missing = set(doc["requires"]["features"]) - caps.features
    assert not missing, f"{name}: the plan needs {sorted(missing)}"
    for js_name, value in doc["requires"]["limits"].items():
        have = caps.limits[LIMIT_NAMES[js_name]]
        assert value <= have, f"{name} {preset} {precision}: the plan needs {js_name} {value}, the adapter has {have}"
