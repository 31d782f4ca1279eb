"""DPM-Solver++(2M) (Lu et al. 2022, "DPM-Solver++", algorithm 2): diffusers'
DPMSolverMultistepScheduler with algorithm_type "dpmsolver++", solver_order 2 and the
"midpoint" solver type. This file owns its timestep list, its history of data predictions
and the first- and second-order updates.

The solver works on the data prediction x̂_0 in half-log-SNR time λ. A step from λ_s to
λ_t is exact for the linear part and approximates x̂_0 as constant (first order) or linear
in λ through the previous two predictions (second order, "2M" = two-step multistep). The
first step has no history and the last one lands on σ = 0, where λ = +∞; both are
first-order. The scheduler name fixes the algorithm: algorithm_type, solver_order and
solver_type in a config are ignored.

Notation
    σ          sigmas[i], the VE noise level sqrt((1 - ᾱ) / ᾱ) at step i (0 after the last)
    α, σ_vp    1 / sqrt(1 + σ²) and σ α: the VP signal and noise scales, x = α x_0 + σ_vp ε
    λ          log α - log σ_vp, half the log signal-to-noise ratio
    s0, s1, t  the current step, the previous one, and the target (i, i - 1, i + 1)
    h, h_0     λ_t - λ_s0 and λ_s0 - λ_s1;  r0 = h_0 / h
    m0, m1     x̂_0 predicted at s0 and s1;  D1 = (m0 - m1) / r0
"""

from __future__ import annotations

import numpy as np

from engine.schedulers.base import Scheduler
from engine.schedulers.common import (
    StepIndex,
    TrainingSchedule,
    as_f32,
    check_num_inference_steps,
    inference_sigmas,
    per_sample,
    require_default,
    train_sigmas,
)

SOLVER_ORDER = 2


def vp_scales(sigma: np.float32) -> tuple[np.float32, np.float32]:
    """(α, σ_vp) for a VE σ, in float32."""
    alpha = np.float32(1.0) / np.sqrt(sigma * sigma + np.float32(1.0))
    return alpha, sigma * alpha


def half_log_snr(sigma: np.float32) -> np.float32:
    alpha, sigma_vp = vp_scales(sigma)
    with np.errstate(divide="ignore"):  # σ = 0 at the end: λ = +inf, and exp(-h) = 0
        return np.log(alpha) - np.log(sigma_vp)


