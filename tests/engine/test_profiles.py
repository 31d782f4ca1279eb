"""Kernel-selection profiles: every shipped file validates, invalid ones are refused with the
valid choices listed, adapters get the right family's profile, and the tiny UNet computes the
same function (within the fp32 bar, 1e-4) whichever variant each op uses."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from ci_support import F16_HINT, missing

from engine.device import DeviceCaps
from engine.errors import EngineError
from engine.kernels import REGISTRY, Selection
from engine.profiles import (
    REFERENCE,
    SCHEMA_ID,
    ProfileError,
    auto_profile,
    load_profile_file,
    parse_profile,
    profile_sha256,
    resolve_profile,
    shipped_profiles,
)

FAMILIES = {"adreno", "adreno6xx", "apple", "mali", "nvidia", "amd", "intel", "software"}


def caps(**kw) -> DeviceCaps:
    base = dict(vendor="", architecture="", device="", description="", adapter_type="IntegratedGPU",
                backend="Vulkan", vendor_id=0, device_id=0, features=frozenset({"shader-f16"}), limits={})
    return DeviceCaps(**{**base, **kw})


def test_every_shipped_profile_validates_and_names_real_variants():
    profiles = shipped_profiles()
    assert {p.name for p in profiles} >= FAMILIES
    for p in profiles:
        again = parse_profile(p.to_json(), p.source)  # round trip through the document form
        assert again.rules == p.rules
        for r in p.rules:
            assert r.variant in REGISTRY[r.op]


@pytest.mark.parametrize(
    "adapter,expected",
    [
        (caps(vendor_id=20803, device="Adreno (TM) 740"), "adreno"),
        (caps(vendor_id=20803, device="Adreno (TM) 650"), "adreno6xx"),
        (caps(vendor_id=5045, device="Mali-G715"), "mali"),
        (caps(device="Apple M2", backend="Metal"), "apple"),
        (caps(vendor_id=4318, device="NVIDIA H100 80GB HBM3", adapter_type="DiscreteGPU"), "tuned-nvidia-h100-80gb-hbm3"),
        (caps(vendor_id=4318, device="NVIDIA GeForce RTX 4090", adapter_type="DiscreteGPU"), "nvidia"),
        (caps(vendor_id=65541, device="llvmpipe (LLVM 15.0.6, 256 bits)", adapter_type="CPU"), "software"),
        (caps(vendor_id=1234, device="Some Future GPU"), "reference"),
    ],
)
def test_auto_picks_the_family_profile(adapter, expected):
    assert auto_profile(adapter).name == expected


# What Chrome (Dawn's gpu_info names) and Safari report as GPUAdapterInfo: a vendor and an
# architecture, never a PCI id, often no device name.
@pytest.mark.parametrize(
    "info,expected",
    [
        ({"vendor": "qualcomm", "architecture": "adreno-7xx"}, "adreno"),
        ({"vendor": "qualcomm", "architecture": "adreno-8xx"}, "adreno"),
        ({"vendor": "qualcomm", "architecture": "adreno-6xx"}, "adreno6xx"),
        ({"vendor": "arm", "architecture": "valhall"}, "mali"),
        ({"vendor": "arm", "architecture": "bifrost"}, "mali"),
        ({"vendor": "apple", "architecture": "common-3"}, "apple"),
        ({"vendor": "apple", "architecture": ""}, "apple"),
        ({"vendor": "nvidia", "architecture": "ampere"}, "nvidia"),
        ({"vendor": "intel", "architecture": "xe-lpg"}, "intel"),
        ({"vendor": "amd", "architecture": "rdna-3"}, "amd"),
        ({"vendor": "google", "architecture": "swiftshader"}, "software"),
        ({"vendor": "img-tec", "architecture": "rogue"}, "reference"),  # no family profile yet
    ],
)
def test_auto_picks_the_family_profile_from_what_a_browser_reports(info, expected):
    from engine.browser import caps_of

    adapter = caps_of({"device": "", "description": "", "features": ["shader-f16"], "limits": {}, **info})
    assert adapter.vendor_id == 0  # browsers report no PCI ids
    assert auto_profile(adapter).name == expected


PHONE_FAMILIES = {"adreno-640-chrome.json": "adreno6xx", "adreno-7xx-128mib-chrome.json": "adreno",
                  "mali-g78-chrome.json": "mali", "mali-g78-256mib-chrome.json": "mali",
                  "apple-iphone-safari.json": "apple"}


def test_the_phone_adapter_files_name_their_sources_and_get_their_familys_profile():
    from engine.device import ADAPTERS_DIR, caps_from_dict

    assert {p.name for p in ADAPTERS_DIR.glob("*.json")} == set(PHONE_FAMILIES)
    for name, family in PHONE_FAMILIES.items():
        doc = json.loads((ADAPTERS_DIR / name).read_text())
        assert doc["source"] and all(isinstance(line, str) and line for line in doc["source"]), name
        adapter = caps_from_dict(doc)
        assert auto_profile(adapter).name == family, name
        binding = adapter.limits["max-storage-buffer-binding-size"]
        assert 128 * 2**20 <= binding <= adapter.limits["max-buffer-size"], name


def test_paper_rules_flash_only_for_head_dim_40_on_adreno():
    sel = auto_profile(caps(vendor_id=20803, device="Adreno (TM) 740")).selection(
        caps(features=frozenset({"shader-f16", "subgroup"})))
    assert sel.variant("attention", {"dh": 40, "causal": 0, "tq": 4096, "tk": 4096}).name == "flash"
    assert sel.variant("attention", {"dh": 80, "causal": 0, "tq": 1024, "tk": 1024}).name == "partial_softmax"
    conv = {"k": 3, "stride": 1, "cin": 320, "cout": 320, "tiles": 512}
    assert sel.variant("conv2d", conv).name == "winograd"
    assert sel.variant("conv2d", {**conv, "cin": 64, "cout": 64}).name != "winograd"  # Adreno wants >= 128


def doc(**rules_or_top):
    d = {"schema": SCHEMA_ID, "name": "t", "rules": []}
    d.update(rules_or_top)
    return d


@pytest.mark.parametrize(
    "bad,message",
    [
        (doc(schema="devicefarm.profile/9"), "expected 'devicefarm.profile/1'"),
        (doc(rules=[{"op": "convolution", "variant": "reference"}]), "choose one of linear, conv2d"),
        (doc(rules=[{"op": "attention", "variant": "fast"}]), "choose one of flash, flash_gemm, flash_packed, gemm_softmax, partial_softmax, reference"),
        (doc(rules=[{"op": "attention", "variant": "reference", "when": {"tokens": 4}}]), "choose from tq, tk, dh"),
        (doc(rules=[{"op": "attention", "variant": "reference", "constants": {"BLOCK": 3}}]), "not a constant"),
        (doc(match={"gpu": ["x"]}), "keys are among"),
        (doc(match=[{"vendor_id": [1]}, {"gpu": ["x"]}]), r"match\[1\]: an object .* keys are among"),
        (doc(match=[{"vendor": "arm"}]), r"match\[0\]\.vendor: must be a list of strings"),
        (doc(match=[]), "needs at least one"),
        (doc(extra=1), "unknown key"),
        (doc(rules=[{"op": "attention", "variant": "reference", "when": {"dtype": "fp16"}}]),
         r"when\.dtype: 'fp16' is not an element type; choose from f32, f16, f16s"),
    ],
)
def test_invalid_profiles_are_refused_with_the_choices(bad, message):
    with pytest.raises(ProfileError, match=message):
        parse_profile(bad, "bad.json")


def test_constants_out_of_range_list_the_allowed_values():
    for op, table in REGISTRY.items():
        for name, v in table.items():
            for const, allowed in v.constants.items():
                bad = max(int(a) for a in allowed) * 1000 + 7
                with pytest.raises(ProfileError, match=r"out of range; allowed"):
                    parse_profile(doc(rules=[{"op": op, "variant": name, "constants": {const: bad}}]))
                return
    pytest.fail("no variant declares tunable constants")


def test_profile_for_another_gpu_is_used_with_a_warning(tmp_path):
    p = tmp_path / "other.json"
    p.write_text(json.dumps(doc(match={"vendor_id": [4318]}, rules=[{"op": "group_norm", "variant": "fused"}])))
    with pytest.warns(UserWarning, match="was written for"):
        prof = resolve_profile(str(p), caps(vendor_id=5045))
    assert prof.rules[0].variant == "fused"
    with pytest.raises(ProfileError, match="neither a file nor a shipped profile"):
        resolve_profile("no-such-profile", caps())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile_file(bad)


def test_missing_feature_falls_back_with_a_warning(monkeypatch):
    from engine.kernels import Variant

    probe = Variant("attention", "probe", requires=frozenset({"no-such-feature"}))
    monkeypatch.setitem(REGISTRY["attention"], "probe", probe)
    sel = Selection.forcing(frozenset({"shader-f16"}), {"attention": "probe"})
    with pytest.warns(UserWarning, match="needs no-such-feature; using 'reference'"):
        assert sel.variant("attention", {"dh": 40}).name == "reference"
    assert sel.warnings and "probe" in sel.decisions[("attention", (("dh", 40),), None)].why


# ---- the whole UNet under every variant ------------------------------------------------------

def every_variant():
    for op, table in sorted(REGISTRY.items()):
        for name in sorted(table):
            if name != "reference":
                yield op, name


@pytest.mark.gpu
@pytest.mark.parametrize("op,variant", list(every_variant()))
def test_unet_with_each_variant_matches_diffusers(tiny_model_dir, golden, gpu, op, variant):
    import engine

    if REGISTRY[op][variant].requires - gpu.caps.features:
        missing(f"adapter lacks {REGISTRY[op][variant].requires}", F16_HINT)
    pipe = engine.load_pipeline(tiny_model_dir, profile={op: variant})
    out = pipe.unet(golden["unet_sample"], golden["unet_timesteps"], golden["unet_encoder_hidden_states"])
    assert np.linalg.norm(out - golden["unet_out"]) / np.linalg.norm(golden["unet_out"]) <= 1e-4
    used = {d.variant for d in pipe.selection.decisions.values() if d.op == op}
    assert variant in used or pipe.selection.warnings, f"{variant} never ran for {op}: {used}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_unet_under_each_shipped_profile_matches_reference_profile(tiny_model_dir, golden, gpu, name):
    import engine

    pipe = engine.load_pipeline(tiny_model_dir, profile=REFERENCE)
    args = (golden["unet_odd_sample"], golden["unet_timesteps"], golden["unet_encoder_hidden_states"])
    ref = pipe.unet(*args)
    prof = next(p for p in shipped_profiles() if p.name == name)
    pipe.set_profile(dataclasses.replace(prof, match={}))  # force it onto this adapter
    out = pipe.unet(*args)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-4


def test_a_gpu_gets_its_own_tuned_profile_else_its_family():
    llvmpipe = caps(vendor_id=65541, device="llvmpipe (LLVM 15.0.6, 256 bits)", adapter_type="CPU")
    tuned = parse_profile(doc(name="tuned-llvmpipe", priority=100, measurements=[{"op": "linear"}],
                              match={"vendor_id": [65541], "device": r"^llvmpipe \(LLVM 15\.0\.6, 256 bits\)$"}))
    assert auto_profile(llvmpipe, extra=[tuned]).name == "tuned-llvmpipe"  # the exact GPU's
    other = caps(vendor_id=65541, device="llvmpipe (LLVM 16.0.0, 256 bits)", adapter_type="CPU")
    assert auto_profile(other, extra=[tuned]).name == "software"  # another GPU: its family's
    assert auto_profile(llvmpipe, tuned=False, extra=[tuned]).name == "software"
    assert resolve_profile("family", llvmpipe).name == "software"
    h100 = caps(vendor_id=4318, device="NVIDIA H100 80GB HBM3", adapter_type="DiscreteGPU")
    assert resolve_profile("family", h100).name == "nvidia"  # not the shipped H100-tuned one
    assert resolve_profile("auto", h100).name == "tuned-nvidia-h100-80gb-hbm3"


def test_profile_sha256_ignores_key_order_and_layout():
    a = doc(rules=[{"op": "linear", "variant": "tiled", "when": {"m": 4, "n": 8}}])
    b = json.loads(json.dumps(a, indent=3))
    b["rules"][0] = dict(reversed(list(b["rules"][0].items())))
    assert profile_sha256(a) == profile_sha256(b) and len(profile_sha256(a)) == 64
    assert profile_sha256(a) != profile_sha256(a | {"name": "u"})


def test_estimated_gain_against_the_family_from_the_tune_measurements():
    from engine.tune import estimated_gain

    rng = np.random.default_rng()
    shapes = [{"m": int(m), "n": 64, "k": 64} for m in rng.choice(np.arange(8, 512, 8), 6, replace=False)]
    measurements, rules, ref_ms, tiled_ms = [], [], [], []
    for shape in shapes:
        ref, tiled = rng.uniform(0.5, 2.0, 2)
        measurements.append({"op": "linear", "shape": shape, "chosen": "tiled" if tiled < ref else "reference",
                             "results": [{"variant": "reference", "constants": {}, "median_ms": ref},
                                         {"variant": "tiled", "constants": {}, "median_ms": tiled}]})
        if tiled < ref:
            rules.append({"op": "linear", "variant": "tiled", "when": shape})
        ref_ms.append(ref)
        tiled_ms.append(min(ref, tiled))
    tuned = doc(rules=rules, measurements=measurements)
    est = estimated_gain(tuned, REFERENCE, caps())
    assert est["calls"] == 6 and est["calls_not_comparable"] == 0 and est["baseline"] == "reference"
    assert est["gain"] == pytest.approx(np.sum(ref_ms) / np.sum(tiled_ms), rel=1e-12)
    # A baseline whose choice the tune did not measure (other constants) leaves that call out.
    odd = parse_profile(doc(name="fam", rules=[{"op": "linear", "variant": "tiled", "when": shapes[0],
                                                "constants": {"TILE_M": 64}}]))
    est = estimated_gain(tuned, odd, caps())
    assert est["calls"] == 5 and est["calls_not_comparable"] == 1
    assert est["gain"] == pytest.approx(np.sum(ref_ms[1:]) / np.sum(tiled_ms[1:]), rel=1e-12)


def test_tune_warm_up_keeps_the_gpu_busy_for_its_seconds(gpu):
    """tune's warm-up runs the GPU work to completion, again and again, for the time asked."""
    import time

    from engine.gpu import GpuContext
    from engine.tune import warm_up

    rt = GpuContext(gpu)
    x = rt.upload(np.ones((256, 256), np.float32), "f32")
    calls = []

    def work():
        calls.append(rt.read(x).sum())

    t0 = time.perf_counter()
    n = warm_up(rt, work, seconds=0.3)
    assert time.perf_counter() - t0 >= 0.3
    assert n == len(calls) >= 1 and all(c == 256 * 256 for c in calls)


