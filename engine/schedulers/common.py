"""What every scheduler here shares: the training noise schedule (betas and their cumulative
product), the spacing of inference timesteps over the training range, the step counter of
the sigma-based schedulers, and the checks that refuse configs the engine cannot honour.

The arithmetic follows diffusers' float32 torch conventions, not textbook float64, because
the engine must agree with diffusers to ~1e-6: where diffusers builds a float32 tensor, so
do we, rounding at the same places. Bit equality is not reachable: torch's CPU sqrt, log
and exp (MKL) are not correctly rounded, and differ between CPUs, so the last bit wanders.

Notation
    T        num_train_timesteps, the length of the training schedule (1000 for SD)
    n        num_inference_steps
    β_t      betas[t], the noise added by training step t
    ᾱ_t      alphas_cumprod[t] = Π_{s<=t} (1 - β_s), the signal fraction left at t
    σ_t      sqrt((1 - ᾱ_t) / ᾱ_t), the noise-to-signal ratio of the VE view (Euler, DPM)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import InputError, UnsupportedModelError

TIMESTEP_SPACINGS = ("linspace", "leading", "trailing")
BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


def as_f32(x):
    """A tensor argument as float32, as step() computes in; a symbolic tensor (the loop
    programs of engine.schedulers.program, which know their own dtype) passes through."""
    return x if getattr(x, "symbolic", False) else np.asarray(x, dtype=np.float32)


def require_epsilon(prediction_type: str) -> None:
    """SD 1.x predicts noise; v-prediction (SD 2.x 768) and x0-prediction are not run."""
    if prediction_type != "epsilon":
        raise UnsupportedModelError(
            f"scheduler config prediction_type={prediction_type!r} is not supported: the "
            f"engine runs epsilon-prediction models (Stable Diffusion 1.x) only"
        )


def require_default(key: str, value, supported) -> None:
    """Refuse a config option the engine does not implement instead of silently ignoring it."""
    if value != supported:
        raise UnsupportedModelError(
            f"scheduler config {key}={value!r} is not supported by the engine (only {supported!r})"
        )


def check_timestep_spacing(timestep_spacing: str) -> None:
    if timestep_spacing not in TIMESTEP_SPACINGS:
        raise UnsupportedModelError(
            f"scheduler config timestep_spacing={timestep_spacing!r} is not supported; "
            f"expected one of {', '.join(TIMESTEP_SPACINGS)}"
        )


def check_num_inference_steps(num_inference_steps, num_train_timesteps: int) -> int:
    if isinstance(num_inference_steps, bool) or not isinstance(
        num_inference_steps, int | np.integer
    ):
        raise InputError(f"steps must be an integer, got {num_inference_steps!r}")
    if not 1 <= num_inference_steps <= num_train_timesteps:
        raise InputError(
            f"steps must be between 1 and {num_train_timesteps} (the model's training "
            f"timesteps), got {num_inference_steps}"
        )
    return int(num_inference_steps)


def linspace_f32(start: float, end: float, count: int) -> np.ndarray:
    """torch.linspace(start, end, count, dtype=float32) bit for bit.

    torch steps in float32 from both ends towards the middle with a fused multiply-add;
    np.linspace works in float64 from the start only, which differs in the last bit for a
    third of the SD betas. The product of two float32 numbers is exact in float64, so one
    float64 add and one rounding to float32 reproduce the fused operation.
    """
    start32, end32 = np.float32(start), np.float32(end)
    step = (end32 - start32) / np.float32(max(count - 1, 1))
    index = np.arange(count, dtype=np.float64)
    from_start = np.float64(start32) + np.float64(step) * index
    from_end = np.float64(end32) - np.float64(step) * (count - 1 - index)
    return np.where(index < count // 2, from_start, from_end).astype(np.float32)


def _cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> np.ndarray:
    """Nichol & Dhariwal's squared-cosine ᾱ(t), discretised into per-step betas."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [
        min(
            1 - alpha_bar((i + 1) / num_train_timesteps) / alpha_bar(i / num_train_timesteps),
            max_beta,
        )
        for i in range(num_train_timesteps)
    ]
    return np.asarray(betas, dtype=np.float32)


