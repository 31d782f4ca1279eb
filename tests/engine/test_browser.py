"""The engine in a browser: engine plans run by engine/web/plan.js in Debian's headless Chromium on
its SwiftShader WebGPU adapter (fp32: SwiftShader has no shader-f16).

- every kernel variant the shipped profiles can select, run from a one-op plan, against float64
  numpy on fresh random inputs (relative error at most 2e-5 of the largest reference value, as
  the native variant tests);
- on the tiny random model: text encoder, one UNet step and VAE decode against the Python engine
  on lavapipe (relative error at most 1e-4), and 3-step generations with PNDM, DDIM and Euler
  (given latents) at least 40 dB PSNR against it;
- the weight cache (a second load fetches no weight bytes, counted by the server);
- bad input: another schema, a missing feature, a corrupted weight, a shader that fails to
  compile: each a structured error naming the problem."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from ci_support import missing

import engine
from engine.browser import BrowserError, BrowserExecutor, BrowserSession, caps_of, find_chromium
from engine.errors import EngineError
from engine.kernels import Rule, Selection, variants
from engine.ops import Ops
from engine.plan import op_plan, plan_hash, record_plan

pytestmark = pytest.mark.gpu

TOL = 2e-5


@pytest.fixture(scope="module")
def session():
    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    with BrowserSession(webgpu_adapter="swiftshader") as s:
        yield s


@pytest.fixture(scope="module")
def caps(session):
    return caps_of(session.adapter)


def test_the_page_reports_its_adapter(session, caps):
    adapter = session.adapter
    assert session.hello["secure"] is True  # WebGPU needs a secure context: localhost is one
    assert adapter["architecture"] == "swiftshader" and adapter["limits"]["maxStorageBufferBindingSize"] > 0
    assert "timestamp-query" in adapter["features"] and "shader-f16" not in adapter["features"]
    assert caps.max_binding_bytes == adapter["limits"]["maxStorageBufferBindingSize"]


# ---- every selectable kernel variant ------------------------------------------------------------


def _shipped_choices() -> list[tuple[str, str, dict]]:
    """(op, variant, constants) of every rule in the shipped profiles, plus each op's reference."""
    from engine.profiles import PROFILE_DIR

    seen = {}
    for path in sorted(p for p in PROFILE_DIR.glob("*.json") if p.name != "schema.json"):
        for rule in json.loads(path.read_text())["rules"]:
            # PRETRANSFORM keeps derived weights for a generation's later steps; a one-op plan
            # has none, so it runs the same kernels as without (the plan's own test covers it)
            constants = {k: v for k, v in rule.get("constants", {}).items() if k != "PRETRANSFORM"}
            seen[(rule["op"], rule["variant"], json.dumps(constants, sort_keys=True))] = constants
    for op in ("linear", "conv2d", "group_norm", "attention", "layer_norm"):
        seen[(op, "reference", "{}")] = {}
    return [(op, v, c) for (op, v, _), c in sorted(seen.items())]


CHOICES = _shipped_choices()


