"""The three networks against diffusers/transformers on the tiny model, from the goldens in
tests/golden/tiny_model.npz (made by tests/golden/make_goldens.py).

Tolerance, stated by the product: ||out - ref|| / ||ref|| <= 1e-4 in fp32, <= 2e-2 in fp16."""

from __future__ import annotations

import numpy as np
import pytest
from ci_support import F16_HINT, missing

pytestmark = pytest.mark.gpu

TOL = {"fp32": 1e-4, "fp16": 2e-2}


def rel_err(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module", params=["fp32", "fp16"])
def pipe(request, tiny_model_dir, gpu):
    import engine

    if request.param == "fp16" and not gpu.caps.has_f16:
        missing("adapter lacks shader-f16", F16_HINT)
    return engine.load_pipeline(tiny_model_dir, precision=request.param)


def test_text_encoder(pipe, golden):
    out = pipe.encode_text(golden["te_input_ids"])
    assert out.dtype == np.float32 and out.shape == golden["te_last_hidden_state"].shape
    assert rel_err(out, golden["te_last_hidden_state"]) <= TOL[pipe.precision]


@pytest.mark.parametrize("case", ["unet", "unet_odd"])
def test_unet(pipe, golden, case):
    out = pipe.unet(golden[f"{case}_sample"], golden["unet_timesteps"], golden["unet_encoder_hidden_states"])
    assert out.shape == golden[f"{case}_out"].shape
    assert rel_err(out, golden[f"{case}_out"]) <= TOL[pipe.precision]


def test_unet_scalar_timestep_broadcasts(pipe, golden):
    sample, ctx = golden["unet_sample"], golden["unet_encoder_hidden_states"]
    both = pipe.unet(sample, 10, ctx)
    one = pipe.unet(sample[1:], np.array([10]), ctx[1:])
    assert np.allclose(both[1:], one, rtol=1e-5, atol=1e-6 if pipe.precision == "fp32" else 1e-3)


def test_vae_decode(pipe, golden):
    out = pipe.decode(golden["vae_dec_latents"])
    assert out.shape == (1, 3, 64, 64)
    assert rel_err(out, golden["vae_dec_image"]) <= TOL[pipe.precision]


def test_vae_encode(pipe, golden):
    mean, logvar = pipe.encode_image(golden["vae_enc_image"])
    assert rel_err(mean, golden["vae_enc_mean"]) <= TOL[pipe.precision]
    assert rel_err(logvar, golden["vae_enc_logvar"]) <= TOL[pipe.precision]


def test_tokenize_matches_transformers(pipe, golden):
    assert np.array_equal(pipe.tokenize(list(golden["tok_prompts"])), golden["tok_ids"])
