"""Whole generations against diffusers' StableDiffusion(Img2Img)Pipeline on the tiny model:
2 steps with given latents for every scheduler (image PSNR >= 40 dB in fp32, the product's
bar), img2img, and the errors a user can cause."""

from __future__ import annotations

import numpy as np
import pytest
from ci_support import F16_HINT, missing

import engine
from engine.errors import EngineError, InputError, ModelError
from engine.schedulers import SCHEDULERS

pytestmark = pytest.mark.gpu


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two images with values in [0, 1]."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def pipe(tiny_model_dir, gpu):
    return engine.load_pipeline(tiny_model_dir, precision="fp32")


# The goldens let diffusers draw every noise tensor from the seeded generator (its first
# draw is txt2img_initial_noise). Passing that draw as latents= gives the same run for every
# deterministic scheduler; for the ancestral one it would shift its step noise by one draw
# (latents= consumes no draw, as in diffusers), so it is compared through the seed alone.
CASES = [(s, False) for s in SCHEDULERS] + [(s, True) for s in SCHEDULERS if s != "euler_ancestral"]


@pytest.mark.parametrize("scheduler,given_latents", CASES)
def test_txt2img_matches_diffusers(pipe, golden, scheduler, given_latents):
    result = pipe.generate(
        str(golden["txt2img_prompt"]),
        steps=2,
        guidance_scale=7.5,
        seed=int(golden["txt2img_seed"]),
        height=64,
        width=64,
        scheduler=scheduler,
        latents=golden["txt2img_initial_noise"] if given_latents else None,
    )
    ref = golden[f"txt2img_{scheduler}_image"][0]
    assert result.image.shape == (64, 64, 3) and result.image.dtype == np.uint8
    # the engine's 8-bit image against diffusers' float image: rounding alone costs ~59 dB
    assert psnr(result.image / 255.0, ref) >= 40.0
    ref_latents = golden[f"txt2img_{scheduler}_latents"]
    assert np.linalg.norm(result.latents - ref_latents) / np.linalg.norm(ref_latents) <= 1e-4
    assert {"text_encoder_ms", "unet_step_ms", "vae_decode_ms", "total_ms"} <= set(result.timings)
    assert result.peak_gpu_bytes > 0


def test_img2img_matches_diffusers(pipe, golden):
    result = pipe.generate(
        str(golden["txt2img_prompt"]),
        steps=4,
        strength=0.5,
        scheduler="ddim",
        seed=int(golden["img2img_seed"]),
        height=64,
        width=64,
        init_image=golden["img2img_init_image_u8"][0],
    )
    assert psnr(result.image / 255.0, golden["img2img_image"][0]) >= 40.0
    assert "vae_encode_ms" in result.timings


def test_seeded_noise_is_reproducible_and_progress_is_reported(pipe):
    seen = []
    a = pipe.generate("a cat", steps=2, seed=7, height=64, width=64, progress=lambda i, n: seen.append((i, n)))
    b = pipe.generate("a cat", steps=2, seed=7, height=64, width=64)
    c = pipe.generate("a cat", steps=2, seed=8, height=64, width=64)
    assert np.array_equal(a.image, b.image)
    assert not np.array_equal(a.latents, c.latents)
    assert seen[-1][0] == seen[-1][1] and len(seen) == seen[-1][1]


def test_fp16_pipeline_close_to_fp32(tiny_model_dir, gpu, golden):
    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    half = engine.load_pipeline(tiny_model_dir, precision="fp16")
    r = half.generate(str(golden["txt2img_prompt"]), steps=2, seed=0, height=64, width=64,
                      latents=golden["txt2img_initial_noise"])
    assert psnr(r.image / 255.0, golden["txt2img_pndm_image"][0]) >= 30.0


def test_single_file_checkpoint_gives_the_same_image(pipe, tiny_model_dir, tmp_path):
    from engine.weights.single_file import to_single_file

    ckpt = tmp_path / "tiny.safetensors"
    to_single_file(tiny_model_dir, ckpt)
    with pytest.raises(ModelError, match="carries no tokenizer"):
        engine.load_pipeline(ckpt)
    single = engine.load_pipeline(ckpt, tokenizer_dir=tiny_model_dir / "tokenizer")
    a = pipe.generate("a house", steps=1, seed=3, height=64, width=64)
    b = single.generate("a house", steps=1, seed=3, height=64, width=64)
    assert np.array_equal(a.image, b.image)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"height": 60}, "height must be a positive multiple of 8"),
        ({"width": 0}, "width must be a positive multiple of 8"),
        ({"steps": 0}, "steps must be an integer >= 1"),
        ({"scheduler": "lms"}, "unknown scheduler 'lms'; choose one of pndm"),
        ({"init_image": np.zeros((64, 64, 3), np.uint8), "strength": 1.5}, r"strength must be in \(0, 1\]"),
        ({"latents": np.zeros((1, 4, 4, 4), np.float32)}, r"latents must have shape \(1, 4, 8, 8\)"),
    ],
)
def test_bad_generation_arguments(pipe, kwargs, match):
    args = {"steps": 1, "height": 64, "width": 64, **kwargs}
    with pytest.raises(InputError, match=match):
        pipe.generate("x", **args)