def make_betas(
    beta_schedule: str,
    beta_start: float,
    beta_end: float,
    num_train_timesteps: int,
    trained_betas=None,
) -> np.ndarray:
    """β_t for t in [0, T), float32."""
    if trained_betas is not None:
        return np.asarray(trained_betas, dtype=np.float32)
    if beta_schedule == "linear":
        return linspace_f32(beta_start, beta_end, num_train_timesteps)
    if beta_schedule == "scaled_linear":
        # linear in sqrt(β): what latent diffusion was trained with
        root = linspace_f32(beta_start**0.5, beta_end**0.5, num_train_timesteps)
        return root * root
    if beta_schedule == "squaredcos_cap_v2":
        return _cosine_betas(num_train_timesteps)
    raise UnsupportedModelError(
        f"scheduler config beta_schedule={beta_schedule!r} is not supported; "
        f"expected one of {', '.join(BETA_SCHEDULES)}"
    )


def alphas_cumprod(betas: np.ndarray) -> np.ndarray:
    """ᾱ_t as float32. torch.cumprod on the CPU accumulates float32 in float64 and rounds
    each partial product once; a float32 accumulator drifts by up to 1e-6 over 1000 steps."""
    return np.cumprod((np.float32(1.0) - betas).astype(np.float64)).astype(np.float32)


@dataclass(frozen=True)
class TrainingSchedule:
    """How the model was trained: the noise schedule, and what the network learned to predict
    from it. These are the six scheduler_config.json keys every diffusers scheduler takes,
    with diffusers' defaults. Scheduler.from_config fills it from the config; each
    scheduler's own options stay its own arguments."""

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: object = None
    prediction_type: str = "epsilon"

    def __post_init__(self) -> None:
        require_epsilon(self.prediction_type)
        object.__setattr__(self, "num_train_timesteps", int(self.num_train_timesteps))

    def alpha_bars(self) -> np.ndarray:
        """ᾱ_t for t in [0, T), float32."""
        betas = make_betas(
            self.beta_schedule,
            self.beta_start,
            self.beta_end,
            self.num_train_timesteps,
            self.trained_betas,
        )
        return alphas_cumprod(betas)


def training_timesteps(num_train_timesteps: int, dtype) -> np.ndarray:
    """Every training timestep, largest first: the schedule before set_timesteps, as
    diffusers starts out."""
    return np.arange(num_train_timesteps, dtype=dtype)[::-1].copy()


def spaced_timesteps(
    timestep_spacing: str,
    num_train_timesteps: int,
    num_inference_steps: int,
    steps_offset: int,
    *,
    round_linspace: bool,
) -> np.ndarray:
    """The n inference timesteps, largest first, as float64 (callers pick the dtype).

    Spacings (Lin et al. 2023, table 2): "leading" takes multiples of T // n from 0 and
    shifts them by steps_offset (SD 1.x: 1, so 50 steps run 981 ... 1); "trailing" counts
    down from T - 1 in steps of T / n; "linspace" spreads n points evenly over [0, T - 1],
    rounded for the integer-timestep schedulers (DDIM, PNDM) and left fractional for Euler.
    """
    check_timestep_spacing(timestep_spacing)
    if timestep_spacing == "leading":
        step_ratio = num_train_timesteps // num_inference_steps
        timesteps = (np.arange(num_inference_steps) * step_ratio)[::-1] + steps_offset
    elif timestep_spacing == "trailing":
        step_ratio = num_train_timesteps / num_inference_steps
        timesteps = np.round(np.arange(num_train_timesteps, 0, -step_ratio)) - 1
    else:
        timesteps = np.linspace(0, num_train_timesteps - 1, num_inference_steps)[::-1]
        if round_linspace:
            timesteps = timesteps.round()
    return np.ascontiguousarray(timesteps, dtype=np.float64)