def test_the_tuner_times_each_call_with_its_networks_scratch_bounds(tiny_model_dir, gpu):
    """distinct_calls gives each call the Ops scratch scale its network runs with (the VAE's
    larger Winograd chunks), so a tune times the chunks a pipeline runs."""
    from engine.explain import distinct_calls
    from engine.models.config import load_model_config
    from engine.pipeline import VAE_SCRATCH_SCALE

    calls = distinct_calls(load_model_config(tiny_model_dir), gpu.caps, "f32", 64, 64)
    scales = {scale for _, _, _, scale, _ in calls}
    assert scales == {1, VAE_SCRATCH_SCALE}
    vae_convs = [s for op, s, _, scale, _ in calls if op == "conv2d" and scale == VAE_SCRATCH_SCALE]
    assert vae_convs and all(s["b"] == 1 for s in vae_convs)  # the decoder runs one image


@pytest.mark.parametrize(
    "vendor_id,device,architecture",
    [
        (4318, "NVIDIA H200", "hopper"),
        (4318, "NVIDIA H100 80GB HBM3", "hopper"),
        (4318, "NVIDIA H100 PCIe", "hopper"),
        (4318, "NVIDIA GH200 480GB", "hopper"),
        (4318, "NVIDIA A100-SXM4-80GB", "ampere"),
        (4318, "NVIDIA A10G", "ampere"),
        (4318, "NVIDIA GeForce RTX 3090", "ampere"),
        (4318, "NVIDIA L40S", "lovelace"),
        (4318, "NVIDIA GeForce RTX 4090", "lovelace"),
        (4318, "NVIDIA B200", "blackwell"),
        (4318, "NVIDIA GeForce RTX 5090", "blackwell"),
        (4318, "Tesla T4", "turing"),
        (4098, "AMD Radeon RX 7900 XTX", "rdna-3"),
        (4098, "AMD Instinct MI300X", "cdna-3"),
        (32902, "Intel(R) Arc(TM) A770 Graphics", "xe-hpg"),
        (4318, "NVIDIA Some Future GPU", ""),
        (5045, "Mali-G715", ""),  # a native Mali driver names no architecture; its family decides
    ],
)
def test_a_gpus_architecture_comes_from_its_name_when_its_driver_names_none(vendor_id, device, architecture):
    from engine.profiles import gpu_architecture

    assert gpu_architecture(caps(vendor_id=vendor_id, device=device)) == architecture
    # what a browser reports wins
    assert gpu_architecture(caps(vendor_id=vendor_id, device=device, architecture="Valhall")) == "valhall"


