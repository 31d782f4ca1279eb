"""DDIM (Song et al. 2021), deterministic (η = 0) as the SD pipelines run it: this file owns
its timestep list and the step from x_t to x_{t-Δ}.

Each step predicts the clean sample x̂_0 from ε and re-noises it to the previous timestep
along the same ε direction (eq. 12 of the paper with σ_t = 0). With η = 0 no noise is drawn,
so step() ignores ``rng``.

Notation
    T, n        training and inference step counts; Δ = T // n
    t, t_prev   current timestep and t - Δ (below 0: the final ᾱ, ᾱ_0 or 1)
    ᾱ_t         alphas_cumprod[t]
    ε           model output (predicted noise)
    x̂_0         predicted clean sample, optionally clipped to [-r, r] (clip_sample)
"""

from __future__ import annotations

import numpy as np

from engine.schedulers.base import Scheduler
from engine.schedulers.common import (
    add_noise_by_alpha_bar,
    alphas_cumprod,
    as_f32,
    check_num_inference_steps,
    check_timestep_spacing,
    make_betas,
    require_default,
    require_epsilon,
    spaced_timesteps,
)


class DDIMScheduler(Scheduler):
    order = 1

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_start: float = 0.0001,
        beta_end: float = 0.02,
        beta_schedule: str = "linear",
        trained_betas=None,
        clip_sample: bool = True,
        set_alpha_to_one: bool = True,
        steps_offset: int = 0,
        prediction_type: str = "epsilon",
        thresholding: bool = False,
        clip_sample_range: float = 1.0,
        timestep_spacing: str = "leading",
        rescale_betas_zero_snr: bool = False,
    ):
        require_epsilon(prediction_type)
        require_default("thresholding", thresholding, False)
        require_default("rescale_betas_zero_snr", rescale_betas_zero_snr, False)
        check_timestep_spacing(timestep_spacing)
        self.num_train_timesteps = int(num_train_timesteps)
        self.clip_sample = bool(clip_sample)
        self.clip_sample_range = float(clip_sample_range)
        self.steps_offset = int(steps_offset)
        self.timestep_spacing = timestep_spacing

        betas = make_betas(
            beta_schedule, beta_start, beta_end, self.num_train_timesteps, trained_betas
        )
        self.alphas_cumprod = alphas_cumprod(betas)  # (T,) float32
        self.final_alpha_cumprod = np.float32(1.0) if set_alpha_to_one else self.alphas_cumprod[0]
        self.init_noise_sigma = 1.0
        self.num_inference_steps: int | None = None
        self.timesteps = np.arange(self.num_train_timesteps, dtype=np.int64)[::-1].copy()

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps, self.num_train_timesteps)
        self.num_inference_steps = n
        self.timesteps = spaced_timesteps(
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
            round_linspace=True,
        ).astype(np.int64)

    def step(
        self,
        model_output: np.ndarray,
        timestep,
        sample: np.ndarray,
        rng: np.random.Generator | None = None,
    ) -> np.ndarray:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        eps = as_f32(model_output)
        x_t = as_f32(sample)
        t = int(timestep)
        # Δ is T // n whatever the spacing, as in diffusers (not the actual gap for
        # "linspace"/"trailing")
        t_prev = t - self.num_train_timesteps // self.num_inference_steps

        alpha_bar_t = self.alphas_cumprod[t]
        alpha_bar_prev = self.alphas_cumprod[t_prev] if t_prev >= 0 else self.final_alpha_cumprod
        beta_bar_t = np.float32(1.0) - alpha_bar_t

        x0_pred = (x_t - np.sqrt(beta_bar_t) * eps) / np.sqrt(alpha_bar_t)
        if self.clip_sample:
            r = np.float32(self.clip_sample_range)
            x0_pred = np.clip(x0_pred, -r, r)

        direction = np.sqrt(np.float32(1.0) - alpha_bar_prev) * eps  # toward x_{t_prev}
        return np.sqrt(alpha_bar_prev) * x0_pred + direction

    def add_noise(
        self, original: np.ndarray, noise: np.ndarray, timesteps: np.ndarray
    ) -> np.ndarray:
        return add_noise_by_alpha_bar(self.alphas_cumprod, original, noise, timesteps)
