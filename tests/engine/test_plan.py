"""Engine plans: the denoising loop as data (each scheduler's program against its own step() on
fresh random inputs), the loop's kernels against numpy, plans recorded from the tiny model and
replayed through wgpu-native bit for bit equal to Pipeline.generate and to each network's
eager call, `farm engine plan` for the tiny and sd14 presets, and the plans an executor must
refuse."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from ci_support import F16_HINT, missing
from typer.testing import CliRunner

import engine
from engine.errors import GPUError, InputError, ModelError
from engine.kernels import variants
from engine.plan import check_plan, plan_hash, record_plan
from engine.plan_exec import PlanExecutor
from engine.schedulers import SCHEDULERS, make_scheduler
from engine.schedulers.program import NotLinear, evaluate, loop_program

SD_SCHEDULER = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "skip_prk_steps": True,
                "set_alpha_to_one": False, "steps_offset": 1, "clip_sample": False}
SHAPE = (1, 4, 8, 8)


def _run_both(name: str, config: dict, steps: int, rng, strength=None):
    """The scheduler's own loop and its program's, on the same random noise predictions and
    noise draws; returns (scheduler samples, program samples) after each step."""
    program = loop_program(name, config, steps, SHAPE, strength=strength)
    sched = make_scheduler(name, config)
    timesteps = sched.img2img_timesteps(steps, strength) if strength else (sched.set_timesteps(steps) or
                                                                         sched.timesteps)
    seed = int(rng.integers(2**31))
    draws, probe_draws = np.random.default_rng(seed), np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    env = {"x0": x}
    ours, theirs = [], []
    for step, t in zip(program.steps, timesteps, strict=True):
        e = rng.standard_normal(SHAPE, dtype=np.float32)
        np.testing.assert_allclose(sched.scale_model_input(x, t), np.float32(step.input_scale) * x, rtol=1e-6)
        x = sched.step(e, t, x, draws)
        env[f"e{step.index}"] = e
        for noise in step.noise:
            env[noise] = probe_draws.standard_normal(SHAPE, dtype=np.float32)
        for op in step.ops:
            env[op.out] = evaluate(op, env)
        theirs.append(x)
        ours.append(env[f"x{step.index + 1}"])
    return theirs, ours


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("steps", [1, 4, 9])
def test_loop_program_matches_the_schedulers_step(name, steps, fresh_rng):
    theirs, ours = _run_both(name, SD_SCHEDULER, steps, fresh_rng)
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        # float32 coefficients folded from float64: a few ulps from numpy's own rounding order
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()), err_msg=f"step {i}")


def test_ddim_clip_sample_becomes_a_clamped_combination(fresh_rng):
    config = SD_SCHEDULER | {"clip_sample": True, "clip_sample_range": 0.5}
    program = loop_program("ddim", config, 3, SHAPE)
    assert [op.clamp for op in program.steps[0].ops] == [(-0.5, 0.5), None]
    theirs, ours = _run_both("ddim", config, 3, fresh_rng)
    np.testing.assert_allclose(ours[-1], theirs[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_img2img_loop_program(name, fresh_rng):
    theirs, ours = _run_both(name, SD_SCHEDULER, 6, fresh_rng, strength=0.5)
    assert len(ours) == (4 if name == "pndm" else 3)  # PNDM evaluates its first timestep twice
    np.testing.assert_allclose(ours[-1], theirs[-1], rtol=1e-5, atol=1e-5 * float(np.abs(theirs[-1]).max()))


def test_a_step_that_is_not_linear_is_refused(monkeypatch):
    sched_cls = type(make_scheduler("euler", SD_SCHEDULER))

    def squaring_step(self, model_output, timestep, sample, rng=None):
        return sample + model_output * model_output

    monkeypatch.setattr(sched_cls, "step", squaring_step)
    with pytest.raises(NotLinear, match="step 0: a product of two tensors"):
        loop_program("euler", SD_SCHEDULER, 2, SHAPE)


# ---- the loop's kernels -----------------------------------------------------------------------



@pytest.fixture(scope="module")
def ops(gpu):
    from engine.gpu import GpuContext
    from engine.kernels import PipelineCache, Selection
    from engine.ops import Ops

    rt = GpuContext(gpu)
    return Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f32")


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 2, 5, 6])
def test_step_combine_against_numpy(ops, fresh_rng, count):
    arrays = [fresh_rng.standard_normal((1, 4, 9, 7), dtype=np.float32) for _ in range(count)]
    coefs = [float(np.float32(c)) for c in fresh_rng.standard_normal(count)]
    clamp = (-0.7, 0.9) if count == 5 else None
    out = ops.rt.read(ops.step_combine([(c, ops.rt.upload(a)) for c, a in zip(coefs, arrays, strict=True)], clamp))
    want = sum(np.float64(c) * a.astype(np.float64) for c, a in zip(coefs, arrays, strict=True))
    if clamp:
        want = np.clip(want, *clamp)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_step_guide_and_prepare_against_numpy(ops, fresh_rng):
    eps = fresh_rng.standard_normal((2, 4, 6, 6), dtype=np.float32)
    g = 7.5
    out = ops.rt.read(ops.step_guide(ops.rt.upload(eps), g))
    np.testing.assert_allclose(out, eps[:1] + g * (eps[1:] - eps[:1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ops.rt.read(ops.step_guide(ops.rt.upload(eps[:1]), None)), eps[:1])
    x = fresh_rng.standard_normal((1, 4, 6, 6), dtype=np.float32)
    y = ops.rt.read(ops.step_prepare(ops.rt.upload(x), 0.25, 2))
    np.testing.assert_allclose(y, np.concatenate([x, x]) * np.float32(0.25), rtol=1e-6)
    with pytest.raises(ValueError, match="1 to 6 are supported"):
        ops.step_combine([(1.0, ops.rt.upload(x))] * 7)


# ---- plans recorded and replayed ----------------------------------------------------------------


@pytest.fixture(scope="module")
def native(tiny_model_dir, gpu):
    return engine.load_pipeline(tiny_model_dir, precision="fp32")


@pytest.fixture(scope="module")
def planned(tiny_model_dir, gpu):
    return engine.load_pipeline(tiny_model_dir, precision="fp32", executor="plan")


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_replayed_plan_equals_generate_bit_for_bit(native, planned, scheduler):
    kwargs = {"steps": 3, "seed": 11, "height": 64, "width": 64, "scheduler": scheduler}
    a = native.generate("a red bicycle", negative_prompt="blurry", **kwargs)
    b = planned.generate("a red bicycle", negative_prompt="blurry", **kwargs)
    np.testing.assert_array_equal(b.latents, a.latents)
    np.testing.assert_array_equal(b.image, a.image)
    assert not any("inf or NaN" in w for w in a.warnings + b.warnings)
    assert set(b.timings) >= {"text_encoder_ms", "unet_step_ms", "vae_decode_ms", "total_ms"}
    # the denoising loop ran back to back and was timed whole: its steps are the UNet runs
    ex = planned.plan_executor(64, 64, 3, scheduler)
    runs = sum(1 for c in ex.plan["generate"] if c["op"] == "run" and c["stage"] == "unet_step")
    assert ex.loop_steps == runs >= 3
    t = b.timings
    assert 0 < t["unet_total_ms"] < t["total_ms"]
    assert t["unet_step_ms"] == pytest.approx(t["unet_total_ms"] / runs)
    assert t["text_encoder_ms"] + t["unet_total_ms"] + t["vae_decode_ms"] <= t["total_ms"]


@pytest.mark.gpu
def test_a_generation_whose_values_went_non_finite_says_so(native, planned):
    """Latents with a NaN (as an overflowed activation leaves them) give an image that is not the
    model's: each executor's result says so, naming the latents (an ordinary generation does not:
    test_a_replayed_plan_equals_generate_bit_for_bit)."""
    kwargs = {"steps": 3, "seed": 11, "height": 64, "width": 64, "scheduler": "euler"}  # the plan above's
    latents = np.zeros((1, 4, 8, 8), np.float32)
    latents[0, 0, 0, 0] = np.nan
    for pipe in (native, planned):
        said = [w for w in pipe.generate("a dog", latents=latents, **kwargs).warnings if "inf or NaN" in w]
        assert len(said) == 1 and said[0].startswith("the generated latents hold 256 inf or NaN values of 256"), said


@pytest.mark.gpu
def test_a_plan_whose_vae_in_halves_overflows_decodes_again_in_f32(tiny_model_dir, gpu, tmp_path):
    """A decoder in halves whose image comes back with an inf or NaN decodes the plan's final
    latents again in f32, as the native pipeline does (test_pipeline.py): the generation says
    so, and its image is the one a plan with an f32 decoder makes of the same latents. A VAE
    scaling factor of 1/30,000 puts the decoder's activations past f16's 65,504."""
    from engine.models.config import load_model_config

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "vae" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "scaling_factor": 1 / 30000}))
    half = engine.load_pipeline(model, precision="fp16", executor="plan")
    kwargs = {"steps": 2, "seed": 3, "height": 64, "width": 64, "scheduler": "euler"}
    a = half.generate("a dog", **kwargs)
    assert [p["vae_dtype"] for p in half.plans.values()] == ["f16"]
    note = "the VAE decoder overflowed f16 (inf or NaN in its image): decoded again in f32"
    assert note in a.warnings and not any("inf or NaN values" in w for w in a.warnings), a.warnings
    assert half.decode_notes == [note]
    f32_plan = record_plan(load_model_config(model), gpu.caps, model_dir=model, precision="fp16", height=64,
                           width=64, steps=2, scheduler="euler", vae_dtype="f32")
    want = PlanExecutor(f32_plan, model, gpu).run("vae_decode", {"latents": a.latents})["image"]
    assert np.isfinite(want).all()
    assert np.abs(a.image.astype(int) - engine.pipeline.image_from_decoded(want)).max() <= 1
    # without the fallback the plan's own image is not finite: what made the decode run again
    plain = half.plan_executor(64, 64, 2, "euler").run("vae_decode", {"latents": a.latents})["image"]
    assert not np.isfinite(plain).all()
    assert np.isfinite(half.decode(a.latents)).all() and half.decode_notes == [note]
    # staged, the executor gives back what its stages hold before the f32 decode, and the next
    # generation uploads them again
    staged = engine.load_pipeline(model, precision="fp16", executor="plan", residency="staged")
    ex = staged.plan_executor(64, 64, 2, "euler")
    held = ex.live_bytes  # the plan's persistent buffers alone
    for _ in range(2):
        b = staged.generate("a dog", **kwargs)
        np.testing.assert_array_equal(b.image, a.image)
        assert note in b.warnings and ex.residency == "staged" and ex.live_bytes == held < ex.peak_bytes


@pytest.mark.gpu
def test_an_f16_storage_plan_equals_generate_and_holds_what_fit_says(tiny_model_dir, gpu):
    """Packed halves on the plan executor: the same image as the native f16-storage run, to the
    bit, and the executor's high-water mark is fit's number, resident and within a budget that
    only staging meets."""
    from engine.fit import fit_plan

    eager = engine.load_pipeline(tiny_model_dir, precision="f16-storage")
    kwargs = {"steps": 2, "seed": 5, "height": 64, "width": 64, "scheduler": "euler"}
    a = eager.generate("a red bicycle", **kwargs)
    planned16 = engine.load_pipeline(tiny_model_dir, precision="f16-storage", executor="plan")
    b = planned16.generate("a red bicycle", **kwargs)
    np.testing.assert_array_equal(b.image, a.image)
    plan = planned16.plans[(64, 64, 2, "euler", 7.5, None)]
    fit = fit_plan(plan, gpu.caps)
    assert plan["dtype"] == "f16s" and b.peak_gpu_bytes == fit.peak_gpu_bytes == fit.resident_gpu_bytes
    tight = engine.load_pipeline(tiny_model_dir, precision="f16-storage", executor="plan",
                                 budget_bytes=fit.resident_gpu_bytes - 1)
    c = tight.generate("a red bicycle", **kwargs)
    np.testing.assert_array_equal(c.image, a.image)
    assert tight.residency == "staged" and c.peak_gpu_bytes == fit.staged_gpu_bytes < fit.resident_gpu_bytes


@pytest.mark.gpu
def test_filters_kept_once_a_generation_are_made_in_the_context_stage(tiny_model_dir, gpu, monkeypatch):
    """A profile that keeps Winograd's transformed filters (winograd_2x2, PRETRANSFORM 1): the
    plan makes them in unet_context, once a generation, and its replayed step runs no filter
    kernel; the image is the eager engine's to the bit, resident and staged (where the
    convolutions' weights go up for the context stage and the kept filters stay for the loop)."""
    from engine.fit import fit_plan, plan_memory
    from engine.models.config import load_model_config
    from engine.plan import record_plan_within
    from engine.profiles import SCHEMA_ID

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    doc = {"schema": SCHEMA_ID, "name": "test-pretransform", "rules": [
        {"op": "conv2d", "variant": "winograd_2x2", "when": {"k": 3, "stride": 1}, "constants": {"PRETRANSFORM": 1}}]}
    kwargs = {"steps": 2, "seed": 5, "height": 64, "width": 64, "scheduler": "euler"}
    eager = engine.load_pipeline(tiny_model_dir, precision="fp16", profile=doc)
    a = eager.generate("a red bicycle", **kwargs)
    planned16 = engine.load_pipeline(tiny_model_dir, precision="fp16", executor="plan", profile=doc)
    b = planned16.generate("a red bicycle", **kwargs)
    np.testing.assert_array_equal(b.image, a.image)
    plan = planned16.plans[(64, 64, 2, "euler", 7.5, None)]

    def filters(stage: str) -> int:
        return sum(c.get("label") == "conv2d_winograd_filter" for c in plan["stages"][stage]["commands"])

    kept = sum(d["variant"] == "winograd_2x2" and d["constants"].get("PRETRANSFORM") == 1
               for d in plan["profile"]["decisions"] if d["op"] == "conv2d" and d.get("dtype") != "f32")
    assert kept and filters("unet_step") == 0 and filters("unet_context") >= kept
    fit = fit_plan(plan, gpu.caps)
    tight = engine.load_pipeline(tiny_model_dir, precision="fp16", executor="plan", profile=doc,
                                 budget_bytes=fit.resident_gpu_bytes - 1)
    c = tight.generate("a red bicycle", **kwargs)
    assert tight.residency == "staged"
    np.testing.assert_array_equal(c.image, a.image)
    # a budget the kept filters do not fit, resident, and making them at every step does: the
    # plan makes them at every step, and says so. (The tiny model's weights are small beside
    # the 16 MiB scratch every step's filters take: smaller scratch here, as SD 1.4's 1 GB of
    # kept filters is beside it.)
    from engine.variants import conv2d

    monkeypatch.setattr(conv2d, "WINOGRAD_CORE_FILTER_BYTES", 1 << 16)
    config = load_model_config(tiny_model_dir)
    args = {"model_dir": tiny_model_dir, "precision": "fp16", "height": 64, "width": 64, "steps": 2,
            "scheduler": "euler", "profile": doc}
    kept_plan = record_plan(config, gpu.caps, **args)
    lean = plan_memory(record_plan(config, gpu.caps, keep_derived=False, **args)).resident_bytes
    assert lean < plan_memory(kept_plan).resident_bytes
    fitted = record_plan_within(config, gpu.caps, lean, "resident", **args)
    steps = fitted["stages"]["unet_step"]["commands"]
    assert sum(c.get("label") == "conv2d_winograd_filter" for c in steps) >= kept
    assert plan_memory(fitted).resident_bytes == lean
    assert any("made at every step" in w for w in fitted["warnings"])
    assert record_plan_within(config, gpu.caps, None, "resident", **args)["sha256"] == kept_plan["sha256"]
    # staged residency, the one kept within a budget, keeps nothing derived: plans and pipelines
    staged_plan = record_plan_within(config, gpu.caps, None, "staged", **args)
    assert sum(c.get("label") == "conv2d_winograd_filter" for c in staged_plan["stages"]["unet_step"]["commands"]) \
        >= kept
    staged_eager = engine.load_pipeline(tiny_model_dir, precision="fp16", profile=doc, residency="staged")
    for pipe, keeps in ((staged_eager, False), (eager, True)):
        with pipe.weights_on_gpu("unet", "unet_context"):
            ctx = pipe.rt.upload(np.zeros((2, 77, pipe.config.unet.cross_attention_dim), np.float32), pipe.dtype)
            assert (pipe.context_kv(ctx).prepared is not None) == keeps


