"""The virtual phone's thermal model. One lumped temperature T (the SoC) follows Newton's law:
while at least one job runs it relaxes toward `load_c` with time constant `heat_tau_s`,
otherwise toward `ambient_c` with `cool_tau_s`. Between events the exact solution is used,
so readings do not depend on how often they are taken:

    T(t + dt) = T_target + (T(t) - T_target) * exp(-dt / tau)

Each thermal zone reads ambient + coupling * (T - ambient) + offset, so the GPU runs a bit
hotter than the SoC and the battery and skin lag behind it (in steady state only; the model
keeps one state variable on purpose)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ThermalSettings:
    ambient_c: float = 25.0
    load_c: float = 75.0
    heat_tau_s: float = 30.0
    cool_tau_s: float = 60.0


class ThermalModel:
    def __init__(self, settings: ThermalSettings | None = None, clock: Callable[[], float] = time.monotonic):
        self.settings = settings or ThermalSettings()
        self._clock = clock
        self._lock = threading.Lock()
        self._soc_c = self.settings.ambient_c
        self._t = clock()
        self._jobs = 0

    def _advance(self) -> None:
        now = self._clock()
        dt = max(0.0, now - self._t)
        self._t = now
        s = self.settings
        target, tau = (s.load_c, s.heat_tau_s) if self._jobs else (s.ambient_c, s.cool_tau_s)
        self._soc_c = target + (self._soc_c - target) * math.exp(-dt / tau)

    def job_started(self) -> None:
        with self._lock:
            self._advance()
            self._jobs += 1

    def job_finished(self) -> None:
        with self._lock:
            self._advance()
            self._jobs = max(0, self._jobs - 1)

    @property
    def running_jobs(self) -> int:
        return self._jobs

    def soc_celsius(self) -> float:
        with self._lock:
            self._advance()
            return self._soc_c

    def zone_celsius(self, coupling: float, offset_c: float = 0.0) -> float:
        ambient = self.settings.ambient_c
        return ambient + coupling * (self.soc_celsius() - ambient) + offset_c