def test_a_gpu_without_its_own_tuned_profile_gets_one_tuned_on_its_architecture():
    """An H200 (no profile tuned for it shipped) gets the H100's (same vendor, Hopper) rather than
    the nvidia family's; an A100 and a GPU of no known architecture get the family's; a profile
    tuned for the H200 itself (a build's, or shipped) wins over its kin; tuned=False and "family"
    still give the family's; the same rule for another vendor's tuned profiles."""
    h100 = next(p for p in shipped_profiles() if p.name == "tuned-nvidia-h100-80gb-hbm3")
    assert h100.architecture == "hopper" and h100.measurements
    h200 = caps(vendor_id=4318, device="NVIDIA H200", adapter_type="DiscreteGPU")
    assert auto_profile(h200).name == "tuned-nvidia-h100-80gb-hbm3"
    assert auto_profile(h200, tuned=False).name == resolve_profile("family", h200).name == "nvidia"
    for other in ("NVIDIA A100-SXM4-80GB", "NVIDIA Some Future GPU"):
        assert auto_profile(caps(vendor_id=4318, device=other, adapter_type="DiscreteGPU")).name == "nvidia", other
    not_nvidia = caps(vendor_id=4098, device="AMD Instinct MI300X", adapter_type="DiscreteGPU")
    assert auto_profile(not_nvidia).name == "amd"  # a Hopper profile is not kin to an AMD GPU

    own = parse_profile(doc(name="tuned-nvidia-h200", priority=100, measurements=[{"op": "linear"}],
                            architecture="hopper", match={"vendor_id": [4318], "device": r"^NVIDIA\ H200$"}))
    assert auto_profile(h200, extra=[own]).name == "tuned-nvidia-h200"
    gh200 = caps(vendor_id=4318, device="NVIDIA GH200 480GB", adapter_type="DiscreteGPU")
    assert auto_profile(gh200, extra=[own]).name == "tuned-nvidia-h200"  # a build's kin wins a tie
    assert parse_profile(own.to_json()).architecture == "hopper"  # round trip

    rdna = parse_profile(doc(name="tuned-rx-7900-xtx", priority=100, measurements=[{"op": "linear"}],
                             architecture="rdna-3", match={"vendor_id": [4098], "device": r"^AMD Radeon RX 7900 XTX$"}))
    assert auto_profile(caps(vendor_id=4098, device="AMD Radeon RX 7800 XT"), extra=[rdna]).name == "tuned-rx-7900-xtx"
    assert auto_profile(caps(vendor_id=4098, device="AMD Radeon RX 6800"), extra=[rdna]).name == "amd"
    with pytest.raises(ProfileError, match="architecture"):
        parse_profile(doc(name="x", architecture=7))