@pytest.mark.gpu
def test_a_plan_without_guidance_equals_generate(native, planned, fresh_rng):
    latents = fresh_rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
    kwargs = {"steps": 2, "guidance_scale": 1.0, "height": 64, "width": 64, "scheduler": "ddim", "latents": latents}
    a, b = native.generate("a cat", **kwargs), planned.generate("a cat", **kwargs)
    assert planned.plan_executor(64, 64, 2, "ddim", 1.0).plan["batch"] == 1
    np.testing.assert_array_equal(b.latents, a.latents)


@pytest.mark.gpu
def test_plan_stages_equal_the_eager_networks(native, planned, fresh_rng):
    ids = native.tokenize(["", "a small house"])
    ctx = native.encode_text(ids)
    np.testing.assert_array_equal(planned.encode_text(ids), ctx)
    sample = fresh_rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(planned.unet(sample, 501, ctx), native.unet(sample, 501, ctx))
    z = fresh_rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
    np.testing.assert_array_equal(planned.decode(z), native.decode(z))


@pytest.fixture(scope="module")
def tiny_plan(tiny_model_dir, gpu):
    from engine.models.config import load_model_config

    return record_plan(load_model_config(tiny_model_dir), gpu.caps, model_dir=tiny_model_dir, height=64, width=64,
                       steps=2, scheduler="euler")


