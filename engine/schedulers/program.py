"""A scheduler's denoising loop as data: for each step, the scale of the UNet's input and the
fixed linear combinations of latent-sized tensors that make the next sample, with their
coefficients already computed, so that a GPU (or a browser, or a phone) can run the whole loop
without asking the host anything, and the schedulers' mathematics still lives in one place:
their own `step()`.

How the coefficients are found: every step of every scheduler here is linear in the tensors
it touches (the sample, the model's noise prediction, the noise it draws, and what it kept
from earlier steps). `loop_program` runs the scheduler's own `scale_model_input` and `step`
on `Lin` values instead of arrays: a `Lin` is a combination of named sources ("x3": the
sample step 3 starts from, "e3": the guided noise prediction of step 3, "n0": the first noise
draw) and numpy's arithmetic on it (scalar times, plus, minus, divided by a scalar) combines
coefficients instead of elements. Anything else (a product of two tensors, an exponential)
raises NotLinear, naming the step. The one non-linear operation a scheduler here can do,
`np.clip` of DDIM's predicted clean sample (clip_sample), becomes an operation of its own: a
clamped combination, the smallest kernel that keeps the step a fixed program.

Sources, in the order a generation makes them:
    x0              the initial latents (already multiplied by init_noise_sigma)
    e{i}            step i's noise prediction after classifier-free guidance
    n{k}            the k-th noise draw of the loop, rng.standard_normal(latent shape, float32)
                    from the generator that drew x0 (ancestral samplers)
    x{i+1}, c{k}    what step i computes: the next sample, and clamped temporaries
Coefficients are worked out in float64 and rounded to float32 once, where the GPU reads them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.errors import EngineError


class NotLinear(EngineError):
    """A scheduler step that is not a fixed combination of tensors with per-step coefficients."""


@dataclass(frozen=True)
class Combine:
    """out = sum(coefficient * source), then clamped to [lo, hi] when `clamp` is set."""

    out: str
    terms: tuple[tuple[float, str], ...]
    clamp: tuple[float, float] | None = None

    def as_dict(self) -> dict:
        return {"out": self.out, "terms": [[c, s] for c, s in self.terms],
                "clamp": list(self.clamp) if self.clamp else None}


@dataclass(frozen=True)
class Step:
    """One denoising step: the UNet sees input_scale * x{index} at `timestep`, its guided
    output is e{index}, and `ops` compute the temporaries and x{index + 1}, in order."""

    index: int
    timestep: float
    input_scale: float
    ops: tuple[Combine, ...]
    noise: tuple[str, ...] = ()  # the noise sources this step draws, in draw order

    def as_dict(self) -> dict:
        return {"index": self.index, "timestep": self.timestep, "input_scale": self.input_scale,
                "noise": list(self.noise), "ops": [op.as_dict() for op in self.ops]}


@dataclass(frozen=True)
class LoopProgram:
    scheduler: str
    timesteps: tuple[float, ...]
    init_noise_sigma: float
    steps: tuple[Step, ...]
    noise_draws: int  # how many rng.standard_normal(latent shape) draws the loop makes
    # img2img: x0 from i0 (the encoded image's posterior sample, times the VAE scaling factor)
    # and the forward noise n1 (n0 is the posterior's own draw), before step 0
    prologue: tuple[Combine, ...] = ()

    def last_use(self) -> dict[str, int]:
        """Source name -> the index of the last step that reads it (the prologue counts as 0)."""
        last: dict[str, int] = {}
        for op in self.prologue:
            for _, src in op.terms:
                last[src] = 0
        for step in self.steps:
            last[f"x{step.index}"] = step.index  # the UNet reads it
            for op in step.ops:
                for _, src in op.terms:
                    last[src] = step.index
        return last

    def as_dict(self) -> dict:
        return {"scheduler": self.scheduler, "timesteps": list(self.timesteps),
                "init_noise_sigma": self.init_noise_sigma, "noise_draws": self.noise_draws,
                "prologue": [op.as_dict() for op in self.prologue], "steps": [s.as_dict() for s in self.steps]}


class _Recorder:
    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
        self.ops: list[Combine] = []
        self.noise: list[str] = []
        self.noise_draws = 0
        self.temps = 0
        self.step = 0

    def clamp(self, value: Lin, lo: float, hi: float) -> Lin:
        name = f"c{self.temps}"
        self.temps += 1
        self.ops.append(Combine(name, value.rounded_terms(), (float(np.float32(lo)), float(np.float32(hi)))))
        return Lin({name: 1.0}, self)


class Lin:
    """A latent-sized tensor as a linear combination of named sources; numpy's arithmetic on
    it combines coefficients. Only the linear operations exist."""

    __array_priority__ = 1000
    symbolic = True  # common.as_f32 passes it through

    def __init__(self, terms: dict[str, float], recorder: _Recorder):
        self.terms = {k: v for k, v in terms.items() if v != 0.0}
        self.recorder = recorder

    # what step() code reads off an array
    @property
    def shape(self) -> tuple[int, ...]:
        return self.recorder.shape

    @property
    def ndim(self) -> int:
        return len(self.recorder.shape)

    dtype = np.dtype(np.float32)

    def astype(self, dtype, copy: bool = True) -> Lin:
        if np.dtype(dtype) != np.float32:
            raise NotLinear(f"step {self.recorder.step}: a cast to {np.dtype(dtype)}")
        return self

    def rounded_terms(self) -> tuple[tuple[float, str], ...]:
        return tuple((float(np.float32(c)), s) for s, c in sorted(self.terms.items(), key=_source_order))

    # arithmetic
    def _scale(self, k) -> Lin:
        k = _scalar(k, self.recorder)
        return Lin({s: c * k for s, c in self.terms.items()}, self.recorder)

    def _plus(self, other, sign: float) -> Lin:
        if not isinstance(other, Lin):
            if np.ndim(other) == 0 and float(other) == 0.0:
                return self
            raise NotLinear(f"step {self.recorder.step}: a tensor plus a constant {other!r} (not linear)")
        terms = dict(self.terms)
        for s, c in other.terms.items():
            terms[s] = terms.get(s, 0.0) + sign * c
        return Lin(terms, self.recorder)

    def __add__(self, other):
        return self._plus(other, 1.0)

    def __radd__(self, other):
        return self._plus(other, 1.0)

    def __sub__(self, other):
        return self._plus(other, -1.0)

    def __rsub__(self, other):
        return self._scale(-1.0)._plus(other, 1.0)

    def __mul__(self, other):
        if isinstance(other, Lin):
            raise NotLinear(f"step {self.recorder.step}: a product of two tensors")
        return self._scale(other)

    __rmul__ = __mul__

    def __truediv__(self, other):
        if isinstance(other, Lin):
            raise NotLinear(f"step {self.recorder.step}: a tensor divided by a tensor")
        return self._scale(1.0 / _scalar(other, self.recorder))

    def __neg__(self):
        return self._scale(-1.0)

    def __pos__(self):
        return self

    def clip(self, lo, hi, out=None, **kwargs):  # np.clip(lin, lo, hi) lands here
        if out is not None or kwargs:
            raise NotLinear(f"step {self.recorder.step}: np.clip with out= or other options")
        return self.recorder.clamp(self, _scalar(lo, self.recorder), _scalar(hi, self.recorder))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs:
            raise NotLinear(f"step {self.recorder.step}: numpy {ufunc.__name__}.{method} on a tensor")
        ops = {np.add: lambda a, b: a + b if isinstance(a, Lin) else b + a,
               np.subtract: lambda a, b: a - b if isinstance(a, Lin) else b.__rsub__(a),
               np.multiply: lambda a, b: a * b if isinstance(a, Lin) else b * a,
               np.true_divide: lambda a, b: a / b if isinstance(a, Lin) else _not_linear(self, "a constant divided by a tensor"),
               np.negative: lambda a: -a, np.positive: lambda a: a}
        if ufunc not in ops:
            raise NotLinear(f"step {self.recorder.step}: numpy {ufunc.__name__} of a tensor is not linear")
        return ops[ufunc](*inputs)

    def __array__(self, dtype=None, copy=None):
        raise NotLinear(f"step {self.recorder.step}: the tensor's values were needed (np.asarray of a source)")

    def __repr__(self) -> str:
        return " + ".join(f"{c:.6g}*{s}" for s, c in self.terms.items()) or "0"


def _not_linear(value: Lin, what: str):
    raise NotLinear(f"step {value.recorder.step}: {what}")


def _scalar(k, recorder: _Recorder) -> float:
    if isinstance(k, Lin) or np.size(k) != 1:  # one value broadcast (add_noise's per-sample factor) is a scalar
        raise NotLinear(f"step {recorder.step}: a tensor scaled by another tensor")
    k = float(np.asarray(k).reshape(-1)[0])
    if not math.isfinite(k):
        raise NotLinear(f"step {recorder.step}: a coefficient is {k}")
    return k


def _source_order(item) -> tuple:
    name = item[0]
    return ("xienc".index(name[0]) if name[0] in "xienc" else 9, int(name[1:]) if name[1:].isdigit() else 0)


@dataclass
class _ProbeRng:
    """Stands in for the numpy Generator a stochastic step draws from: each draw becomes a new
    noise source n{k}, in the order the real generator would be drawn from."""

    recorder: _Recorder
    draws: list[str] = field(default_factory=list)

    def standard_normal(self, shape=None, dtype=np.float64):
        if tuple(np.atleast_1d(shape)) != self.recorder.shape or np.dtype(dtype) != np.float32:
            raise NotLinear(f"step {self.recorder.step}: a noise draw of shape {shape} and dtype "
                            f"{np.dtype(dtype)}, not the latents' {self.recorder.shape} float32")
        name = f"n{self.recorder.noise_draws}"
        self.recorder.noise_draws += 1
        self.recorder.noise.append(name)
        return Lin({name: 1.0}, self.recorder)


def loop_program(name: str, config: dict, steps: int, shape: tuple[int, ...],
                 strength: float | None = None) -> LoopProgram:
    """The denoising loop of scheduler `name` (configured from a scheduler_config.json dict)
    over `steps` steps, for latents of `shape`, as data: run the scheduler's own step() on
    symbolic tensors and keep the combinations it computes. With `strength` (img2img), the
    loop covers the last int(steps * strength) steps (Scheduler.img2img_timesteps) and x0 is
    the noised encoded image."""
    from engine.schedulers import make_scheduler

    sched = make_scheduler(name, config)
    if strength is None:
        sched.set_timesteps(steps)
        timesteps = sched.timesteps
    else:
        timesteps = sched.img2img_timesteps(steps, strength)
    recorder = _Recorder(tuple(shape))
    rng = _ProbeRng(recorder)
    prologue: tuple[Combine, ...] = ()
    if strength is not None:
        recorder.step, recorder.noise_draws = -1, 2  # n0: the posterior's draw; n1: the forward noise
        noised = sched.add_noise(Lin({"i0": 1.0}, recorder), Lin({"n1": 1.0}, recorder), np.asarray(timesteps[:1]))
        prologue = (*recorder.ops, Combine("x0", noised.rounded_terms()))
    x = Lin({"x0": 1.0}, recorder)
    out = []
    for i, t in enumerate(timesteps):
        recorder.step, recorder.ops, recorder.noise = i, [], []
        scaled = sched.scale_model_input(x, t)
        if set(scaled.terms) != {f"x{i}"}:
            raise NotLinear(f"step {i}: scale_model_input is not a scaling of the sample ({scaled!r})")
        nxt = sched.step(Lin({f"e{i}": 1.0}, recorder), t, x, rng)
        if not isinstance(nxt, Lin):
            raise NotLinear(f"step {i}: step() returned {type(nxt).__name__}, not a combination of its inputs")
        ops = [*recorder.ops, Combine(f"x{i + 1}", nxt.rounded_terms())]
        out.append(Step(i, float(t), float(np.float32(scaled.terms[f"x{i}"])), tuple(ops), tuple(recorder.noise)))
        x = Lin({f"x{i + 1}": 1.0}, recorder)
    return LoopProgram(name, tuple(float(t) for t in timesteps), float(sched.init_noise_sigma),
                       tuple(out), recorder.noise_draws, prologue)


def evaluate(op: Combine, env: dict[str, np.ndarray]) -> np.ndarray:
    """One combination in numpy float32, terms in order (what the GPU kernel computes)."""
    acc = np.zeros_like(env[op.terms[0][1]], dtype=np.float32)
    for c, src in op.terms:
        acc = acc + np.float32(c) * env[src].astype(np.float32)
    if op.clamp is not None:
        acc = np.clip(acc, np.float32(op.clamp[0]), np.float32(op.clamp[1]))
    return acc
