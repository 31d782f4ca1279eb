"""The denoising schedulers, by the names the CLI and presets use, built from a model's
scheduler_config.json the way diffusers' ``XScheduler.from_config(config)`` builds them.

``make_scheduler("euler", config)`` takes from ``config`` the keys the Euler scheduler
understands and uses its own defaults for the rest, so a model's PNDM config can drive any of
them. Everything here is numpy on the CPU; see base.Scheduler for the contract.
"""

from __future__ import annotations

from engine.errors import InputError
from engine.schedulers.base import Scheduler
from engine.schedulers.scheduling_ddim import DDIMScheduler
from engine.schedulers.scheduling_dpmpp_2m import DPMSolverMultistepScheduler
from engine.schedulers.scheduling_euler import EulerDiscreteScheduler
from engine.schedulers.scheduling_euler_ancestral import EulerAncestralDiscreteScheduler
from engine.schedulers.scheduling_pndm import PNDMScheduler

_CLASSES: dict[str, type[Scheduler]] = {
    "pndm": PNDMScheduler,
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_ancestral": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,
}

SCHEDULERS: tuple[str, ...] = tuple(_CLASSES)

#: schedulers whose step() draws noise and so needs the rng argument
STOCHASTIC_SCHEDULERS: tuple[str, ...] = ("euler_ancestral",)


def make_scheduler(name: str, config: dict) -> Scheduler:
    """The scheduler called ``name``, configured from a scheduler_config.json dict.

    Raises InputError for an unknown name, UnsupportedModelError for a config the engine
    cannot honour (v-prediction, Karras sigmas, thresholding...).
    """
    cls = _CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InputError(f"unknown scheduler {name!r}; choose one of: {', '.join(SCHEDULERS)}")
    return cls.from_config(dict(config))


__all__ = [
    "SCHEDULERS",
    "STOCHASTIC_SCHEDULERS",
    "Scheduler",
    "make_scheduler",
    "DDIMScheduler",
    "DPMSolverMultistepScheduler",
    "EulerAncestralDiscreteScheduler",
    "EulerDiscreteScheduler",
    "PNDMScheduler",
]