@pytest.mark.gpu
def test_plan_describes_itself(tiny_plan, tiny_model_dir):
    plan = tiny_plan
    assert plan["format"] == "devicefarm-engine-plan" and plan["schema"] == 1
    assert plan["sha256"] == plan_hash(plan)
    weights = [b for b in plan["buffers"] if b["kind"] == "weight"]
    assert weights and all(b["file"].endswith(".safetensors") and len(b["sha256"]) == 64 for b in weights)
    assert {"text_encoder", "unet_context", "unet_step", "vae_decode"} == set(plan["stages"])
    # the context's cross-attention keys and values are projected once, before the loop
    runs = [c["stage"] for c in plan["generate"] if c["op"] == "run"]
    assert runs[:2] == ["text_encoder", "unet_context"] and runs.count("unet_context") == 1
    # the denoising loop is unrolled: two steps, each running the UNet stage once
    assert sum(c["op"] == "run" and c["stage"] == "unet_step" for c in plan["generate"]) == 2
    assert plan["requires"]["limits"]["maxStorageBuffersPerShaderStage"] <= 8
    for p in plan["pipelines"]:
        assert p["shader"] in plan["shaders"]


@pytest.mark.gpu
def test_executors_refuse_what_they_cannot_run(tiny_plan, tiny_model_dir, gpu, tmp_path):
    altered = json.loads(json.dumps(tiny_plan))
    altered["steps"] = 3
    with pytest.raises(InputError, match="does not match its sha256"):
        check_plan(altered)
    newer = json.loads(json.dumps(tiny_plan)) | {"schema": 2}
    newer["sha256"] = plan_hash(newer)
    with pytest.raises(InputError, match="plan schema 2; this engine reads schema 1"):
        PlanExecutor(newer, tiny_model_dir, gpu)
    needy = json.loads(json.dumps(tiny_plan))
    needy["requires"]["features"] = ["shader-f16", "chromium-experimental-magic"]
    needy["sha256"] = plan_hash(needy)
    with pytest.raises(GPUError, match="chromium-experimental-magic"):
        PlanExecutor(needy, tiny_model_dir, gpu)
    # a weight whose bytes changed on disk
    broken = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, broken)
    w = next(b for b in tiny_plan["buffers"] if b["kind"] == "weight" and b["component"] == "unet")
    path = broken / w["file"]
    data = bytearray(path.read_bytes())
    data[w["offset"]] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=f"weight unet/{w['name']}.*do not match the plan's sha256"):
        PlanExecutor(tiny_plan, broken, gpu)