@pytest.mark.gpu
def test_the_tuner_times_a_product_with_what_its_caller_does_after_it(tiny_model_dir, gpu):
    """The UNet's FF1 is recorded with its GEGLU and the attention output with its residual
    (Ops.calls' epilogue), and the tuner calls each candidate as a pipeline would: the GEMM core
    with GEGLU (or the residual) in its epilogue, the reference product with the GEGLU (or add)
    kernel after it. Both give numpy's GEGLU and residual sum of fresh random inputs (f32, within
    1e-4 relative)."""
    from engine.explain import distinct_calls, random_like
    from engine.gpu import GpuContext
    from engine.kernels import PipelineCache, variants
    from engine.models.config import load_model_config
    from engine.ops import Ops
    from engine.tune import _as_called

    calls = distinct_calls(load_model_config(tiny_model_dir), gpu.caps, "f32", 64, 64)
    ff1 = [c for c in calls if c[0] == "linear" and c[4].get("geglu")]
    residual = [c for c in calls if c[0] == "linear" and "residual" in c[4]]
    assert ff1 and residual
    assert variants("linear")["gemm"].launch.fuses_geglu({}, ff1[0][1]["n"], ff1[0][1]["k"])  # the fused path runs
    rt, rng = GpuContext(gpu), np.random.default_rng(11)
    pipelines = PipelineCache(gpu)
    for op, shape, args, scale, after in (ff1[0], residual[0]):
        x, w, b = random_like(rt, args, rng)
        done_after = {k: random_like(rt, (v,), rng)[0] if k == "residual" else v for k, v in after.items()}
        xs, ws, bs = (rt.read(t).astype(np.float64) for t in (x, w, b))
        y = xs.reshape(-1, ws.shape[1]) @ ws.T + bs
        if after.get("geglu"):
            import math

            erf = np.vectorize(math.erf)
            value, gate = np.split(y, 2, axis=-1)
            want = value * 0.5 * gate * (1 + erf(gate / np.sqrt(2)))
        else:
            want = y + rt.read(done_after["residual"]).reshape(y.shape)
        ops = Ops(rt, pipelines, Selection(frozenset(gpu.caps.features)), "f32", scratch_scale=scale)
        for name in ("reference", "gemm"):
            v = variants("linear")[name]
            got = rt.read(_as_called(op, shape, v, {}, ops, (x, w, b), done_after)()).reshape(want.shape)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4, (name, after)


