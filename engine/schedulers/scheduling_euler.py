"""Euler's method on the probability-flow ODE in σ (Karras et al. 2022, algorithm 2 without
churn), diffusers' EulerDiscreteScheduler: this file owns its options and its step; the σ
list, input scaling and step counter come from common.SigmaSchedule.

dx/dσ = (x - x̂_0) / σ, with x̂_0 = x - σ ε; one step moves σ_i to σ_{i+1}. The last σ is 0,
so the final step lands on x̂_0.

Notation
    σ_i, σ_{i+1}   sigma of the current sample and of the one the step produces
    ε              model output (predicted noise) for the scaled input x / sqrt(σ_i² + 1)
    x̂_0            predicted clean sample
    d              the ODE derivative (x - x̂_0) / σ_i
"""

from __future__ import annotations

import numpy as np

from engine.schedulers.base import Scheduler
from engine.schedulers.common import SigmaSchedule, TrainingSchedule, require_default


class EulerDiscreteScheduler(SigmaSchedule, Scheduler):
    def __init__(
        self,
        schedule: TrainingSchedule = TrainingSchedule(),
        interpolation_type: str = "linear",
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        timestep_spacing: str = "linspace",
        steps_offset: int = 0,
        rescale_betas_zero_snr: bool = False,
        final_sigmas_type: str = "zero",
    ):
        # timestep_type "continuous" only changes v-prediction models, which TrainingSchedule refuses
        require_default("interpolation_type", interpolation_type, "linear")
        require_default("use_karras_sigmas", bool(use_karras_sigmas), False)
        require_default("use_exponential_sigmas", bool(use_exponential_sigmas), False)
        require_default("use_beta_sigmas", bool(use_beta_sigmas), False)
        require_default("rescale_betas_zero_snr", rescale_betas_zero_snr, False)
        require_default("final_sigmas_type", final_sigmas_type, "zero")
        super().__init__(schedule, timestep_spacing, steps_offset)
        self._init_sigmas(schedule)

    def _step(self, eps: np.ndarray, timestep, x: np.ndarray, rng) -> np.ndarray:
        if self._step_index is None:
            self._init_step_index(timestep)
        sigma = self.sigmas[self._step_index]
        sigma_next = self.sigmas[self._step_index + 1]

        # the round trip through x̂_0 looks redundant (d == ε in exact arithmetic) but
        # diffusers rounds that way, and the last bits must agree
        x0_pred = x - sigma * eps
        d = (x - x0_pred) / sigma
        prev_sample = x + d * (sigma_next - sigma)

        self._step_index += 1
        return prev_sample
