"""The scheduler contract shared by every algorithm in this package.

Schedulers are pure numpy on the CPU. Each one is built from the model's
scheduler_config.json dict (the same keys diffusers writes), and must give the same numbers as
the diffusers class of the same name given the same inputs.

Randomness: ancestral samplers draw their noise from the numpy Generator passed to step(),
with ``rng.standard_normal(shape, dtype=np.float32)``; the pipeline owns that generator.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import fields

import numpy as np

from engine.errors import InputError
from engine.schedulers.common import (
    TrainingSchedule,
    as_f32,
    check_num_inference_steps,
    check_timestep_spacing,
    spaced_timesteps,
)


class Scheduler(ABC):
    #: how many model evaluations one entry of ``timesteps`` stands for (diffusers' ``order``)
    order: int = 1

    timesteps: np.ndarray  # set by set_timesteps; the values passed to the UNet, in order
    init_noise_sigma: float  # the pipeline multiplies its initial latents by this

    def __init__(self, schedule: TrainingSchedule, timestep_spacing: str, steps_offset: int):
        """What every scheduler keeps of its config besides its own options: the length of
        the training schedule and how inference timesteps are spaced over it."""
        check_timestep_spacing(timestep_spacing)
        self.num_train_timesteps = schedule.num_train_timesteps
        self.timestep_spacing = timestep_spacing
        self.steps_offset = int(steps_offset)
        self.num_inference_steps: int | None = None  # set by set_timesteps

    @classmethod
    def from_config(cls, config: dict) -> Scheduler:
        """Build from any scheduler's config dict, as diffusers' ``from_config`` does.

        Keys this class's ``__init__`` takes are used; all others (another scheduler's
        options, ``_class_name``...) are ignored, and missing keys get this class's defaults.
        diffusers marks keys that were absent from the file and filled with the original
        class's defaults in ``_use_default_values``; those are dropped too, so that e.g. a
        PNDM config without ``timestep_spacing`` gives Euler its own default ("linspace"),
        not PNDM's ("leading"). The training schedule's keys go to the TrainingSchedule.
        """
        filled_by_defaults = set(config.get("_use_default_values", ()))
        given = {key: value for key, value in config.items() if key not in filled_by_defaults}
        schedule_keys = {field.name for field in fields(TrainingSchedule)}
        parameters = set(inspect.signature(cls.__init__).parameters) - {"self", "schedule"}
        schedule = TrainingSchedule(**{k: v for k, v in given.items() if k in schedule_keys})
        return cls(schedule, **{key: value for key, value in given.items() if key in parameters})

    @abstractmethod
    def set_timesteps(self, num_inference_steps: int) -> None: ...

    def _spaced_timesteps(self, num_inference_steps: int, *, round_linspace: bool) -> np.ndarray:
        """Check and keep n; the n inference timesteps of this config's spacing, largest
        first, float64 (common.spaced_timesteps)."""
        n = check_num_inference_steps(num_inference_steps, self.num_train_timesteps)
        self.num_inference_steps = n
        return spaced_timesteps(
            self.timestep_spacing,
            self.num_train_timesteps,
            n,
            self.steps_offset,
            round_linspace=round_linspace,
        )

    def scale_model_input(self, sample: np.ndarray, timestep) -> np.ndarray:
        return sample

    def step(
        self,
        model_output: np.ndarray,
        timestep,
        sample: np.ndarray,
        rng: np.random.Generator | None = None,
    ) -> np.ndarray:
        """One denoising step: returns the previous sample (float32, same shape)."""
        return self._step(as_f32(model_output), timestep, as_f32(sample), rng)

    @abstractmethod
    def _step(self, eps: np.ndarray, timestep, x: np.ndarray, rng) -> np.ndarray:
        """step() on float32 tensors: ε, the model output, and x, the current sample."""

    def set_begin_index(self, begin_index: int) -> None:
        """Start stepping at ``timesteps[begin_index]`` instead of finding the position by value.

        Only schedulers that keep a step counter (Euler, Euler ancestral, DPM-Solver) use it;
        those that locate every step by its timestep value (PNDM, DDIM) ignore it, as
        diffusers does by not having the method on them.
        """
        return None  # deliberately a no-op here, not an abstract method

    def img2img_timesteps(self, num_inference_steps: int, strength: float) -> np.ndarray:
        """Set up an img2img run and return the timesteps it denoises through.

        Calls ``set_timesteps(num_inference_steps)`` itself (do not call it again afterwards:
        that would forget the begin index), keeps the last ``int(n * strength)`` steps, as
        diffusers' StableDiffusionImg2ImgPipeline.get_timesteps does, and tells step-counting
        schedulers where they start. The pipeline then noises the encoded image with
        ``add_noise(latents, noise, timesteps[:1])`` and does not multiply by
        ``init_noise_sigma``.
        """
        if not 0.0 <= strength <= 1.0:
            raise InputError(f"strength must be between 0 and 1, got {strength!r}")
        self.set_timesteps(num_inference_steps)
        init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
        if init_timestep < 1:
            raise InputError(
                f"strength {strength!r} with {num_inference_steps} steps leaves no denoising "
                f"step (int(steps * strength) = 0); raise the strength or the step count"
            )
        t_start = max(num_inference_steps - init_timestep, 0)
        self.set_begin_index(t_start * self.order)
        return self.timesteps[t_start * self.order :]

    @abstractmethod
    def add_noise(self, original: np.ndarray, noise: np.ndarray, timesteps: np.ndarray) -> np.ndarray:
        """Forward-diffuse ``original`` to ``timesteps`` (img2img)."""