@pytest.mark.gpu
def test_the_tuner_times_a_convolution_with_the_shortcut_its_caller_adds(tiny_model_dir, gpu):
    """A ResNet block's last convolution is recorded with the shortcut sum (Ops.calls'
    epilogue: the 1x1 shortcut convolution's, in a block that has one), and the tuner calls each
    candidate as a pipeline would: the GEMM core's 1x1 variant adds it in its epilogue, the
    reference by an add kernel after it. Both give numpy's convolution plus the residual on
    fresh random inputs (f32, within 1e-4 relative)."""
    from engine.explain import distinct_calls, random_like
    from engine.gpu import GpuContext
    from engine.kernels import PipelineCache, variants
    from engine.models.config import load_model_config
    from engine.ops import Ops
    from engine.tune import _as_called

    calls = distinct_calls(load_model_config(tiny_model_dir), gpu.caps, "f32", 64, 64)
    summed = [c for c in calls if c[0] == "conv2d" and "residual" in c[4] and c[1]["k"] == 1 and c[1]["cin"] % 4 == 0]
    assert summed, "no 1x1 convolution recorded with a residual"
    op, shape, args, scale, after = summed[0]
    rt, rng = GpuContext(gpu), np.random.default_rng(12)
    x, w, b = random_like(rt, args[:3], rng)
    stride, pads = args[3], args[4]
    r = random_like(rt, (after["residual"],), rng)[0]
    xs, ws, bs, rs = (rt.read(t).astype(np.float64) for t in (x, w, b, r))
    want = np.einsum("bchw,oc->bohw", xs, ws[:, :, 0, 0]) + bs[None, :, None, None] + rs
    ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f32", scratch_scale=scale)
    for name in ("reference", "pointwise"):
        v = variants("conv2d")[name]
        got = rt.read(_as_called(op, shape, v, {}, ops, (x, w, b, stride, pads), {"residual": r})())
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4, name


def test_interleaved_rounds_drop_a_slow_spell_and_rotate_the_order(monkeypatch):
    """Three candidates, five rounds: each round runs every candidate once in an order rotated
    by one, so no candidate is always first; a round whose control (index 0) took 3x its median
    (a slow spell) is dropped, its samples with it; a spell over most rounds drops nothing."""
    from engine import tune

    order, script = [], iter([])

    class Rt:
        def sync(self):
            pass

    def fake_time(rt, fn, warmup, repeats):
        order.append(fn.__name__)
        return [next(script)]

    monkeypatch.setattr(tune, "time_gpu_work", fake_time)

    def named(name):
        def fn():
            pass
        fn.__name__ = name
        return fn

    fns = [named("ref"), named("a"), named("b")]
    rounds = [[1.0, 2.0, 3.0], [1.1, 2.1, 3.1], [3.0, 6.0, 9.0], [1.0, 2.0, 3.0], [0.9, 1.9, 2.9]]
    script = iter([row[(j + r) % 3] for r, row in enumerate(rounds) for j in range(3)])
    samples, dropped = tune.interleaved(Rt(), fns, 0, 5, control=0)
    assert dropped == 1 and samples == [[1.0, 1.1, 1.0, 0.9], [2.0, 2.1, 2.0, 1.9], [3.0, 3.1, 3.0, 2.9]]
    assert order[:6] == ["ref", "a", "b", "a", "b", "ref"]  # the second round starts one later
    order.clear()
    slow = [[1.0, 2, 3], [5.0, 2, 3], [5.0, 2, 3], [5.0, 2, 3], [1.0, 2, 3]]
    script = iter([row[(j + r) % 3] for r, row in enumerate(slow) for j in range(3)])
    samples, dropped = tune.interleaved(Rt(), fns, 0, 5, control=0)
    assert dropped == 0 and samples[0] == [1.0, 5.0, 5.0, 5.0, 1.0]  # no calm majority: every round kept


