"""PNDM, the pseudo linear multistep sampler of Liu et al. 2022 ("PLMS"), SD 1.x's default
scheduler: this file owns its timestep list, its history of noise predictions and the
transfer step between two timesteps.

Each step moves x_t to x_{t-Δ} with the DDIM-like transfer of the paper's eq. (9), fed not
with the latest ε but with an Adams-Bashforth combination ε' of the last four. Before four
predictions exist the method needs a warm-up. With skip_prk_steps (every SD 1.x config) the
first step is done twice, Heun-style: a trial step with ε(x_t, t), then the model at the
trial point, then the real step from x_t with the average of both. That second evaluation
is why the second timestep appears twice in ``timesteps``: for n = 5, 801 601 601 401 201 1.
Without skip_prk_steps the paper's warm-up runs: three Runge-Kutta steps of four model
calls each over half-steps.

Notation
    T, n        training and inference step counts; Δ = T // n, the nominal step
    t, t_prev   timestep of the current sample and of the one the step produces
    ᾱ_t         alphas_cumprod[t]; ᾱ_{t_prev} = ᾱ_0 (or 1 with set_alpha_to_one) below t = 0
    ε, ε'       the model's noise prediction and the multistep combination actually used
    history     the ε kept for the multistep formula, oldest first (at most 4)
"""

from __future__ import annotations

import numpy as np

from engine.schedulers.base import Scheduler
from engine.schedulers.common import AlphaBarSchedule, TrainingSchedule

PNDM_ORDER = 4  # the multistep formula uses the last four ε


class PNDMScheduler(AlphaBarSchedule, Scheduler):
    def __init__(
        self,
        schedule: TrainingSchedule = TrainingSchedule(),
        skip_prk_steps: bool = False,
        set_alpha_to_one: bool = False,
        timestep_spacing: str = "leading",
        steps_offset: int = 0,
    ):
        super().__init__(schedule, timestep_spacing, steps_offset)
        self.skip_prk_steps = bool(skip_prk_steps)
        self._init_alpha_bars(schedule, set_alpha_to_one)

    def set_timesteps(self, num_inference_steps: int) -> None:
        spaced = self._spaced_timesteps(num_inference_steps, round_linspace=True)
        ascending = spaced[::-1].astype(np.int64)
        n = self.num_inference_steps

        if self.skip_prk_steps:
            self.prk_timesteps = np.array([], dtype=np.int64)
            # the second-largest timestep twice: trial and corrected evaluation of the warm-up
            self.plms_timesteps = np.concatenate(
                [ascending[:-1], ascending[-2:-1], ascending[-1:]]
            )[::-1].copy()
        else:
            # each of the top PNDM_ORDER - 1 intervals is crossed by one RK4 step: model calls
            # at t, t - Δ/2 (twice) and t - Δ
            half_step = self.num_train_timesteps // n // 2
            ends = np.array(ascending[-PNDM_ORDER:]).repeat(2) + np.tile(
                np.array([0, half_step]), PNDM_ORDER
            )
            self.prk_timesteps = ends[:-1].repeat(2)[1:-1][::-1].copy()
            self.plms_timesteps = ascending[:-3][::-1].copy()

        self.timesteps = np.concatenate([self.prk_timesteps, self.plms_timesteps]).astype(np.int64)
        self._history: list[np.ndarray] = []
        self._counter = 0  # model outputs received since set_timesteps
        self._x_start: np.ndarray | None = None  # x_t the warm-up steps restart from
        self._rk_sum: np.ndarray | float = 0.0  # running RK4 weighted sum of ε

    def _step(self, eps: np.ndarray, timestep, sample: np.ndarray, rng) -> np.ndarray:
        if self.num_inference_steps is None:
            raise ValueError("call set_timesteps before step")
        timestep = int(timestep)
        if self._counter < len(self.prk_timesteps) and not self.skip_prk_steps:
            return self._step_runge_kutta(eps, timestep, sample)
        return self._step_multistep(eps, timestep, sample)

    def _step_runge_kutta(self, eps: np.ndarray, t: int, sample: np.ndarray) -> np.ndarray:
        # calls 0..3 of each RK4 step evaluate at t, t - Δ/2, t - Δ/2, t - Δ; every stage
        # starts again from the x_t of call 0
        stage = self._counter % 4
        half_step = self.num_train_timesteps // self.num_inference_steps // 2
        t_prev = t - (0 if self._counter % 2 else half_step)
        t_start = int(self.prk_timesteps[self._counter // 4 * 4])

        if stage == 0:
            self._rk_sum = self._rk_sum + (1 / 6) * eps
            self._history.append(eps)
            self._x_start = sample
        elif stage in (1, 2):
            self._rk_sum = self._rk_sum + (1 / 3) * eps
        else:
            eps = self._rk_sum + (1 / 6) * eps
            self._rk_sum = 0.0

        x_start = self._x_start if self._x_start is not None else sample
        prev_sample = self._transfer(x_start, t_start, t_prev, eps)
        self._counter += 1
        return prev_sample

    def _step_multistep(self, eps: np.ndarray, t: int, sample: np.ndarray) -> np.ndarray:
        if not self.skip_prk_steps and len(self._history) < 3:
            raise ValueError("PNDM without skip_prk_steps must run its Runge-Kutta steps first")
        delta = self.num_train_timesteps // self.num_inference_steps
        t_prev = t - delta
        if self._counter != 1:
            self._history = [*self._history[-3:], eps]
        else:
            # the corrector of the warm-up redoes the first interval: from t + Δ to t
            t_prev = t
            t = t + delta

        history = self._history
        if len(history) == 1 and self._counter == 0:
            eps_prime = eps
            self._x_start = sample
        elif len(history) == 1 and self._counter == 1:
            eps_prime = (eps + history[-1]) / 2
            sample = self._x_start
            self._x_start = None
        elif len(history) == 2:
            eps_prime = (3 * history[-1] - history[-2]) / 2
        elif len(history) == 3:
            eps_prime = (23 * history[-1] - 16 * history[-2] + 5 * history[-3]) / 12
        else:
            eps_prime = (1 / 24) * (
                55 * history[-1] - 59 * history[-2] + 37 * history[-3] - 9 * history[-4]
            )

        prev_sample = self._transfer(sample, t, t_prev, eps_prime)
        self._counter += 1
        return prev_sample

    def _transfer(self, x_t: np.ndarray, t: int, t_prev: int, eps: np.ndarray) -> np.ndarray:
        """Eq. (9) of the PNDM paper: x_t -> x_{t_prev} given ε, in float32."""
        alpha_bar_t = self.alphas_cumprod[t]
        alpha_bar_prev = self.alpha_bar_prev(t_prev)
        beta_bar_t = np.float32(1.0) - alpha_bar_t
        beta_bar_prev = np.float32(1.0) - alpha_bar_prev

        sample_coeff = np.sqrt(alpha_bar_prev / alpha_bar_t)
        eps_denominator = alpha_bar_t * np.sqrt(beta_bar_prev) + np.sqrt(
            alpha_bar_t * beta_bar_t * alpha_bar_prev
        )
        return sample_coeff * x_t - (alpha_bar_prev - alpha_bar_t) * eps / eps_denominator
