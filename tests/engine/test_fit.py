"""engine.fit: what a plan needs of an adapter, read from the plan before anything is
allocated. The WGSL sizes are checked against the shaders' own declarations worked by hand,
the memory against what a loaded PlanExecutor allocates, and `farm engine fit` says what does
not fit with exit code 1."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.device import ADAPTERS_DIR, caps_from_dict
from engine.errors import InputError
from engine.fit import fit_plan, pipeline_needs
from engine.plan import record_plan
from orchestrator.cli import app


@pytest.mark.parametrize(
    "shader,entry,dtype,constants,expected",
    [
        # As, Bs: TILE_K*TILE_M/4 and TILE_K*TILE_N/4 vec4<f32>; workgroup (TILE_N/4, TILE_M/4)
        ("linear/tiled", "main_vec4", "f32", {"TILE_M": 64, "TILE_N": 64, "TILE_K": 16}, (2 * 256 * 16, 16 * 16)),
        ("linear/tiled", "main_vec4", "f32", {"TILE_M": 32, "TILE_N": 64, "TILE_K": 8}, (64 * 16 + 128 * 16, 16 * 8)),
        # one file, three entry points: each counts only the workgroup arrays it touches
        ("attention/partial_softmax", "scores", "f32", {}, (2 * 256 * 4, 16 * 16)),  # tile_a, tile_b
        ("attention/partial_softmax", "row_stats", "f32", {}, (2 * 256 * 4, 256)),  # part_m, part_s
        ("add/reference", "main", "f16", {}, (0, 256)),
    ],
)
def test_workgroup_storage_and_invocations_from_the_wgsl(shader, entry, dtype, constants, expected):
    assert pipeline_needs(f"shaders/{shader}.wgsl", entry, dtype, tuple(sorted(constants.items()))) == expected


def test_f16_storage_kernels_need_what_f32_kernels_need():
    """Packed halves compute in f32: a workgroup array of T takes f32's bytes, twice f16's."""
    consts = ()  # its defaults, DVP = DV | 1u among them
    packed = pipeline_needs("shaders/packed/attention/flash_packed.wgsl", "main", "f16s", consts)
    assert packed == pipeline_needs("shaders/attention/flash_packed.wgsl", "main", "f32", consts)
    assert packed[0] > pipeline_needs("shaders/attention/flash_packed.wgsl", "main", "f16", consts)[0]


def test_an_unknown_entry_point_is_named():
    with pytest.raises(InputError, match="no entry point 'nope'"):
        pipeline_needs("shaders/add/reference.wgsl", "nope", "f32", ())


PAPER_BUDGET = 2_093_000_000  # SD 1.4 at 512x512 on a Galaxy S23 Ultra, in the paper
PHONES = ("adreno-640-chrome.json", "adreno-7xx-128mib-chrome.json", "mali-g78-chrome.json",
          "mali-g78-256mib-chrome.json", "apple-iphone-safari.json")


@pytest.fixture(scope="module")
def sd14_fits():
    from engine.make_model import preset_model_config
    from engine.plan import record_plan_within

    config = preset_model_config("sd14")
    out = {}
    for name in PHONES:
        caps = caps_from_dict(json.loads((ADAPTERS_DIR / name).read_text()))
        plan = record_plan_within(config, caps, PAPER_BUDGET, precision="fp16", height=512, width=512, steps=20,
                                  scheduler="pndm")
        out[name] = (plan, fit_plan(plan, caps, budget_bytes=PAPER_BUDGET))
    return out


@pytest.mark.parametrize("name", [p for p in PHONES if not p.startswith("apple")])
def test_sd14_at_512_fits_every_android_phones_browser_in_the_papers_budget(sd14_fits, name):
    """fp16 memory on adapters without shader-f16 (packed halves), each stage's weights staged,
    scratch bounds divided until the peak fits, every binding within the adapter's limit (down
    to 128 MiB), and the family's own profile."""
    plan, fit = sd14_fits[name]
    assert fit.fits, fit.reasons
    assert fit.peak_gpu_bytes <= PAPER_BUDGET and fit.residency == "staged"
    assert fit.profile.split("6")[0] in ("adreno", "mali") and fit.precision == "f16s"
    assert fit.max_binding_bytes <= caps_from_dict(json.loads((ADAPTERS_DIR / name).read_text())).max_binding_bytes
    assert "shader-f16" not in plan["requires"]["features"]
    assert 0 < fit.max_workgroup_storage_bytes <= 32768 and 0 < fit.max_invocations_per_workgroup <= 1024
    if "128mib" in name:  # an f32 VAE would bind 256 MiB: its tensors are halves too, and the plan says so
        assert plan["vae_dtype"] == "f16s" and any("binding-size" in w for w in plan["warnings"])
    else:
        assert plan["vae_dtype"] == "f32"