def test_a_tune_cut_short_by_its_time_budget_keeps_the_base_profiles_rules_for_those_shapes():
    """engine_ablation's --merge-into: the ops not tuned come from the base profile, and so does
    every shape the tune could time only with the reference kernel (out of time), instead of
    falling back to the reference kernel in the profile it ships."""
    from engine.tune import merge_tune

    def meas(op, shape, *variants):
        return {"op": op, "shape": shape, "results": [{"variant": v, "constants": {}, "median_ms": 1.0}
                                                      for v in variants], "chosen": variants[0]}

    a, b, c = {"m": 1, "n": 8, "k": 8}, {"m": 2, "n": 8, "k": 8}, {"tq": 4, "tk": 4, "dh": 8, "heads": 1, "b": 1, "causal": 0}
    base = {"name": "tuned-h100", "rules": [{"op": "linear", "variant": "tiled", "when": a},
                                            {"op": "linear", "variant": "gemm", "when": b},
                                            {"op": "attention", "variant": "flash_packed", "when": c}],
            "measurements": [meas("linear", a, "tiled"), meas("linear", b, "gemm"), meas("attention", c, "flash_packed")]}
    doc = {"name": "tuned-h200", "description": "measured", "rules": [{"op": "linear", "variant": "gemm", "when": a}],
           "measurements": [meas("linear", a, "gemm", "reference"), meas("linear", b, "reference")]}
    merge_tune(doc, base, {"linear"})
    assert doc["rules"] == [{"op": "linear", "variant": "gemm", "when": a},  # tuned: its own verdict
                            {"op": "linear", "variant": "gemm", "when": b},  # cut short: the base's
                            {"op": "attention", "variant": "flash_packed", "when": c}]  # not tuned
    assert [(m["op"], m["chosen"]) for m in doc["measurements"]] == [("linear", "gemm"), ("linear", "gemm"),
                                                                      ("attention", "flash_packed")]
    assert "1 shape the time budget cut short keeps tuned-h100's rules" in doc["description"]


def test_merging_a_tune_of_one_network_in_another_element_type_keeps_the_rest_of_the_base():
    """A tune of the VAE decoder in f16 (its rules and measurements name the type) merged into a
    profile whose VAE rules were tuned in f32: the f16 rule comes first and holds for f16; base's
    f32 rule of the same shape and its UNet rules of the same op stay."""
    from engine.tune import merge_tune

    def meas(op, shape, variant, **extra):
        return {"op": op, "shape": shape, **extra, "chosen": variant,
                "results": [{"variant": variant, "constants": {}, "median_ms": 1.0}]}

    vae = {"cin": 128, "cout": 128, "h": 512, "w": 512, "k": 3, "stride": 1, "b": 1, "tiles": 16384}
    unet = {**vae, "h": 64, "w": 64, "b": 2, "tiles": 256, "cin": 320, "cout": 320}
    base = {"name": "tuned-h100",
            "rules": [{"op": "conv2d", "variant": "winograd_2x2", "when": vae, "constants": {"TILE_K": 8}},
                      {"op": "conv2d", "variant": "winograd", "when": unet}],
            "measurements": [meas("conv2d", vae, "winograd_2x2"), meas("conv2d", unet, "winograd")]}
    tuned = {"name": "tuned-h100", "description": "measured",
           "rules": [{"op": "conv2d", "variant": "im2col", "when": {**vae, "dtype": "f16"}}],
           "measurements": [meas("conv2d", vae, "im2col", dtype="f16")]}
    merge_tune(tuned, base, {"conv2d"})
    assert [(r["variant"], r["when"].get("dtype")) for r in tuned["rules"]] == [
        ("im2col", "f16"), ("winograd_2x2", None), ("winograd", None)]
    assert [(m["chosen"], m.get("dtype")) for m in tuned["measurements"]] == [
        ("im2col", "f16"), ("winograd_2x2", None), ("winograd", None)]
    sel = parse_profile(doc(rules=tuned["rules"])).selection(caps())
    assert sel.choose("conv2d", vae, "f16")[0].name == "im2col"
    assert sel.choose("conv2d", vae, "f32") == (REGISTRY["conv2d"]["winograd_2x2"], {"TILE_K": 8})


def test_a_tune_of_the_vae_in_another_element_type_names_it(tiny_model_dir, tmp_path, gpu):
    """tune(networks={"vae_decoder"}, vae_dtype=...) times the decoder's calls alone, in that
    type, and every rule and measurement it writes names the type."""
    from engine.models.config import load_model_config
    from engine.tune import tune

    doc = tune(load_model_config(tiny_model_dir), gpu, "f32", 64, 64, tmp_path / "t.json", warmup=0, repeats=1,
               ops={"group_norm"}, networks={"vae_decoder"}, vae_dtype="f16s")
    assert doc["measurements"] and {m["dtype"] for m in doc["measurements"]} == {"f16s"}
    assert all(m["shape"]["b"] == 1 for m in doc["measurements"])  # the decoder runs one image, the UNet two
    assert all(r["when"]["dtype"] == "f16s" for r in doc["rules"])
    # a rule for every shape, naming its winner, the reference too (where its defaults won, the
    # rule is what keeps a profile's rule for that shape in every type from serving it)
    best = [min(m["results"], key=lambda r: r["median_ms"]) for m in doc["measurements"]]
    assert [(r["variant"], r.get("constants", {})) for r in doc["rules"]] == [(b["variant"], b["constants"]) for b in best]