def train_sigmas(alphas_cumprod: np.ndarray) -> np.ndarray:
    """σ_t for every training timestep, float32, indexed by t."""
    return np.sqrt((np.float32(1.0) - alphas_cumprod) / alphas_cumprod)


def inference_sigmas(timesteps: np.ndarray, sigmas_by_t: np.ndarray) -> np.ndarray:
    """σ at each inference timestep, then 0 for the clean end point; float32, length n + 1.

    Fractional timesteps (Euler's "linspace") interpolate σ linearly in t, in float64,
    before the single rounding to float32.
    """
    sigmas = np.interp(timesteps, np.arange(len(sigmas_by_t)), sigmas_by_t)
    return np.concatenate([sigmas, [0.0]]).astype(np.float32)


def per_sample(coefficient: np.ndarray, ndim: int) -> np.ndarray:
    """Shape a (B,) vector of per-sample factors to broadcast over (B, C, H, W)."""
    coefficient = np.asarray(coefficient).reshape(-1)
    return coefficient.reshape(coefficient.shape[0], *([1] * (ndim - 1)))


class AlphaBarSchedule:
    """The ᾱ parameterisation shared by DDIM and PNDM: integer timesteps ("linspace"
    rounded), and steps from t to t_prev that read ᾱ at both ends; below t = 0 they read the
    final ᾱ, 1 with set_alpha_to_one, else ᾱ_0.

    Subclasses call Scheduler.__init__, then _init_alpha_bars.
    """

    num_train_timesteps: int
    alphas_cumprod: np.ndarray  # (T,) ᾱ_t float32

    def _init_alpha_bars(self, schedule: TrainingSchedule, set_alpha_to_one: bool) -> None:
        self.alphas_cumprod = schedule.alpha_bars()
        self.final_alpha_cumprod = np.float32(1.0) if set_alpha_to_one else self.alphas_cumprod[0]
        self.init_noise_sigma = 1.0
        self.timesteps = training_timesteps(self.num_train_timesteps, np.int64)

    def alpha_bar_prev(self, t_prev: int) -> np.float32:
        return self.alphas_cumprod[t_prev] if t_prev >= 0 else self.final_alpha_cumprod

    def add_noise(
        self, original: np.ndarray, noise: np.ndarray, timesteps: np.ndarray
    ) -> np.ndarray:
        """x_t = sqrt(ᾱ_t) x_0 + sqrt(1 - ᾱ_t) ε, one t per sample of the batch (DDPM forward)."""
        alpha_bar = self.alphas_cumprod[np.asarray(timesteps, dtype=np.int64)]
        ndim = np.ndim(original)
        signal = per_sample(np.sqrt(alpha_bar), ndim)
        noise_scale = per_sample(np.sqrt(np.float32(1.0) - alpha_bar), ndim)
        return signal * as_f32(original) + noise_scale * as_f32(noise)


