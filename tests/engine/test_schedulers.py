"""The engine's schedulers against diffusers 0.42 (golden data from
tests/golden/make_scheduler_goldens.py), and their refusals of bad input.

Trajectories run closed loop, as the pipeline does: the engine steps its own samples, fed the
recorded model outputs, and every scaled input and step result is compared. Tolerance: max
abs difference <= 1e-5 * (1 + max abs of the reference); timesteps must be equal, dtype
included.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.errors import InputError, UnsupportedModelError
from engine.schedulers import SCHEDULERS, make_scheduler

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "golden" / "schedulers.npz"
RTOL = 1e-5

SD14 = {
    "_class_name": "PNDMScheduler",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
}


def _load_golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN_PATH) as npz:
        return {key: npz[key] for key in npz.files}


GOLDEN = _load_golden()
CASES = sorted(
    {tuple(key.split("/")[:3]) for key in GOLDEN if not key.startswith(("meta/", "config/"))}
)


def golden_case(variant: str, name: str, case: str) -> dict[str, np.ndarray]:
    prefix = f"{variant}/{name}/{case}/"
    return {
        key.removeprefix(prefix): value for key, value in GOLDEN.items() if key.startswith(prefix)
    }


def golden_config(variant: str) -> dict:
    return json.loads(str(GOLDEN[f"config/{variant}"]))


def assert_close(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}, expected float32"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = float(np.max(np.abs(actual.astype(np.float64) - expected)))
    bound = RTOL * (1.0 + float(np.max(np.abs(expected))))
    assert diff <= bound, f"{what}: max abs diff {diff:.3g} > {bound:.3g}"


def assert_same_timesteps(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == expected.dtype, f"timesteps dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(actual, expected)


def run_trajectory(scheduler, golden: dict[str, np.ndarray], timesteps: np.ndarray) -> None:
    rng = np.random.default_rng(int(golden["noise_seed"]))
    sample = golden["sample0"]
    for i, t in enumerate(timesteps):
        model_input = scheduler.scale_model_input(sample, t)
        assert_close(
            np.asarray(model_input), golden["model_input"][i], f"step {i} (t={t}) model input"
        )
        sample = scheduler.step(golden["model_output"][i], t, sample, rng=rng)
        assert_close(sample, golden["prev_sample"][i], f"step {i} (t={t}) prev sample")


@pytest.mark.parametrize("variant,name,case", CASES, ids=["/".join(c) for c in CASES])
def test_matches_diffusers(variant: str, name: str, case: str) -> None:
    golden = golden_case(variant, name, case)
    scheduler = make_scheduler(name, golden_config(variant))

    if case.startswith("steps"):
        scheduler.set_timesteps(int(case.removeprefix("steps")))
        assert_same_timesteps(scheduler.timesteps, golden["timesteps"])
        expected_sigma = float(golden["init_noise_sigma"])
        assert isinstance(scheduler.init_noise_sigma, float)
        assert abs(scheduler.init_noise_sigma - expected_sigma) <= RTOL * (1 + expected_sigma)
        run_trajectory(scheduler, golden, scheduler.timesteps)

    elif case == "img2img":
        timesteps = scheduler.img2img_timesteps(int(golden["steps"]), float(golden["strength"]))
        assert_same_timesteps(timesteps, golden["timesteps"])
        noisy = scheduler.add_noise(golden["original"], golden["image_noise"], timesteps[:1])
        assert_close(noisy, golden["sample0"], "img2img add_noise")
        run_trajectory(scheduler, golden, timesteps)

    elif case == "add_noise":
        scheduler.set_timesteps(int(golden["steps"]))
        noisy = scheduler.add_noise(golden["original"], golden["image_noise"], golden["timesteps"])
        assert_close(noisy, golden["noisy"], "add_noise")

    else:
        pytest.fail(f"unknown golden case {case!r}")


def test_golden_covers_every_scheduler() -> None:
    assert {name for _, name, _ in CASES} == set(SCHEDULERS)


def test_ancestral_noise_is_one_draw_per_step() -> None:
    # the golden's patched randn_tensor counted its calls; the engine draws once per step
    for variant, name, case in CASES:
        golden = golden_case(variant, name, case)
        if name == "euler_ancestral" and "prev_sample" in golden:
            assert int(golden["noise_draws"]) == len(golden["prev_sample"])


def test_unknown_scheduler_name_lists_valid_ones() -> None:
    with pytest.raises(InputError) as excinfo:
        make_scheduler("lms", SD14)
    message = str(excinfo.value)
    assert "'lms'" in message
    for name in SCHEDULERS:
        assert name in message


@pytest.mark.parametrize("name", SCHEDULERS)
def test_v_prediction_is_refused(name: str) -> None:
    with pytest.raises(UnsupportedModelError, match="v_prediction"):
        make_scheduler(name, {**SD14, "prediction_type": "v_prediction"})


@pytest.mark.parametrize("name", SCHEDULERS)
@pytest.mark.parametrize("steps", [0, -3])
def test_step_count_below_one_is_refused(name: str, steps: int) -> None:
    scheduler = make_scheduler(name, SD14)
    with pytest.raises(InputError, match=str(steps)):
        scheduler.set_timesteps(steps)


@pytest.mark.parametrize("name", SCHEDULERS)
def test_step_count_above_training_range_is_refused(name: str) -> None:
    with pytest.raises(InputError, match="1001"):
        make_scheduler(name, SD14).set_timesteps(1001)


def test_ancestral_step_without_rng_raises() -> None:
    scheduler = make_scheduler("euler_ancestral", SD14)
    scheduler.set_timesteps(5)
    t = scheduler.timesteps[0]
    sample = np.zeros((1, 4, 2, 2), np.float32)
    with pytest.raises(ValueError, match="rng"):
        scheduler.step(sample, t, scheduler.scale_model_input(sample, t))


@pytest.mark.parametrize(
    "name,key,value",
    [
        ("euler", "use_karras_sigmas", True),
        ("dpmpp_2m", "use_karras_sigmas", True),
        ("ddim", "thresholding", True),
        ("euler", "timestep_spacing", "sometimes"),
        ("pndm", "beta_schedule", "sigmoid"),
    ],
)
def test_unimplemented_config_options_are_refused(name: str, key: str, value) -> None:
    with pytest.raises(UnsupportedModelError, match=key):
        make_scheduler(name, {**SD14, key: value})


def test_keys_diffusers_filled_with_defaults_are_dropped() -> None:
    # a config saved from a loaded PNDM scheduler lists the keys its file lacked; Euler
    # must then use its own timestep_spacing default, not the PNDM one written out
    config = {**SD14, "_use_default_values": ["timestep_spacing", "prediction_type"]}
    scheduler = make_scheduler("euler", config)
    scheduler.set_timesteps(20)
    assert scheduler.timesteps[0] == np.float32(999.0)
    assert make_scheduler("pndm", config).timestep_spacing == "leading"


@pytest.mark.parametrize("strength", [-0.1, 1.5])
def test_img2img_strength_out_of_range_is_refused(strength: float) -> None:
    with pytest.raises(InputError, match=str(strength)):
        make_scheduler("ddim", SD14).img2img_timesteps(10, strength)


def test_img2img_with_no_step_left_is_refused() -> None:
    with pytest.raises(InputError, match="0.05"):
        make_scheduler("euler", SD14).img2img_timesteps(10, 0.05)


def test_img2img_full_strength_starts_at_the_top() -> None:
    scheduler = make_scheduler("dpmpp_2m", SD14)
    timesteps = scheduler.img2img_timesteps(10, 1.0)
    assert_same_timesteps(timesteps, scheduler.timesteps)
    assert scheduler.begin_index == 0