def test_bad_model_paths(tmp_path, gpu):
    with pytest.raises(ModelError, match="does not exist"):
        engine.load_pipeline(tmp_path / "nope")
    with pytest.raises(EngineError, match="precision 'int8'"):
        engine.load_pipeline(tmp_path, precision="int8")


def test_fp16_without_shader_f16_runs_as_f16_storage_never_fp32(tiny_model_dir, gpu, golden, monkeypatch):
    import dataclasses

    import engine.pipeline as pipeline_mod
    from engine.device import GPU

    caps = dataclasses.replace(gpu.caps, features=gpu.caps.features - {"shader-f16"})
    monkeypatch.setattr(pipeline_mod, "get_gpu", lambda: GPU(gpu.adapter, gpu.device, caps))
    p = engine.load_pipeline(tiny_model_dir, precision="fp16")
    assert (p.precision, p.dtype) == ("f16-storage", "f16s")
    r = p.generate(str(golden["txt2img_prompt"]), steps=2, seed=0, height=64, width=64,
                   latents=golden["txt2img_initial_noise"])
    assert any("fp16 runs as f16-storage" in w for w in r.warnings)
    assert psnr(r.image / 255.0, golden["txt2img_pndm_image"][0]) >= 30.0  # the fp16 bar


def test_f16_storage_holds_half_the_bytes_of_fp32_and_matches_diffusers(tiny_model_dir, gpu, golden, tmp_path):
    """Packed halves on any adapter: weights and activations in 2 bytes, arithmetic in f32, so
    closer to diffusers than fp16; the VAE too when the model does not upcast it."""
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "vae" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "force_upcast": False}))
    packed = engine.load_pipeline(model, precision="f16-storage")
    full = engine.load_pipeline(model, precision="fp32")
    assert (packed.dtype, packed.vae_dtype) == ("f16s", "f16s")
    r = packed.generate(str(golden["txt2img_prompt"]), steps=2, seed=0, height=64, width=64,
                        latents=golden["txt2img_initial_noise"])
    assert psnr(r.image / 255.0, golden["txt2img_pndm_image"][0]) >= 35.0
    full.generate("a dog", steps=1, height=64, width=64)
    assert packed.rt.static_bytes <= 0.55 * full.rt.static_bytes


def test_activations_are_pooled_so_peak_memory_does_not_grow_with_steps(tiny_model_dir, gpu):
    p = engine.load_pipeline(tiny_model_dir)
    p.generate("a dog", steps=2, height=64, width=64)
    after_two = p.rt.peak_bytes
    p.generate("a dog", steps=6, height=64, width=64)
    assert p.rt.peak_bytes == after_two
    assert p.rt.static_bytes < after_two  # weights plus the pool, both counted


def test_a_force_upcast_vae_runs_in_halves_where_an_overflow_decodes_again(tiny_model_dir, gpu):
    """SD 1.x's VAE is force_upcast (AutoencoderKL's default), which diffusers' SD pipeline does
    not read: it decodes in the pipeline's fp16. The native executors do too, since they decode
    again in f32 where the halves overflow (below); a plan as a page runs it, which cannot,
    keeps f32, and so does f16-storage (the phone's form)."""
    from engine.models.config import load_model_config
    from engine.plan import record_plan

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    config = load_model_config(tiny_model_dir)
    assert config.vae.force_upcast
    eager = engine.load_pipeline(tiny_model_dir, precision="fp16")
    assert eager.vae_dtype == "f16" and eager.decode(np.zeros((1, 4, 8, 8), np.float32)).dtype == np.float32
    planned = engine.load_pipeline(tiny_model_dir, precision="fp16", executor="plan")
    planned.decode(np.zeros((1, 4, 8, 8), np.float32))
    assert [p["vae_dtype"] for p in planned.plans.values()] == ["f16"]
    kwargs = {"precision": "fp16", "height": 64, "width": 64, "steps": 1, "hashes": False}
    assert record_plan(config, gpu.caps, **kwargs)["vae_dtype"] == "f32"  # what a page is sent
    assert engine.load_pipeline(tiny_model_dir, precision="f16-storage").vae_dtype == "f32"