class StepIndex:
    """The step counter of schedulers that walk a σ list by position (Euler, DPM-Solver).

    diffusers finds the position from the first timestep it is given, unless a begin index
    was set (img2img), and then counts one per step(). When a timestep occurs twice in the
    schedule, the search picks the second occurrence, so that an img2img run starting in the
    middle does not skip a σ.
    """

    num_train_timesteps: int
    timesteps: np.ndarray
    sigmas_by_t: np.ndarray  # (T,) σ_t float32
    sigmas: np.ndarray  # (n + 1,) σ at each inference timestep, then 0
    _step_index: int | None = None
    _begin_index: int | None = None

    @property
    def step_index(self) -> int | None:
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        return self._begin_index

    def set_begin_index(self, begin_index: int) -> None:
        self._begin_index = int(begin_index)

    def _reset_step_index(self) -> None:
        self._step_index = None
        self._begin_index = None

    def index_for_timestep(self, timestep) -> int:
        matches = np.flatnonzero(self.timesteps == timestep)
        if len(matches) == 0:
            return self._index_of_unknown_timestep(timestep)
        return int(matches[1] if len(matches) > 1 else matches[0])

    def _index_of_unknown_timestep(self, timestep) -> int:
        raise ValueError(
            f"timestep {timestep!r} is not one of this scheduler's timesteps; pass the "
            f"values of scheduler.timesteps"
        )

    def _start_at_training_timesteps(self, dtype) -> None:
        """Before set_timesteps: every training timestep and its σ, as diffusers starts out."""
        self.timesteps = training_timesteps(self.num_train_timesteps, dtype)
        self.sigmas = inference_sigmas(self.timesteps, self.sigmas_by_t)
        self._reset_step_index()

    def _init_step_index(self, timestep) -> None:
        if self._begin_index is None:
            self._step_index = self.index_for_timestep(timestep)
        else:
            self._step_index = self._begin_index

    def _noise_indices(self, timesteps: np.ndarray) -> list[int]:
        """Positions in the σ list for add_noise: the begin index once img2img set one."""
        timesteps = np.atleast_1d(np.asarray(timesteps))
        if self._begin_index is None:
            return [self.index_for_timestep(t) for t in timesteps]
        if self._step_index is not None:
            return [self._step_index] * len(timesteps)
        return [self._begin_index] * len(timesteps)


class SigmaSchedule(StepIndex):
    """The σ parameterisation shared by Euler and Euler ancestral (Karras et al. 2022).

    They treat the latent as x = x_0 + σ ε, the DDPM x_t scaled by 1/sqrt(ᾱ_t); the UNet,
    trained on DDPM inputs, therefore gets x / sqrt(σ² + 1). Timesteps are float32 and,
    with "linspace" spacing, fractional: the UNet's sinusoidal embedding takes them as is.

    Subclasses check their own options, call Scheduler.__init__, then _init_sigmas; the
    Scheduler base gives set_timesteps its spacing (_spaced_timesteps).
    """

    timestep_spacing: str

    def _init_sigmas(self, schedule: TrainingSchedule) -> None:
        self.sigmas_by_t = train_sigmas(schedule.alpha_bars())
        self._start_at_training_timesteps(np.float32)

    def set_timesteps(self, num_inference_steps: int) -> None:
        spaced = self._spaced_timesteps(num_inference_steps, round_linspace=False)
        self.timesteps = spaced.astype(np.float32)
        # interpolate at the float32 timesteps, as diffusers does, not at the float64 ones
        self.sigmas = inference_sigmas(self.timesteps, self.sigmas_by_t)
        self._reset_step_index()

    @property
    def init_noise_sigma(self) -> float:
        # "leading" never reaches t = T - 1, so its largest σ gets the DDPM-variance form
        sigma_max = self.sigmas.max()
        if self.timestep_spacing in ("linspace", "trailing"):
            return float(sigma_max)
        return float(np.sqrt(sigma_max * sigma_max + np.float32(1.0)))

    def scale_model_input(self, sample: np.ndarray, timestep) -> np.ndarray:
        if self._step_index is None:
            self._init_step_index(timestep)
        sigma = self.sigmas[self._step_index]
        return as_f32(sample) / np.sqrt(sigma * sigma + np.float32(1.0))

    def add_noise(
        self, original: np.ndarray, noise: np.ndarray, timesteps: np.ndarray
    ) -> np.ndarray:
        """x = x_0 + σ ε at the σ of each timestep (or of the begin index, for img2img)."""
        sigma = per_sample(self.sigmas[self._noise_indices(timesteps)], np.ndim(original))
        return as_f32(original) + as_f32(noise) * sigma