@pytest.mark.gpu
def test_farm_engine_plan_for_the_presets_and_a_model(tmp_path, tiny_model_dir, gpu, monkeypatch, capsys):
    from orchestrator.cli import app

    runner = CliRunner()
    out = tmp_path / "sd14.json"
    result = runner.invoke(app, ["engine", "plan", "--preset", "sd14", "--precision", "fp16", "--steps", "20",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    check_plan(plan)
    assert (plan["height"], plan["width"]) == (512, 512)
    weights = [b for b in plan["buffers"] if b["kind"] == "weight"]
    assert len(weights) > 1000 and all("file" not in b for b in weights)  # shapes only: nothing read
    assert "named only" in result.output
    assert ("no shader-f16" in result.output) == (not gpu.caps.has_f16)  # fp16 asked of an adapter without it
    out = tmp_path / "tiny.json"
    result = runner.invoke(app, ["engine", "plan", "--model", str(tiny_model_dir), "--steps", "3",
                                 "--scheduler", "ddim", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["scheduler"] == "ddim" and len(plan["loop"]["steps"]) == 3
    from orchestrator.cli import main

    monkeypatch.setattr("sys.argv", ["farm", "engine", "plan", "--preset", "tiny", "--scheduler", "lms", "--out",
                                     str(out)])
    with pytest.raises(SystemExit) as exit_:
        main()
    text = "".join(capsys.readouterr())
    assert exit_.value.code == 3 and "unknown scheduler 'lms'" in text and "Traceback" not in text  # bad input


@pytest.mark.gpu
def test_explain_and_the_plan_agree_on_every_selection(tiny_model_dir, gpu):
    from engine.explain import explain
    from engine.models.config import load_model_config
    from engine.profiles import resolve_profile

    config = load_model_config(tiny_model_dir)
    profile = resolve_profile("auto", gpu.caps)
    plan = record_plan(config, gpu.caps, height=64, width=64, steps=1, scheduler="euler", profile=profile.to_json())
    rows = explain(config, profile.selection(gpu.caps), gpu.caps, "f32", 64, 64)
    chosen = {(d["op"], json.dumps(d["shape"], sort_keys=True)): d["variant"] for d in plan["profile"]["decisions"]}
    assert rows
    for r in rows:
        assert chosen[(r.op, json.dumps(r.shape, sort_keys=True))] == r.variant, r
    used = {p["shader"] for p in plan["pipelines"]}
    own = [r for r in rows if not getattr(variants(r.op)[r.variant].launch, "composed", False)]  # a shader each
    assert {f"{r.op}/{r.variant}" for r in own} <= used


@pytest.mark.gpu
@pytest.mark.parametrize("executor", ["native", "plan"])
@pytest.mark.parametrize("scheduler", ["pndm", "ddim", "euler"])
def test_3_step_generations_match_diffusers(native, planned, golden3, executor, scheduler):
    pipe = native if executor == "native" else planned
    result = pipe.generate(str(golden3["txt2img3_prompt"]), steps=3, guidance_scale=7.5, height=64, width=64,
                           scheduler=scheduler, latents=golden3["txt2img3_latents_in"])
    ref = golden3[f"txt2img3_{scheduler}_image"][0]
    mse = float(np.mean((result.image / 255.0 - ref) ** 2))
    assert 10 * np.log10(1.0 / mse) >= 40.0
    ref_latents = golden3[f"txt2img3_{scheduler}_latents"]
    assert np.linalg.norm(result.latents - ref_latents) / np.linalg.norm(ref_latents) <= 1e-4


@pytest.mark.gpu
def test_farm_engine_bench_on_the_plan_executor(tiny_model_dir, tmp_path):
    from orchestrator.cli import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["engine", "bench", "--model", str(tiny_model_dir), "--executor", "plan",
                                      "--reps", "3", "--warmup", "1", "--e2e-steps", "2", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["executor"] == "plan" and len(doc["unet_step_ms"]) == 3 and doc["e2e_ms"][0] > 0
    assert "UNet CFG step" in result.output


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["ddim", "euler_ancestral", "pndm"])
def test_an_image_to_image_plan_equals_generate(native, planned, golden, scheduler):
    kwargs = {"steps": 4, "strength": 0.5, "seed": 42, "height": 64, "width": 64, "scheduler": scheduler,
              "init_image": golden["img2img_init_image_u8"][0]}
    a = native.generate("a small house", **kwargs)
    b = planned.generate("a small house", **kwargs)
    np.testing.assert_array_equal(b.latents, a.latents)
    np.testing.assert_array_equal(b.image, a.image)
    plan = planned.plan_executor(64, 64, 4, scheduler, 7.5, 0.5).plan
    assert "vae_encode" in plan["stages"] and "image" in plan["inputs"] and plan["loop"]["prologue"]


@pytest.mark.gpu
def test_plan_image_to_image_matches_diffusers_and_encodes(native, planned, golden):
    result = planned.generate(str(golden["txt2img_prompt"]), steps=4, strength=0.5, scheduler="ddim",
                              seed=int(golden["img2img_seed"]), height=64, width=64,
                              init_image=golden["img2img_init_image_u8"][0])
    mse = float(np.mean((result.image / 255.0 - golden["img2img_image"][0]) ** 2))
    assert 10 * np.log10(1.0 / mse) >= 40.0
    mean, logvar = planned.encode_image(golden["vae_enc_image"])
    m2, l2 = native.encode_image(golden["vae_enc_image"])
    np.testing.assert_array_equal(mean, m2)
    np.testing.assert_array_equal(logvar, l2)


@pytest.mark.gpu
def test_a_plan_file_runs_in_a_fresh_process(tiny_plan, tiny_model_dir, tmp_path):
    # the executor needs nothing but the plan file and the model: no pipeline is built first
    import subprocess
    import sys

    from engine.plan import write_plan

    write_plan(tiny_plan, tmp_path / "plan.json")
    code = (
        "import sys, numpy as np\n"
        "from engine.device import get_gpu\nfrom engine.plan import load_plan\nfrom engine.plan_exec import PlanExecutor\n"
        "plan = load_plan(sys.argv[1])\nex = PlanExecutor(plan, sys.argv[2], get_gpu())\n"
        "ids = np.zeros((2, 77), np.uint32)\nx = np.ones(plan['inputs']['latents']['shape'], np.float32)\n"
        "out = ex.generate(ids, x, [])\nprint(out['image'].shape, bool(np.isfinite(out['image']).all()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "plan.json"), str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(1, 3, 64, 64) True"


def _bound_buffers(plan) -> set[int]:
    ids = set()
    for commands in (plan["generate"], *(s["commands"] for s in plan["stages"].values())):
        for c in commands:
            ids |= {b for _slot, b, _size in c.get("bindings", ())}
    return ids


@pytest.mark.parametrize("strength", [None, 0.6])
def test_a_plan_holds_only_the_weights_its_dispatches_bind(strength):
    """Text to image never runs the VAE encoder: its weights (130 MiB in SD 1.4) stay out of
    the plan, so no executor allocates or fetches them; image to image keeps them."""
    from engine.device import ADAPTERS_DIR, caps_from_dict
    from engine.make_model import preset_model_config

    caps = caps_from_dict(json.loads((ADAPTERS_DIR / "apple-iphone-safari.json").read_text()))
    plan = record_plan(preset_model_config("tiny"), caps, height=64, width=64, steps=2, scheduler="euler",
                       strength=strength)
    weights = [b for b in plan["buffers"] if b["kind"] == "weight"]
    assert {b["id"] for b in weights} <= _bound_buffers(plan)
    encoder = [b for b in weights if b["component"] == "vae" and b["name"].startswith(("encoder.", "quant_conv."))]
    assert bool(encoder) == (strength is not None)


def _max_binding(plan: dict, stages) -> int:
    return max(b[2] for s in stages for c in plan["stages"][s]["commands"] if c["op"] == "dispatch" for b in c["bindings"])


@pytest.mark.gpu
def test_a_vae_whose_f32_tensors_exceed_the_binding_limit_stores_halves(tiny_model_dir, gpu, golden3):
    """SD 1.4's f32 VAE decoder binds 256 MiB at 512x512, over the 128 MiB some phones give: an
    fp16 plan then stores the decoder's tensors as halves (arithmetic in f32) and says so. Here
    the tiny model's decoder, with the limit between its halves' and its f32 bindings (reference
    kernels: the tiny decoder's Winograd scratch would be its largest binding)."""
    import dataclasses

    from engine.models.config import load_model_config

    config = load_model_config(tiny_model_dir)
    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    kwargs = {"precision": "fp16", "height": 64, "width": 64, "steps": 3, "scheduler": "pndm", "hashes": False,
              "profile": "reference"}
    f32_vae = record_plan(config, gpu.caps, **kwargs)
    assert f32_vae["vae_dtype"] == "f32"
    others = _max_binding(f32_vae, ("text_encoder", "unet_step"))
    limit = max(others, _max_binding(f32_vae, ("vae_decode",)) // 2)
    assert limit < _max_binding(f32_vae, ("vae_decode",))
    small = dataclasses.replace(gpu.caps, limits={**gpu.caps.limits, "max-storage-buffer-binding-size": limit})
    halves = record_plan(config, small, **kwargs)
    assert (halves["dtype"], halves["vae_dtype"]) == ("f16", "f16s")
    assert _max_binding(halves, ("vae_decode",)) <= limit
    assert any("stores them as halves" in w for w in halves["warnings"])
    # a pipeline of plans on the same adapter, run by a page: the plan it is sent stores halves
    pipe = engine.load_pipeline(tiny_model_dir, precision="fp16", executor="plan", profile="reference")
    pipe.caps, pipe._gpu = small, None
    result = pipe.generate(str(golden3["txt2img3_prompt"]), steps=3, guidance_scale=7.5, height=64, width=64,
                           scheduler="pndm", latents=golden3["txt2img3_latents_in"])
    assert pipe.plans[(64, 64, 3, "pndm", 7.5, None)]["vae_dtype"] == "f16s"
    mse = float(np.mean((result.image / 255.0 - golden3["txt2img3_pndm_image"][0]) ** 2))
    assert 10 * np.log10(1.0 / mse) >= 30.0  # the fp16 bar
