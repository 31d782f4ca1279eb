"""Euler ancestral (Karras et al. 2022's ancestral sampling in σ, k-diffusion's
sample_euler_ancestral), diffusers' EulerAncestralDiscreteScheduler: this file owns its step;
the σ list, input scaling and step counter come from common.SigmaSchedule.

Each step splits the move σ_i -> σ_{i+1} into a deterministic Euler step down to σ_down and
fresh Gaussian noise of standard deviation σ_up, with σ_down² + σ_up² = σ_{i+1}², so the
marginal noise level is right while part of the noise is renewed each step (DDPM-like).
The noise is one ``rng.standard_normal(shape, dtype=float32)`` draw per step, the last step
included (its σ_up is 0), matching diffusers' one randn_tensor call per step.

Notation
    σ_i, σ_{i+1}   sigma of the current sample and of the target
    σ_up           std of the noise added: sqrt(σ_{i+1}² (σ_i² - σ_{i+1}²) / σ_i²)
    σ_down         sigma reached by the deterministic part: sqrt(σ_{i+1}² - σ_up²)
    ε, x̂_0, d      model output, predicted clean sample, ODE derivative (x - x̂_0) / σ_i
"""

from __future__ import annotations

import numpy as np

from engine.schedulers.base import Scheduler
from engine.schedulers.common import SigmaSchedule, TrainingSchedule, require_default


class EulerAncestralDiscreteScheduler(SigmaSchedule, Scheduler):
    def __init__(
        self,
        schedule: TrainingSchedule = TrainingSchedule(),
        timestep_spacing: str = "linspace",
        steps_offset: int = 0,
        rescale_betas_zero_snr: bool = False,
    ):
        require_default("rescale_betas_zero_snr", rescale_betas_zero_snr, False)
        super().__init__(schedule, timestep_spacing, steps_offset)
        self._init_sigmas(schedule)

    def _step(self, eps: np.ndarray, timestep, x: np.ndarray, rng) -> np.ndarray:
        if rng is None:
            raise ValueError(
                "euler_ancestral draws fresh noise every step: pass a numpy Generator as rng"
            )
        if self._step_index is None:
            self._init_step_index(timestep)
        sigma = self.sigmas[self._step_index]
        sigma_next = self.sigmas[self._step_index + 1]

        x0_pred = x - sigma * eps
        sigma2, sigma_next2 = sigma * sigma, sigma_next * sigma_next
        sigma_up = np.sqrt(sigma_next2 * (sigma2 - sigma_next2) / sigma2)
        sigma_down = np.sqrt(sigma_next2 - sigma_up * sigma_up)
        d = (x - x0_pred) / sigma
        prev_sample = x + d * (sigma_down - sigma)

        noise = rng.standard_normal(eps.shape, dtype=np.float32)
        prev_sample = prev_sample + noise * sigma_up

        self._step_index += 1
        return prev_sample