def test_sd14_at_512_does_not_fit_safari_on_an_iphone_and_says_what(sd14_fits):
    plan, fit = sd14_fits["apple-iphone-safari.json"]
    assert fit.profile == "apple" and fit.precision == "f16" and not fit.fits
    assert fit.budget_bytes == 1_500_000_000  # the web process's kill level, below the given 2,093 MB
    (reason,) = fit.reasons
    assert reason.startswith(f"peak GPU memory {fit.peak_gpu_bytes:,} bytes (staged) > the budget of "
                             "1,500,000,000 (the adapter's own): unet_step's weights 1,680,703,376")
    # (the UNet's 1,719,041,936 bytes of halves less the context's projections, unet_context's)
    assert plan["scratch_divisor"] == 4  # every divisor was tried
    # packed halves hold what shader-f16's halves hold: the Adreno plan's weights are the same bytes
    adreno = sd14_fits["adreno-640-chrome.json"][0]
    assert sum(b["size"] for b in plan["buffers"] if b["kind"] == "weight") == \
        sum(b["size"] for b in adreno["buffers"] if b["kind"] == "weight")


@pytest.mark.gpu
def test_fit_counts_what_the_executor_allocates(tiny_model_dir, gpu):
    from engine.models.config import load_model_config
    from engine.plan_exec import PlanExecutor

    plan = record_plan(load_model_config(tiny_model_dir), gpu.caps, model_dir=tiny_model_dir, height=64, width=64,
                       steps=2, scheduler="euler")
    executor = PlanExecutor(plan, tiny_model_dir, gpu)
    allocated = (executor.bytes + sum(b["size"] for b in plan["buffers"] if b["kind"] == "weight")
                 + sum(len(base64.b64decode(u)) for u in plan["uniforms"]))
    fit = fit_plan(plan, gpu.caps)
    assert fit.peak_gpu_bytes == allocated
    assert fit.max_buffer_bytes == max(b["size"] for b in plan["buffers"])
    staged = fit.staged_gpu_bytes
    assert staged < allocated
    between = fit_plan(plan, gpu.caps, budget_bytes=allocated - 1)  # only staging fits
    assert between.fits and between.residency == "staged" and between.peak_gpu_bytes == staged
    over = fit_plan(plan, gpu.caps, budget_bytes=staged - 1)
    assert not over.fits and over.reasons[0].startswith(f"peak GPU memory {staged:,} bytes (staged) > the budget of "
                                                        f"{staged - 1:,}: unet_step's weights ")
    resident = fit_plan(plan, gpu.caps, budget_bytes=allocated - 1, residency="resident")
    assert not resident.fits and "(resident)" in resident.reasons[0]


