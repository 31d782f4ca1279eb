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
from engine.schedulers.common import AlphaBarSchedule, TrainingSchedule, require_default


class DDIMScheduler(AlphaBarSchedule, Scheduler):
    def __init__(
        self,
        schedule: TrainingSchedule = TrainingSchedule(),
        clip_sample: bool = True,
        set_alpha_to_one: bool = True,
        steps_offset: int = 0,
        thresholding: bool = False,
        clip_sample_range: float = 1.0,
        timestep_spacing: str = "leading",
        rescale_betas_zero_snr: bool = False,
    ):
        require_default("thresholding", thresholding, False)
        require_default("rescale_betas_zero_snr", rescale_betas_zero_snr, False)
        super().__init__(schedule, timestep_spacing, steps_offset)
        self.clip_sample = bool(clip_sample)
        self.clip_sample_range = float(clip_sample_range)
        self._init_alpha_bars(schedule, set_alpha_to_one)

    def set_timesteps(self, num_inference_steps: int) -> None:
        spaced = self._spaced_timesteps(num_inference_steps, round_linspace=True)
        self.timesteps = spaced.astype(np.int64)

    def _step(self, eps: np.ndarray, timestep, x_t: np.ndarray, rng) -> np.ndarray:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        t = int(timestep)
        # Δ is T // n whatever the spacing, as in diffusers (not the actual gap for
        # "linspace"/"trailing")
        t_prev = t - self.num_train_timesteps // self.num_inference_steps

        alpha_bar_t = self.alphas_cumprod[t]
        alpha_bar_prev = self.alpha_bar_prev(t_prev)
        beta_bar_t = np.float32(1.0) - alpha_bar_t

        x0_pred = (x_t - np.sqrt(beta_bar_t) * eps) / np.sqrt(alpha_bar_t)
        if self.clip_sample:
            r = np.float32(self.clip_sample_range)
            x0_pred = np.clip(x0_pred, -r, r)

        direction = np.sqrt(np.float32(1.0) - alpha_bar_prev) * eps  # toward x_{t_prev}
        return np.sqrt(alpha_bar_prev) * x0_pred + direction