class DPMSolverMultistepScheduler(StepIndex, Scheduler):
    def __init__(
        self,
        schedule: TrainingSchedule = TrainingSchedule(),
        thresholding: bool = False,
        lower_order_final: bool = True,
        euler_at_final: bool = False,
        use_karras_sigmas: bool = False,
        use_exponential_sigmas: bool = False,
        use_beta_sigmas: bool = False,
        use_lu_lambdas: bool = False,
        use_flow_sigmas: bool = False,
        final_sigmas_type: str = "zero",
        lambda_min_clipped: float = -float("inf"),
        variance_type: str | None = None,
        timestep_spacing: str = "linspace",
        steps_offset: int = 0,
        rescale_betas_zero_snr: bool = False,
    ):
        require_default("thresholding", thresholding, False)
        for key, value in (
            ("use_karras_sigmas", use_karras_sigmas),
            ("use_exponential_sigmas", use_exponential_sigmas),
            ("use_beta_sigmas", use_beta_sigmas),
            ("use_lu_lambdas", use_lu_lambdas),
            ("use_flow_sigmas", use_flow_sigmas),
            ("rescale_betas_zero_snr", rescale_betas_zero_snr),
        ):
            require_default(key, bool(value), False)
        require_default("final_sigmas_type", final_sigmas_type, "zero")
        require_default("variance_type", variance_type, None)
        super().__init__(schedule, timestep_spacing, steps_offset)
        self.lower_order_final = bool(lower_order_final)
        self.euler_at_final = bool(euler_at_final)
        self.final_sigmas_type = final_sigmas_type

        alpha_bar = schedule.alpha_bars()
        self.sigmas_by_t = train_sigmas(alpha_bar)
        # timesteps whose λ falls below lambda_min_clipped are cut off the top of the range
        lambda_by_t = np.log(np.sqrt(alpha_bar)) - np.log(np.sqrt(np.float32(1.0) - alpha_bar))
        clipped = int(np.searchsorted(lambda_by_t[::-1], lambda_min_clipped, side="left"))
        self.last_timestep = self.num_train_timesteps - clipped

        self.init_noise_sigma = 1.0
        self._start_at_training_timesteps(np.int64)

    def set_timesteps(self, num_inference_steps: int) -> None:
        n = check_num_inference_steps(num_inference_steps, self.num_train_timesteps)
        # n + 1 points spread over the range, the one at t = 0 dropped: unlike DDIM's spacing
        if self.timestep_spacing == "linspace":
            timesteps = np.linspace(0, self.last_timestep - 1, n + 1).round()[::-1][:-1]
        elif self.timestep_spacing == "leading":
            step_ratio = self.last_timestep // (n + 1)
            timesteps = (np.arange(n + 1) * step_ratio)[::-1][:-1] + self.steps_offset
        else:
            step_ratio = self.num_train_timesteps / n
            timesteps = np.arange(self.last_timestep, 0, -step_ratio).round() - 1
        self.timesteps = np.ascontiguousarray(timesteps).astype(np.int64)
        self.sigmas = inference_sigmas(self.timesteps, self.sigmas_by_t)
        self.num_inference_steps = len(self.timesteps)

        self._data_predictions: list[np.ndarray | None] = [None] * SOLVER_ORDER  # oldest first
        self._lower_order_nums = 0  # steps taken so far, capped at SOLVER_ORDER
        self._reset_step_index()

    def _index_of_unknown_timestep(self, timestep) -> int:
        return len(self.timesteps) - 1  # diffusers reads a timestep off the schedule as "the end"

    def _step(self, eps: np.ndarray, timestep, x: np.ndarray, rng) -> np.ndarray:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        if self._step_index is None:
            self._init_step_index(timestep)
        i = self._step_index

        # with final σ = 0 the last step is always first order; lower_order_final and
        # euler_at_final only matter for the σ_min ending the engine does not offer
        is_last = i == len(self.timesteps) - 1
        first_order_final = is_last and (
            self.euler_at_final
            or (self.lower_order_final and len(self.timesteps) < 15)
            or self.final_sigmas_type == "zero"
        )

        alpha_s0, sigma_vp_s0 = vp_scales(self.sigmas[i])
        x0_pred = (x - sigma_vp_s0 * eps) / alpha_s0
        self._data_predictions = [*self._data_predictions[1:], x0_pred]

        if self._lower_order_nums < 1 or first_order_final:
            prev_sample = self._first_order_update(x0_pred, x)
        else:
            prev_sample = self._second_order_update(x)

        self._lower_order_nums = min(self._lower_order_nums + 1, SOLVER_ORDER)
        self._step_index += 1
        return prev_sample

    def _first_order_update(self, x0_pred: np.ndarray, x: np.ndarray) -> np.ndarray:
        """DPM-Solver++(1), i.e. DDIM in λ: x_t = (σ_t / σ_s) x - α_t (e^{-h} - 1) x̂_0."""
        i = self._step_index
        sigma_t, sigma_s = self.sigmas[i + 1], self.sigmas[i]
        alpha_t, sigma_vp_t = vp_scales(sigma_t)
        _, sigma_vp_s = vp_scales(sigma_s)
        h = half_log_snr(sigma_t) - half_log_snr(sigma_s)
        return (sigma_vp_t / sigma_vp_s) * x - (alpha_t * (np.exp(-h) - np.float32(1.0))) * x0_pred

    def _second_order_update(self, x: np.ndarray) -> np.ndarray:
        """DPM-Solver++(2M), midpoint form: the first-order step plus half the D1 correction."""
        i = self._step_index
        sigma_t, sigma_s0, sigma_s1 = self.sigmas[i + 1], self.sigmas[i], self.sigmas[i - 1]
        alpha_t, sigma_vp_t = vp_scales(sigma_t)
        _, sigma_vp_s0 = vp_scales(sigma_s0)
        lambda_t, lambda_s0, lambda_s1 = (
            half_log_snr(sigma_t),
            half_log_snr(sigma_s0),
            half_log_snr(sigma_s1),
        )
        m0, m1 = self._data_predictions[-1], self._data_predictions[-2]
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        d1 = (np.float32(1.0) / r0) * (m0 - m1)
        phi = alpha_t * (np.exp(-h) - np.float32(1.0))  # α_t (e^{-h} - 1), negative
        return (sigma_vp_t / sigma_vp_s0) * x - phi * m0 - np.float32(0.5) * phi * d1

    def add_noise(
        self, original: np.ndarray, noise: np.ndarray, timesteps: np.ndarray
    ) -> np.ndarray:
        """x_t = α x_0 + σ_vp ε at the σ of each timestep (or of the begin index)."""
        sigma = self.sigmas[self._noise_indices(timesteps)]
        alpha, sigma_vp = vp_scales(sigma)
        ndim = np.ndim(original)
        return per_sample(alpha, ndim) * as_f32(original) + per_sample(
            sigma_vp, ndim
        ) * as_f32(noise)