def test_a_vae_in_halves_that_overflows_decodes_again_in_f32(tiny_model_dir, gpu, tmp_path, fresh_rng):
    """Latents far beyond a real model's put activations past f16's 65,504: the decoder in halves
    gives inf or NaN, and the pipeline decodes again in f32 on f32 copies of the same (f16)
    weights. The image then matches an f32 decoder's within fp16's weight rounding, and the
    generation's warnings say what happened. Ordinary latents decode once, in halves."""
    import json
    import shutil

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    cfg_path = model / "vae" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "force_upcast": False}))
    # staged, as on a phone: the decoder's weights are on the GPU only while it decodes
    half, full = engine.load_pipeline(model, precision="fp16", residency="staged"), engine.load_pipeline(model)
    assert half.vae_dtype == "f16"
    ordinary = fresh_rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    assert np.isfinite(half.decode(ordinary)).all() and half.decode_notes == []
    huge = ordinary * 3e4
    got, want = half.decode(huge), full.decode(huge)
    assert np.isfinite(got).all()
    assert half.decode_notes == ["the VAE decoder overflowed f16 (inf or NaN in its image): decoded again in f32"]
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-2, f"f32 decode on f16 weights vs the f32 pipeline: {err:.2e}"
    r = half.generate("a dog", steps=1, height=64, width=64)
    assert not any("overflowed" in w for w in r.warnings)  # each generation says only its own


LAYER_OPS = ("conv2d", "group_norm", "linear", "attention", "add", "upsample_nearest")


def _recording_ops(ops):
    """`ops` keeping a host copy (float64) of each output of LAYER_OPS, in call order."""
    from engine.ops import Ops

    class Recording(Ops):
        pass

    def keeping(name):
        def call(self, *a, **k):
            y = getattr(Ops, name)(self, *a, **k)
            self.outputs.append((name, self.rt.read(y).astype(np.float64)))
            return y
        return call

    for name in LAYER_OPS:
        setattr(Recording, name, keeping(name))
    rec = Recording(ops.rt, ops.pipelines, ops.selection, ops.dtype, ops.scratch_scale)
    rec.outputs = []
    return rec


def test_the_vae_decoder_in_halves_layer_by_layer_at_large_activations(tiny_model_dir, gpu, fresh_rng):
    """The tiny decoder in f16 against the same decoder in f32, layer by layer, with latents
    scaled until its residual stream reaches 1e4 (within 6.5x of f16's largest, 65,504): every
    layer's output stays within fp16's 1e-2 of the f32 one's largest magnitude, none non-finite.
    The table is printed (pytest -s)."""
    from engine.models.common import GPUWeights
    from engine.models.vae import AutoencoderKL
    from engine.pipeline import _load_components

    if not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    config, _, states = _load_components(tiny_model_dir, None)
    pipe = engine.load_pipeline(tiny_model_dir)
    rt = pipe.rt
    latents = fresh_rng.standard_normal((1, config.vae.latent_channels, 8, 8)).astype(np.float32)

    def decode(dtype, scale):
        ops = _recording_ops(pipe.vae.ops.twin(dtype))
        AutoencoderKL(config.vae, GPUWeights(rt, states["vae"], dtype), ops).decode(rt.upload(latents * scale, dtype))
        return ops.outputs

    scale, ref = 1.0, decode("f32", 1.0)
    for _ in range(4):  # group norms make the largest activation a sublinear function of the scale
        scale *= 1e4 / max(np.abs(y).max() for _, y in ref)
        ref = decode("f32", scale)
    assert 0.8e4 <= max(np.abs(y).max() for _, y in ref) <= 1.25e4
    half = decode("f16", scale)
    assert [n for n, _ in ref] == [n for n, _ in half] and len(ref) > 20
    rows = []
    for i, ((name, want), (_, got)) in enumerate(zip(ref, half, strict=True)):
        top = np.abs(want).max()
        rows.append((i, name, top, np.abs(got - want).max() / max(top, 1e-30), bool(np.isfinite(got).all())))
    print("layer | op | largest |activation| (f32) | f16 error relative to it | finite")
    for r in rows:
        print(f"{r[0]:3d} | {r[1]} | {r[2]:.3g} | {r[3]:.2e} | {r[4]}")
    assert all(r[4] for r in rows)
    worst = max(rows, key=lambda r: r[3])
    assert worst[3] <= 1e-2, f"layer {worst[0]} ({worst[1]}): f16 error {worst[3]:.2e} of its largest magnitude"


def test_unknown_residency_is_refused_naming_the_choices(tiny_model_dir, gpu):
    with pytest.raises(InputError, match="resident, staged"):
        engine.load_pipeline(tiny_model_dir, residency="lazy")


def test_an_image_in_halves_is_rounded_to_pixels_in_f32(fresh_rng):
    """A decoder in halves hands back f16 values (the plan executor reads its output buffer as
    it is): scaling them to 0..255 in f16, whose spacing near 255 is 0.125, moved pixels by one
    against the same values scaled in f32 (the eager decode upcasts first), so the two
    executors' images differed. Both now scale in f32."""
    from engine.pipeline import image_from_decoded

    decoded = fresh_rng.uniform(-1.1, 1.1, (1, 3, 64, 64)).astype(np.float16)
    np.testing.assert_array_equal(image_from_decoded(decoded), image_from_decoded(decoded.astype(np.float32)))