def _np_conv(x, w, b, stride, pad):
    x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    n, _, h, wd = x.shape
    co, ci, k, _ = w.shape
    oh, ow = (h - k) // stride + 1, (wd - k) // stride + 1
    out = np.zeros((n, co, oh, ow))
    for i in range(k):
        for j in range(k):
            patch = x[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
    return out + b[None, :, None, None]


def _case(op: str, rng, variant: str = ""):
    """(inputs {name: array}, build(ops, tensors) -> tensor, float64 reference)."""
    if op == "conv2d" and variant == "pointwise":  # 1x1 convolutions only
        x, w, b = rng.standard_normal((2, 8, 6, 6)), rng.standard_normal((16, 8, 1, 1)) / 3, rng.standard_normal(16)
        return {"x": x, "w": w, "b": b}, lambda o, t: o.conv2d(t["x"], t["w"], t["b"]), _np_conv(x, w, b, 1, 0)
    if op == "conv2d" and variant == "narrow":  # at most 4 output channels
        x, w, b = rng.standard_normal((1, 8, 12, 12)), rng.standard_normal((3, 8, 3, 3)) / 8, rng.standard_normal(3)
        return ({"x": x, "w": w, "b": b}, lambda o, t: o.conv2d(t["x"], t["w"], t["b"], padding=1),
                _np_conv(x, w, b, 1, 1))
    if op == "linear_nchw":  # tokens (B, T, K) -> the image layout (B, N, 6, 6), plus a residual
        x, w, b = rng.standard_normal((2, 36, 96)), rng.standard_normal((40, 96)) / 10, rng.standard_normal(40)
        r = rng.standard_normal((2, 40, 6, 6))
        return ({"x": x, "w": w, "b": b, "r": r}, lambda o, t: o.linear_to_channels(t["x"], t["w"], t["b"], t["r"]),
                (x @ w.T + b).transpose(0, 2, 1).reshape(r.shape) + r)
    if op == "linear":
        rows = (1, 3) if variant == "rows" else (2, 77)  # rows: products of at most 4 rows
        x, w, b = rng.standard_normal((*rows, 96)), rng.standard_normal((40, 96)) / 10, rng.standard_normal(40)
        return {"x": x, "w": w, "b": b}, lambda o, t: o.linear(t["x"], t["w"], t["b"]), x @ w.T + b
    if op == "conv2d":
        x, w, b = rng.standard_normal((1, 8, 12, 12)), rng.standard_normal((16, 8, 3, 3)) / 8, rng.standard_normal(16)
        return ({"x": x, "w": w, "b": b}, lambda o, t: o.conv2d(t["x"], t["w"], t["b"], padding=1),
                _np_conv(x, w, b, 1, 1))
    if op == "group_norm":
        x, g, bb = rng.standard_normal((2, 32, 6, 6)), rng.standard_normal(32), rng.standard_normal(32)
        xr = x.reshape(2, 8, -1)
        y = ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
        y = y * g[None, :, None, None] + bb[None, :, None, None]
        return ({"x": x, "g": g, "b": bb}, lambda o, t: o.group_norm(t["x"], t["g"], t["b"], 8, 1e-5, silu=True),
                y / (1 + np.exp(-y)))
    if op == "layer_norm":
        x, g, bb = rng.standard_normal((2, 77, 96)) * 2 + 0.5, rng.standard_normal(96), rng.standard_normal(96)
        y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + bb
        return {"x": x, "g": g, "b": bb}, lambda o, t: o.layer_norm(t["x"], t["g"], t["b"], 1e-5), y
    q, k, v = (rng.standard_normal((2, 64, 80)) for _ in range(3))
    heads, dh = (1, 80) if variant == "gemm_softmax" else (2, 40)  # gemm_softmax runs one-head attention

    def attn(q, k, v):
        qh, kh, vh = (a.reshape(2, -1, heads, dh).transpose(0, 2, 1, 3) for a in (q, k, v))
        s = qh @ kh.transpose(0, 1, 3, 2) / math.sqrt(dh)
        p = np.exp(s - s.max(-1, keepdims=True))
        return ((p / p.sum(-1, keepdims=True)) @ vh).transpose(0, 2, 1, 3).reshape(q.shape)

    return {"q": q, "k": k, "v": v}, lambda o, t: o.attention(t["q"], t["k"], t["v"], heads), attn(q, k, v)


@pytest.mark.parametrize("dtype", ["f32", "f16s"])
@pytest.mark.parametrize("op,variant,constants", CHOICES, ids=[f"{o}-{v}-{json.dumps(c)}" for o, v, c in CHOICES])
def test_every_selectable_variant_in_chromium(session, caps, fresh_rng, op, variant, constants, dtype):
    """f32, and f16s (f16-storage: packed halves, f32 arithmetic) within fp16's 1e-2."""
    needs = variants(op)[variant].requires
    if not needs <= caps.features:
        # not skipped silently: a variant SwiftShader cannot run is one that needs shader-f16
        assert needs == {"shader-f16"}, needs
        return
    arrays, build, want = _case(op, fresh_rng, variant)
    selection = Selection(caps.features, [Rule(op, variant, constants=tuple(sorted(constants.items())))])

    def record(rec, tensors):
        return build(Ops(rec, rec.pipeline_cache(), selection, dtype), tensors)

    # (gemm_softmax runs the core in f32 in a model of halves too, on f32 copies of Q, K and V)
    if variant in ("gemm", "winograd_2x2", "pointwise", "im2col", "gemm_softmax"):
        from engine.variants.gemm import DEFAULTS, workgroup_bytes

        if workgroup_bytes({**DEFAULTS, **constants}, "f32") > caps.limits["max-compute-workgroup-storage-size"]:
            # a GEMM-core tile for an H100: refused by name on this adapter, never a silent fallback
            with pytest.raises(EngineError, match="workgroup memory"):
                op_plan(caps, dtype, {k: (a.shape, dtype) for k, a in arrays.items()}, record)
            return
    plan = op_plan(caps, dtype, {k: (a.shape, dtype) for k, a in arrays.items()}, record)
    assert "shader-f16" not in plan["requires"]["features"]
    decided = {d.variant for d in selection.decisions.values() if d.op == op}  # (casts ask for "step")
    assert decided == {variant}, selection.warnings
    got = BrowserExecutor(plan, None, session).run("op", arrays)["out"]
    err = float(np.abs(got - want).max() / np.abs(want).max())
    tol = TOL if dtype == "f32" else 1e-2
    assert err <= tol, f"{op}/{variant} {constants} {dtype}: relative error {err:.2e}"


# ---- the tiny model against the Python engine ---------------------------------------------------


@pytest.fixture(scope="module")
def native(tiny_model_dir, gpu):
    return engine.load_pipeline(tiny_model_dir, precision="fp32")


@pytest.fixture(scope="module")
def browser(tiny_model_dir, session):
    return engine.load_pipeline(tiny_model_dir, precision="fp32", executor="browser", session=session)


def _rel(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def test_networks_match_the_python_engine(native, browser, fresh_rng):
    ids = native.tokenize(["", "a watercolor fox"])
    ctx = native.encode_text(ids)
    assert _rel(browser.encode_text(ids), ctx) <= 1e-4
    sample = fresh_rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    assert _rel(browser.unet(sample, 421, ctx), native.unet(sample, 421, ctx)) <= 1e-4
    z = fresh_rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
    assert _rel(browser.decode(z), native.decode(z)) <= 1e-4


def _norm_rel(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def test_networks_match_diffusers(browser, golden):
    """The checks tests/engine/test_models.py makes of the native engine, in fp32."""
    assert _norm_rel(browser.encode_text(golden["te_input_ids"]), golden["te_last_hidden_state"]) <= 1e-4
    out = browser.unet(golden["unet_sample"], golden["unet_timesteps"], golden["unet_encoder_hidden_states"])
    assert _norm_rel(out, golden["unet_out"]) <= 1e-4
    assert _norm_rel(browser.decode(golden["vae_dec_latents"]), golden["vae_dec_image"]) <= 1e-4


@pytest.mark.parametrize("scheduler", ["pndm", "ddim", "euler"])
def test_3_step_generations_match_diffusers(browser, golden3, scheduler):
    result = browser.generate(str(golden3["txt2img3_prompt"]), steps=3, guidance_scale=7.5, height=64, width=64,
                              scheduler=scheduler, latents=golden3["txt2img3_latents_in"])
    ref = golden3[f"txt2img3_{scheduler}_image"][0]
    mse = float(np.mean((result.image / 255.0 - ref) ** 2))
    assert 10 * np.log10(1.0 / mse) >= 40.0, f"{10 * np.log10(1.0 / mse):.1f} dB"


def test_image_to_image_matches_diffusers(browser, golden):
    result = browser.generate(str(golden["txt2img_prompt"]), steps=4, strength=0.5, scheduler="ddim",
                              seed=int(golden["img2img_seed"]), height=64, width=64,
                              init_image=golden["img2img_init_image_u8"][0])
    mse = float(np.mean((result.image / 255.0 - golden["img2img_image"][0]) ** 2))
    assert 10 * np.log10(1.0 / mse) >= 40.0
    mean, logvar = browser.encode_image(golden["vae_enc_image"])
    assert _norm_rel(mean, golden["vae_enc_mean"]) <= 1e-4 and _norm_rel(logvar, golden["vae_enc_logvar"]) <= 1e-4


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) / 255 - b.astype(np.float64) / 255) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.mark.parametrize("scheduler", ["pndm", "ddim", "euler"])
def test_generations_match_the_python_engine(native, browser, fresh_rng, scheduler):
    latents = fresh_rng.standard_normal((1, 4, 8, 8), dtype=np.float32)
    kwargs = {"steps": 3, "height": 64, "width": 64, "scheduler": scheduler, "latents": latents}
    a = native.generate("a lighthouse at dusk", **kwargs)
    b = browser.generate("a lighthouse at dusk", **kwargs)
    assert psnr(b.image, a.image) >= 40.0
    assert _rel(b.latents, a.latents) <= 1e-3
    assert b.timings["unet_step_ms"] > 0 and b.timings["vae_decode_ms"] > 0
    # the page ran the denoising loop back to back and timed it whole, as PlanExecutor does
    ex = browser.plan_executor(64, 64, 3, scheduler)
    runs = sum(1 for c in ex.plan["generate"] if c["op"] == "run" and c["stage"] == "unet_step")
    assert ex.loop_steps == runs >= 3
    assert b.timings["unet_step_ms"] == pytest.approx(b.timings["unet_total_ms"] / runs)


def test_per_kernel_gpu_times_from_timestamp_queries(browser):
    ex = browser.plan_executor(*browser.native_size)
    kernels = ex.kernel_times("unet_step", repetitions=1)
    assert kernels and sum(k["calls"] for k in kernels.values()) == sum(
        c["op"] == "dispatch" for c in ex.plan["stages"]["unet_step"]["commands"])


# ---- memory: the budget and staged weights ---------------------------------------------------------


def test_the_page_stages_weights_to_keep_a_budget_and_refuses_one_it_cannot(session, caps, tiny_model_dir, fresh_rng):
    """The page holds a plan within the budget it is given: with only staging fitting, it
    uploads each stage's weights before the stage and releases the others; its count of the
    bytes it held is engine.fit's, to the byte, and the image is the same, bit for bit, as with
    every weight resident. A budget below that is refused before anything is allocated."""
    from engine.fit import fit_plan
    from engine.models.config import load_model_config

    plan = record_plan(load_model_config(tiny_model_dir), caps, model_dir=tiny_model_dir, height=64, width=64,
                       steps=2, scheduler="euler", guidance_scale=1.0)
    fit = fit_plan(plan, caps)
    ids = np.zeros((1, 77), np.uint32)
    ids[0, :6] = fresh_rng.integers(0, 1000, 6)
    latents = fresh_rng.standard_normal(tuple(plan["inputs"]["latents"]["shape"]), dtype=np.float32)
    noise = [fresh_rng.standard_normal(tuple(plan["inputs"]["noise"]["shape"]), dtype=np.float32)
             for _ in range(plan["inputs"]["noise"]["count"])]
    resident = BrowserExecutor(plan, tiny_model_dir, session)
    assert resident.residency == "resident" and resident.peak_bytes == fit.resident_gpu_bytes
    want = resident.generate(ids, latents, noise)
    session.call("unload", plan=plan["sha256"])
    staged = BrowserExecutor(plan, tiny_model_dir, session, budget_bytes=fit.staged_gpu_bytes)
    assert staged.residency == "staged"
    got = staged.generate(ids, latents, noise)
    assert staged.peak_bytes == fit.staged_gpu_bytes < fit.resident_gpu_bytes
    assert staged.upload_ms > 0
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    session.call("unload", plan=plan["sha256"])
    with pytest.raises(BrowserError) as refused:
        BrowserExecutor(plan, tiny_model_dir, session, budget_bytes=fit.staged_gpu_bytes - 1)
    assert refused.value.kind == "over-budget"
    assert f"peak GPU memory {fit.staged_gpu_bytes:,} bytes (staged) > the budget of " \
           f"{fit.staged_gpu_bytes - 1:,}" in str(refused.value)


# ---- the weight cache and bad input ---------------------------------------------------------------


def test_a_second_load_fetches_no_weight_bytes_and_plans_share_one_copy(caps, tiny_model_dir):
    """Weights come from the page's Cache Storage once fetched (counted by the server, not the
    page), and a page holds one GPU copy of each weight whatever number of plans use it. A new
    page: the shared session's holds plans of this model already."""
    from engine.models.config import load_model_config

    config = load_model_config(tiny_model_dir)
    plan = record_plan(config, caps, model_dir=tiny_model_dir, height=64, width=64, steps=1, scheduler="ddim",
                       guidance_scale=3.0)
    other = record_plan(config, caps, model_dir=tiny_model_dir, height=64, width=64, steps=2, scheduler="ddim",
                        guidance_scale=3.0)
    weights = [b for b in plan["buffers"] if b["kind"] == "weight"]
    with BrowserSession(webgpu_adapter="swiftshader") as page:
        first = BrowserExecutor(plan, tiny_model_dir, page).load_report
        assert first["weights_fetched"] == len(weights)
        assert first["weight_bytes_fetched"] == page.weight_bytes_served == sum(b["length"] for b in weights)
        page.call("unload", plan=plan["sha256"])
        second = BrowserExecutor(plan, tiny_model_dir, page).load_report
        assert page.weight_bytes_served == first["weight_bytes_fetched"]  # counted by the server, not the page
        assert second["weight_bytes_fetched"] == 0 and second["weights_cached"] == len(weights)
        # a second plan of the model, loaded beside the first: no weight fetched or uploaded again
        shared = BrowserExecutor(other, tiny_model_dir, page).load_report
        assert shared["weights_shared"] == len(weights) and shared["weights_cached"] == shared["weights_fetched"] == 0
        assert shared["page_weight_bytes"] == second["page_weight_bytes"] == sum(b["size"] for b in weights)


def test_bad_input_gives_structured_errors(session, caps, tiny_model_dir, tmp_path):
    from engine.models.config import load_model_config

    config = load_model_config(tiny_model_dir)
    plan = record_plan(config, caps, model_dir=tiny_model_dir, height=64, width=64, steps=1, scheduler="euler",
                       guidance_scale=2.0)

    def load(p, model=tiny_model_dir):
        p["sha256"] = plan_hash(p)
        with pytest.raises(BrowserError) as err:
            BrowserExecutor(p, model, session)
        return err.value

    newer = json.loads(json.dumps(plan)) | {"schema": 99}
    e = load(newer)
    assert e.kind == "schema" and "plan schema 99" in str(e)

    needy = json.loads(json.dumps(plan))
    needy["requires"]["features"].append("shader-f16")
    e = load(needy)
    assert e.kind == "missing-feature" and "shader-f16" in str(e)

    # a weight damaged on disk, loaded by a page whose cache has never seen the model (a new
    # browser profile: the shared session's cache holds the good bytes under the same hash)
    broken = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, broken)
    w = next(b for b in plan["buffers"] if b["kind"] == "weight" and b["component"] == "vae")
    path = broken / w["file"]
    data = bytearray(path.read_bytes())
    data[w["offset"] + 3] ^= 0x5A
    path.write_bytes(bytes(data))
    with BrowserSession(webgpu_adapter="swiftshader") as fresh, pytest.raises(BrowserError) as err:
        BrowserExecutor(plan, broken, fresh)
    assert err.value.kind == "hash-mismatch" and f"vae/{w['name']}" in str(err.value)

    bad_shader = json.loads(json.dumps(plan))
    bad_shader["shader_header"]["f32"] = "alias T = f32;\nfn broken( {\n"
    e = load(bad_shader)
    assert e.kind == "shader-compile" and ".wgsl" in str(e)