def test_a_typed_tune_writes_no_rule_for_an_op_of_one_kernel(tiny_model_dir, tmp_path, gpu):
    """An f16-storage tune names its type in every rule, the reference kernel's too, except for
    ops with no other kernel (activation, geglu): no selection asks for those, and a shipped rule
    for them was one no page could be shown to follow (test_browser's shipped choices)."""
    from engine.models.config import load_model_config
    from engine.tune import tune

    doc = tune(load_model_config(tiny_model_dir), gpu, "f16s", 64, 64, tmp_path / "t.json", warmup=0, repeats=1,
               ops={"activation", "geglu"}, networks={"unet"})
    assert {m["op"] for m in doc["measurements"]} == {"activation", "geglu"}
    assert all(m["dtype"] == "f16s" and len(REGISTRY[m["op"]]) == 1 for m in doc["measurements"])
    assert doc["rules"] == []


def test_the_timer_quantum_of_a_tunes_measurements(fresh_rng):
    """The step every sample shares: Dawn's 65,536 ns where its quantization is on, none for a
    timer of nanoseconds (or the wall clock)."""
    from engine.tune import QUANTIZED_NS, timer_quantum_ns

    def measured(samples_ms):
        return [{"results": [{"min_ms": a, "max_ms": b}]} for a, b in samples_ms]

    steps = fresh_rng.integers(1, 60, (20, 2))
    assert timer_quantum_ns(measured(steps * 0.065536)) == 65536 * int(np.gcd.reduce(steps.ravel()))
    assert timer_quantum_ns(measured(fresh_rng.uniform(0.001, 3.0, (20, 2)))) < QUANTIZED_NS
    assert timer_quantum_ns(measured([(0.05, 0.05), (0.1, 0.1)])) == 1  # two readings: no verdict