def test_plan_memory_gives_each_stage_the_weights_and_scratch_only_it_uses():
    from engine.fit import buffer_users, plan_memory
    from engine.make_model import preset_model_config

    caps = caps_from_dict(json.loads((ADAPTERS_DIR / "mali-g78-chrome.json").read_text()))
    plan = record_plan(preset_model_config("tiny"), caps, height=64, width=64, steps=2, scheduler="euler")
    memory = plan_memory(plan)
    users = buffer_users(plan)
    buffers = {b["id"]: b for b in plan["buffers"]}
    # each network's weights belong to the one stage that runs it, and every weight to some stage
    owned_weights = {name: {buffers[i]["component"] for i in ids if buffers[i]["kind"] == "weight"}
                     for name, ids in memory.stage_buffers.items()}
    assert owned_weights == {"text_encoder": {"text_encoder"}, "unet_context": {"unet"}, "unet_step": {"unet"},
                             "vae_decode": {"vae"}}
    # the context's projections are unet_context's alone: a step reads their keys and values
    context = {buffers[i]["name"] for i in memory.stage_buffers["unet_context"] if buffers[i]["kind"] == "weight"}
    assert context and all(".attn2.to_k." in n or ".attn2.to_v." in n for n in context)
    assert not any(".attn2.to_k." in buffers[i]["name"] for i in memory.stage_buffers["unet_step"]
                   if buffers[i]["kind"] == "weight")
    assert all(i not in memory.persistent for i, b in buffers.items() if b["kind"] == "weight")
    # a stage owns scratch too; what crosses stages (the context, the latents, the loop's state,
    # what generate's own commands touch) and every constant stays the plan's
    for name, ids in memory.stage_buffers.items():
        # (unet_context's products keep no scratch: their keys and values are what steps read)
        assert name == "unet_context" or any(buffers[i]["kind"] == "activation" for i in ids), name
        assert all(users[i] == {name} for i in ids)
    kv = {b[1] for c in plan["stages"]["unet_context"]["commands"] if c["op"] == "dispatch" for b in c["bindings"]
          if buffers[b[1]]["kind"] == "activation"} - {plan["stages"]["unet_context"]["inputs"]["context"]["buffer"]}
    # (pooled: a buffer the text encoder's scratch used before may hold them)
    assert kv and all(i in memory.persistent and {"unet_context", "unet_step"} <= users[i] for i in kv)
    for stage in plan["stages"].values():
        for io in (*stage["inputs"].values(), *stage["outputs"].values()):
            assert (io["buffer"] in memory.persistent) == (len(users[io["buffer"]]) > 1)
    assert all(i in memory.persistent for i, b in buffers.items() if b["kind"] in ("constant", "state"))
    uniforms = sum(len(base64.b64decode(u)) for u in plan["uniforms"])
    assert memory.resident_bytes == sum(b["size"] for b in plan["buffers"]) + uniforms
    assert memory.staged_bytes == memory.persistent_bytes + max(memory.stage_bytes.values())
    assert memory.staged_bytes < memory.resident_bytes


@pytest.mark.gpu
def test_staged_buffers_give_the_same_image_within_the_budget_fit_names(tiny_model_dir, gpu, monkeypatch):
    """A generation whose plan only fits its budget with staged weights: the executor stages
    them, holds at most what fit says (to the byte), and makes the same image, bit for bit, as
    with every weight resident; a budget below that is refused before anything is allocated.
    Each weight is read from the model folder and checked once: a second generation uploads
    what host memory holds."""
    from engine import plan_exec
    from engine.errors import FitError
    from engine.gpu import GpuContext
    from engine.models.config import load_model_config
    from engine.plan_exec import PlanExecutor

    reads = []

    def counted(model_dir, buffer):
        reads.append((buffer["component"], buffer["name"], buffer["dtype"]))
        return read_weight(model_dir, buffer)

    read_weight = plan_exec.read_weight
    monkeypatch.setattr(plan_exec, "read_weight", counted)

    plan = record_plan(load_model_config(tiny_model_dir), gpu.caps, model_dir=tiny_model_dir, height=64, width=64,
                       steps=2, scheduler="euler")
    fit = fit_plan(plan, gpu.caps)
    rng = np.random.default_rng(7)
    ids = np.zeros((1, 77), np.uint32)
    ids[0, :5] = rng.integers(0, 1000, 5)
    latents = rng.standard_normal(tuple(plan["inputs"]["latents"]["shape"])).astype(np.float32)
    noise = [rng.standard_normal(tuple(plan["inputs"]["noise"]["shape"])).astype(np.float32)
             for _ in range(plan["inputs"]["noise"]["count"])]
    resident = PlanExecutor(plan, tiny_model_dir, gpu)
    assert resident.residency == "resident"
    want = resident.generate(ids, latents, noise)
    assert resident.peak_bytes == fit.resident_gpu_bytes
    staged = PlanExecutor(plan, tiny_model_dir, gpu, budget_bytes=fit.staged_gpu_bytes)
    assert staged.residency == "staged"
    reads.clear()
    got = staged.generate(ids, latents, noise)
    weights = {(b["component"], b["name"], b["dtype"]) for b in plan["buffers"] if b["kind"] == "weight"}
    assert staged.peak_bytes == fit.staged_gpu_bytes < fit.resident_gpu_bytes
    assert staged.upload_ms > 0
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert GpuContext.upload_way == "ring"
    monkeypatch.setattr(GpuContext, "upload_way", "write")  # the other way weights go up: the same image
    again = staged.generate(ids, latents, noise)  # the weights go up again, stage by stage
    np.testing.assert_array_equal(again["image"], want["image"])
    assert sorted(reads) == sorted(weights)  # each read once over both generations
    assert staged.peak_bytes == fit.staged_gpu_bytes
    with pytest.raises(FitError, match=r"\(staged\) > the budget") as refused:
        PlanExecutor(plan, tiny_model_dir, gpu, budget_bytes=fit.staged_gpu_bytes - 1)
    (reason,) = refused.value.reasons
    assert reason.startswith(f"peak GPU memory {fit.staged_gpu_bytes:,} bytes (staged) > the budget of "
                             f"{fit.staged_gpu_bytes - 1:,}: unet_step's weights ")