# ---- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["plan", "browser"])
def test_farm_engine_generate_on_each_executor(tiny_model_dir, tmp_path, executor):
    from PIL import Image
    from typer.testing import CliRunner

    from orchestrator.cli import app

    if executor == "browser" and not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    out = tmp_path / f"{executor}.png"
    result = CliRunner().invoke(app, ["engine", "generate", "--model", str(tiny_model_dir), "--prompt", "a boat",
                                      "--steps", "2", "--scheduler", "euler", "--executor", executor, "--json",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["executor"] == executor and summary["timings_ms"]["unet_step"] > 0
    assert Image.open(out).size == (64, 64)


def test_browser_option_needs_the_browser_executor(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main

    monkeypatch.setattr("sys.argv", ["farm", "engine", "generate", "--model", str(tiny_model_dir), "--prompt", "x",
                                     "--browser", "manual", "--out", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 3 and "--browser is for --executor browser" in "".join(capsys.readouterr())  # bad input


def test_a_browser_never_closed_goes_when_its_process_exits(tmp_path):
    """A script that starts the browser executor and exits without close() (the README's example
    did) left its headless Chromium running; it goes with the interpreter now."""
    import os
    import subprocess
    import sys
    import time

    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    script = ("from engine.browser import BrowserSession\n"
              "s = BrowserSession(webgpu_adapter='swiftshader')\n"
              "print(s.process.pid, s._profile_dir, flush=True)\n")  # and exit, never closing it
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    pid, profile = done.stdout.split()
    deadline = time.monotonic() + 30  # on a loaded machine (the suite's workers) it takes seconds
    while True:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, f"Chromium {pid} still runs after its process exited"
        time.sleep(0.2)
    assert not os.path.exists(profile)


def _renderers(browser_pid: int) -> list[int]:
    """The renderer processes of the Chromium whose browser process is `browser_pid` (its
    descendants, through the zygote, that run with --type=renderer)."""
    import os

    parents, kinds = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                kinds[int(entry)] = b"--type=renderer" in f.read()  # Chromium joins its argv into one
        except (OSError, ValueError, IndexError):
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == browser_pid:
                return True
        return False

    return [pid for pid, renderer in kinds.items() if renderer and descends(pid)]


def test_a_standalone_page_that_dies_is_noticed_from_its_silence():
    """The tab crashes, the browser lives on: the page's polls and beats stop. The engine's own
    server ignored beats and waited out the call's timeout (600 s); now it counts the silence."""
    import os
    import signal
    import time

    if not find_chromium():
        missing("no chromium: bash scripts/ensure-chromium.sh installs it", "CI needs it")
    with BrowserSession(webgpu_adapter="swiftshader", page_lost_s=5.0) as s:
        renderers = _renderers(s.process.pid)
        assert renderers, "no renderer process found"
        for pid in renderers:
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(BrowserError, match="no word from the page") as err:
            s.call("hello", timeout_s=600)
        assert err.value.kind == "page-lost" and time.monotonic() - started < 60
        assert s.process.poll() is None  # the browser itself still runs: only the page is gone


def test_f16_storage_in_chromium_matches_the_python_engine_and_diffusers(tiny_model_dir, session, golden3):
    """fp16 memory without shader-f16: the plan names no feature SwiftShader lacks, and its 3-step
    generation equals the Python engine's f16-storage run and diffusers' fp32 one (>= 40 dB)."""
    native = engine.load_pipeline(tiny_model_dir, precision="f16-storage")
    browser = engine.load_pipeline(tiny_model_dir, precision="fp16", executor="browser", session=session)
    kwargs = {"steps": 3, "guidance_scale": 7.5, "height": 64, "width": 64, "scheduler": "pndm",
              "latents": golden3["txt2img3_latents_in"]}
    a = native.generate(str(golden3["txt2img3_prompt"]), **kwargs)
    b = browser.generate(str(golden3["txt2img3_prompt"]), **kwargs)
    plan = browser.plan_executor(64, 64, 3, "pndm", guidance_scale=7.5).plan
    assert plan["dtype"] == "f16s" and "shader-f16" not in plan["requires"]["features"]
    assert any("f16-storage" in w for w in b.warnings)
    assert psnr(b.image, a.image) >= 40.0, f"{psnr(b.image, a.image):.1f} dB against the Python engine"
    ref = (golden3["txt2img3_pndm_image"][0] * 255).round()
    assert psnr(b.image, ref) >= 40.0, f"{psnr(b.image, ref):.1f} dB against diffusers"