def test_a_tune_read_from_a_quantized_timer_says_so(tiny_model_dir, tmp_path, gpu, monkeypatch):
    """A tune whose GPU times all come in 65.536 us steps (Dawn's default) warns and writes the
    step into the profile's description; one on this adapter's own timer does neither."""
    import warnings

    import engine.tune as tuning
    from engine.models.config import load_model_config

    config = load_model_config(tiny_model_dir)
    kw = {"warmup": 0, "repeats": 2, "ops": {"layer_norm"}, "networks": {"unet"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", tuning.TimerQuantizedWarning)
        doc = tuning.tune(config, gpu, "f32", 64, 64, tmp_path / "real.json", **kw)
    assert "quantized" not in doc["description"] and "steps of" not in doc["description"]

    ticks = iter(range(1, 10_000))

    def quantized(rt, fn, warmup, repeats):
        fn()
        return [next(ticks) * 0.065536 for _ in range(repeats)]

    monkeypatch.setattr(tuning, "time_gpu_work", quantized)
    with pytest.warns(tuning.TimerQuantizedWarning, match="65.536 us"):
        doc = tuning.tune(config, gpu, "f32", 64, 64, tmp_path / "coarse.json", **kw)
    assert "steps of 65.536 us" in doc["description"]
    assert json.loads((tmp_path / "coarse.json").read_text())["description"] == doc["description"]


def test_no_shipped_rule_chooses_among_one_kernel():
    """Every shipped rule picks a kernel of an op that has another, or sets constants."""
    for prof in shipped_profiles():
        idle = [(r.op, r.variant) for r in prof.rules if len(REGISTRY[r.op]) == 1 and not r.constants]
        assert not idle, (prof.name, idle)


def test_a_shape_filter_naming_nothing_the_tune_could_time_is_refused_before_any_timing(tiny_model_dir, tmp_path,
                                                                                      gpu):
    """tune(where=...) refuses a field no op tuned has, or a filter no call matches, by name and
    before it times anything. What a filter does measure (the convolutions to at most 4
    channels) is test_cli_engine_profiles.py's `test_tune_part_of_a_model_into_a_profile`."""
    from engine.models.config import load_model_config
    from engine.tune import tune

    config = load_model_config(tiny_model_dir)
    with pytest.raises(EngineError, match="'tq' is not a shape field of conv2d"):
        tune(config, gpu, "f32", 64, 64, tmp_path / "u.json", ops={"conv2d"}, where={"tq": 4})
    with pytest.raises(EngineError, match="no call of the model"):
        tune(config, gpu, "f32", 64, 64, tmp_path / "u.json", ops={"conv2d"}, where={"cout": {"min": 100000}})
    with pytest.raises(EngineError, match="neither an integer nor a range"):
        tune(config, gpu, "f32", 64, 64, tmp_path / "u.json", ops={"conv2d"}, where={"cout": {"below": 4}})


def test_a_composed_variant_is_tuned_with_the_kernels_this_adapters_profile_chooses(tiny_model_dir, tmp_path, gpu,
                                                                                    monkeypatch):
    """linear_nchw's reference (a linear, a transpose and an add) is timed running the linear
    this adapter's own profile picks, not the linear's reference kernel; its rivals run as tuned."""
    from engine import tune as tuner
    from engine.models.config import load_model_config

    made = []

    class Recording(tuner.Ops):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    forced = parse_profile(doc(rules=[{"op": "linear", "variant": "tiled"}]))
    monkeypatch.setattr(tuner, "Ops", Recording)
    monkeypatch.setattr(tuner, "auto_profile", lambda caps: forced)
    tuner.tune(load_model_config(tiny_model_dir), gpu, "f32", 64, 64, tmp_path / "t.json", warmup=0, repeats=1,
               ops={"linear_nchw"}, networks={"unet"})
    composed = [o for o in made if o.selection.profile_name == forced.name]
    assert composed and all(d.variant == "tiled" for o in composed for d in o.selection.decisions.values()
                            if d.op == "linear")
    assert any(d.op == "linear" for o in composed for d in o.selection.decisions.values())
    assert all(o.selection.profile_name == "reference" for o in made if o not in composed)


def test_the_tuner_keeps_what_a_setting_derives_across_its_timed_calls(gpu, fresh_rng, monkeypatch):
    """A convolution timed with the shortcut its caller adds (the ResNet's conv2) goes through an
    Ops of its own: it keeps the candidate's Prepared, so PRETRANSFORM's filters are made by the
    first call alone, as in a generation."""
    from engine.gpu import GpuContext
    from engine.kernels import PipelineCache
    from engine.ops import Ops, Prepared
    from engine.tune import _as_called

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    rt = GpuContext(gpu)
    ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f16")
    ops.prepared = Prepared()
    x, w = fresh_rng.standard_normal((2, 16, 8, 8)), fresh_rng.standard_normal((16, 16, 3, 3)) / 12
    args = (rt.upload(x, "f16"), rt.upload(w, "f16"), rt.upload(np.zeros(16), "f16"), 1, (1, 1, 1, 1))
    shape = {"cin": 16, "cout": 16, "h": 8, "w": 8, "k": 3, "stride": 1, "b": 2, "tiles": 4}
    labels = []
    plain = rt.dispatch
    monkeypatch.setattr(rt, "dispatch", lambda p, label, *a: labels.append(label) or plain(p, label, *a))
    fn = _as_called("conv2d", shape, REGISTRY["conv2d"]["winograd_2x2"], {"PRETRANSFORM": 1}, ops, args,
                    {"residual": rt.upload(x, "f16")})
    fn(), fn(), fn()
    rt.sync()
    assert labels.count("conv2d_winograd_filter") == 1 and labels.count("conv2d_winograd_output") == 3


def test_a_rule_may_hold_for_one_element_type_only():
    """A rule naming "dtype" holds for calls in that element type only (an f16 tune's rules can
    then differ from f16-storage's or an f32 VAE's on the same shape); rules naming none hold
    for every type, and the decisions of one shape in two types are kept apart."""
    shape = {"tq": 64, "tk": 64, "dh": 40, "heads": 2, "b": 1, "causal": 0}
    profile = parse_profile(doc(rules=[
        {"op": "attention", "variant": "flash_packed", "when": {"dh": 40, "dtype": "f16"}, "constants": {"KPI": 8}},
        {"op": "attention", "variant": "flash_gemm", "when": {"dh": 40}},
    ]))
    assert parse_profile(profile.to_json()).rules == profile.rules  # round trip
    sel = profile.selection(caps())
    assert sel.choose("attention", shape, "f16") == (REGISTRY["attention"]["flash_packed"], {"KPI": 8})
    assert sel.choose("attention", shape, "f16s")[0].name == "flash_gemm"
    assert sel.choose("attention", shape, "f32")[0].name == "flash_gemm"
    assert sel.choose("attention", shape)[0].name == "flash_gemm"  # a caller naming no type
    assert sorted((d.dtype or "", d.variant) for d in sel.decisions.values()) == [
        ("", "flash_gemm"), ("f16", "flash_packed"), ("f16s", "flash_gemm"), ("f32", "flash_gemm")]


@pytest.mark.gpu
def test_ops_choose_by_their_own_element_type(gpu, fresh_rng):
    """Ops ask the selection with the type they run in: one Selection serving an f16 UNet and an
    f32 VAE (as a pipeline's does) gives each its own rule."""
    from engine.gpu import GpuContext
    from engine.kernels import PipelineCache
    from engine.ops import Ops

    profile = parse_profile(doc(rules=[{"op": "linear", "variant": "tiled", "when": {"dtype": "f32"}}]))
    sel = profile.selection(gpu.caps)
    rt = GpuContext(gpu)
    for dtype in ("f32", "f16s"):
        ops = Ops(rt, PipelineCache(gpu), sel, dtype)
        x, w = (rt.upload(fresh_rng.standard_normal(s).astype(np.float32), dtype) for s in ((3, 8), (4, 8)))
        ops.linear(x, w)
    assert {d.dtype: d.variant for d in sel.decisions.values() if d.op == "linear"} == {"f32": "tiled", "f16s": "reference"}


def test_the_estimated_gain_reads_rules_in_the_element_type_they_were_measured_in():
    """An f16-storage tune's rules and measurements name f16s: the estimate picks each profile's
    choice for that type (it matched no typed rule and compared the family's choice with
    itself, 1.0x)."""
    from engine.tune import estimated_gain

    shape = {"c": 64, "s": 256, "groups": 8, "b": 2}
    doc = {"schema": "devicefarm.profile/1", "name": "tuned-x", "rules": [
        {"op": "group_norm", "variant": "split", "when": {**shape, "dtype": "f16s"}}],
        "measurements": [{"op": "group_norm", "shape": shape, "dtype": "f16s", "chosen": "split", "results": [
            {"variant": "reference", "constants": {}, "median_ms": 2.0},
            {"variant": "split", "constants": {}, "median_ms": 0.5}]}]}
    family = parse_profile({"schema": "devicefarm.profile/1", "name": "family", "rules": []})
    assert estimated_gain(doc, family, caps()) == {"baseline": "family", "gain": 4.0, "calls": 1,
                                                  "calls_not_comparable": 0}