def test_farm_engine_fit_exits_1_with_the_reasons(tmp_path):
    caps = json.loads((ADAPTERS_DIR / "mali-g78-chrome.json").read_text())
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**caps, "limits": {**caps["limits"], "max-compute-workgroup-storage-size": 4096}}))
    runner = CliRunner()
    ok = runner.invoke(app, ["engine", "fit", "--preset", "tiny", "--adapter", str(ADAPTERS_DIR / "mali-g78-chrome.json"),
                             "--height", "64", "--width", "64", "--steps", "2", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["fits"] is True and json.loads(ok.output)["profile"] == "mali"
    bad = runner.invoke(app, ["engine", "fit", "--preset", "tiny", "--adapter", str(small), "--height", "64",
                              "--width", "64", "--steps", "2", "--budget-mb", "1"])
    assert bad.exit_code == 1, bad.output
    assert "no plan can be made: conv2d tiling" in bad.output and "above this adapter's 4096 B" in bad.output
    over = runner.invoke(app, ["engine", "fit", "--preset", "tiny", "--adapter", str(ADAPTERS_DIR / "mali-g78-chrome.json"),
                               "--height", "64", "--width", "64", "--steps", "2", "--budget-mb", "1", "--json"])
    assert over.exit_code == 1, over.output
    assert "> the budget of 1,000,000: " in json.loads(over.output)["reasons"][0]


def test_farm_engine_plan_warns_of_a_plan_the_adapter_cannot_hold(tmp_path):
    caps = json.loads((ADAPTERS_DIR / "adreno-7xx-128mib-chrome.json").read_text())
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps({**caps, "limits": {**caps["limits"], "max-storage-buffer-binding-size": 131072}}))
    r = CliRunner().invoke(app, ["engine", "plan", "--preset", "tiny", "--adapter", str(narrow), "--height", "64",
                                 "--width", "64", "--steps", "2", "--out", str(tmp_path / "plan.json")])
    assert r.exit_code == 0, r.output
    assert re.search(r"does not fit this adapter: max binding bytes [\d,]+ > the adapter's "
                     r"max-storage-buffer-binding-size 131,072", " ".join(r.output.split())), r.output


@pytest.mark.gpu
def test_farm_engine_generate_keeps_a_budget_on_the_plan_executor(tiny_model_dir, tmp_path):
    base = ["engine", "generate", "--model", str(tiny_model_dir), "--prompt", "a boat", "--steps", "2",
            "--scheduler", "euler", "--executor", "plan", "--json"]
    runner = CliRunner()
    free = runner.invoke(app, [*base, "--out", str(tmp_path / "free.png")])
    assert free.exit_code == 0, free.output
    resident = json.loads(free.output[free.output.index("{"):])
    assert resident["residency"] == "resident"
    budget_mb = (resident["peak_gpu_bytes"] - 1) / 1e6
    tight = runner.invoke(app, [*base, "--out", str(tmp_path / "tight.png"), "--budget-mb", f"{budget_mb:.6f}"])
    assert tight.exit_code == 0, tight.output
    staged = json.loads(tight.output[tight.output.index("{"):])
    assert staged["residency"] == "staged" and staged["peak_gpu_bytes"] < resident["peak_gpu_bytes"]
    assert (tmp_path / "tight.png").read_bytes() == (tmp_path / "free.png").read_bytes()
    over = runner.invoke(app, [*base, "--out", str(tmp_path / "over.png"), "--budget-mb", "1"])
    # an EngineError: `farm` (orchestrator.cli.main) prints its message and exits 1
    assert over.exit_code != 0 and "the plan does not fit: peak GPU memory" in str(over.exception)
    assert "> the budget of 1,000,000" in str(over.exception) and not (tmp_path / "over.png").exists()
