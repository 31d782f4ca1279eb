"""The registry of kernel variants and the compiled-pipeline cache.

Every op has named variants, each a WGSL file under shaders/<op>/<variant>.wgsl. A variant is
specialised in exactly two ways: the element type `T` of its storage buffers (f32, or f16 when
the adapter has shader-f16), which is the one line prepended to the source, and WGSL
`override` constants given at pipeline creation. Which variant runs is decided from data by
`Selection`: the profile's choice where it names one the adapter can run, otherwise the
reference variant.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from .device import GPU, gpu_call
from .errors import EngineError

SHADER_ROOT = Path(__file__).resolve().parent.parent / "shaders"


@dataclass(frozen=True)
class Variant:
    """One way to compute an op: its WGSL file, what it needs, and how to dispatch it.

    `launch(ops, constants, *args)` records the dispatches and returns the output tensor.
    `constants` declares the tunable constants a profile may set, with their allowed values.
    `applies(shape) -> str | None` says why the variant cannot run on a shape (None: it can).
    `candidates` are the constant settings a tuner tries besides the defaults (when empty, it
    spreads a few settings over the product of `constants`); `f16_candidates` are tried besides
    them where the call computes in f16 (a setting that only matters there).
    """

    op: str
    name: str
    entry: str = "main"
    requires: frozenset[str] = frozenset()  # adapter features the variant cannot run without
    doc: str = ""
    launch: Callable | None = field(default=None, compare=False)
    constants: dict[str, tuple] = field(default_factory=dict, compare=False, hash=False)
    applies: Callable[[dict], str | None] | None = field(default=None, compare=False)
    candidates: tuple = field(default=(), compare=False, hash=False)
    f16_candidates: tuple = field(default=(), compare=False, hash=False)

    @property
    def path(self) -> Path:
        return SHADER_ROOT / self.op / f"{self.name}.wgsl"


REGISTRY: dict[str, dict[str, Variant]] = {}


def register(
    op: str,
    name: str,
    *,
    entry: str = "main",
    requires=(),
    doc: str = "",
    constants: dict[str, tuple] | None = None,
    candidates=(),
    f16_candidates=(),
    applies: Callable[[dict], str | None] | None = None,
):
    """Decorator registering `launch` as variant `name` of `op` (usable bare: returns Variant)."""

    def wrap(launch: Callable | None) -> Callable | None:
        REGISTRY.setdefault(op, {})[name] = Variant(
            op, name, entry, frozenset(requires), doc, launch, dict(constants or {}), applies,
            tuple(dict(c) for c in candidates), tuple(dict(c) for c in f16_candidates),
        )
        return launch

    return wrap


def variants(op: str) -> dict[str, Variant]:
    try:
        return REGISTRY[op]
    except KeyError:
        raise EngineError(f"unknown op {op!r}; known ops: {', '.join(sorted(REGISTRY))}") from None


@cache
def _source(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise EngineError(f"shader file {path} is missing: {exc}") from exc


# The line(s) put before a shader file to fix its element type T (engine plans carry these, so
# every executor specialises the same way).
SHADER_HEADERS = {"f32": "alias T = f32;\n", "f16": "enable f16;\nalias T = f16;\n", "f16s": "alias T = f32;\n"}

# What a precision asks for, and the storage element type it runs in on an adapter: fp16 is f16
# where the adapter has shader-f16 and f16-storage (packed halves, f32 arithmetic) where it has
# not, never a silent fp32.
PRECISIONS = ("fp32", "fp16", "f16-storage")


def storage_dtype(precision: str, has_f16: bool) -> str:
    """The element type of a model's tensors for `precision` on an adapter with (or without)
    shader-f16."""
    if precision == "fp32":
        return "f32"
    if precision == "fp16" and has_f16:
        return "f16"
    if precision in ("fp16", "f16-storage"):
        return "f16s"
    raise EngineError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")


def precision_notes(device: str, precision: str, dtype: str) -> list[str]:
    """What a result says when `precision` runs as another element type on adapter `device`:
    fp16 on an adapter without shader-f16 runs as f16-storage (never silently as fp32)."""
    if precision == "fp16" and dtype == "f16s":
        return [f"adapter {device!r} lacks shader-f16: fp16 runs as f16-storage (packed halves, f32 arithmetic)"]
    return []


def precision_of(dtype: str) -> str:
    """The precision a model running in element type `dtype` reports."""
    return {"f32": "fp32", "f16": "fp16", "f16s": "f16-storage"}[dtype]


def shader_name(variant: Variant, dtype: str) -> str:
    """"<op>/<variant>", or "packed/<op>/<variant>" for f16-storage: the kernel's file under
    shaders/, without .wgsl (scripts/make_packed_shaders.py writes the packed ones)."""
    return f"{'packed/' if dtype == 'f16s' else ''}{variant.op}/{variant.name}"


def specialise(variant: Variant, dtype: str) -> str:
    """The WGSL source of `variant` with its storage element type fixed."""
    if dtype == "f16s" and "shader-f16" in variant.requires:
        raise EngineError(f"{variant.op}/{variant.name} computes in f16 and has no f16-storage form")
    # variant.path, not the name, for the other types: a benchmark's probe (a variant of its own
    # file) compiles its own source
    path = SHADER_ROOT / f"{shader_name(variant, dtype)}.wgsl" if dtype == "f16s" else variant.path
    return _specialised(path, dtype)


@cache
def _specialised(path: Path, dtype: str) -> str:
    # one string a (shader, dtype): PipelineCache keys on it, and a str keeps its hash
    return SHADER_HEADERS[dtype] + _source(path)


class PipelineCache:
    """Compiled compute pipelines by (variant, element type, override constants). Every cache
    of one GPU shares what was compiled on it (modules by their WGSL source, pipelines by module,
    entry point and constants): another executor, model size or test in the process compiles
    nothing twice. Pipelines (layout "auto") are immutable; bind groups stay each caller's own."""

    def __init__(self, gpu: GPU):
        self.gpu = gpu
        self._modules, self._pipelines = gpu.compiled

    def get(
        self,
        variant: Variant,
        dtype: str,
        constants: dict[str, float | int | bool] | None = None,
        entry: str | None = None,
    ):
        entry = entry or variant.entry
        consts = tuple(sorted((constants or {}).items()))
        code = specialise(variant, dtype)
        key = (code, consts, entry)
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            return pipeline
        module = self._modules.get(code)
        if module is None:
            module = gpu_call(
                f"compiling shaders/{variant.op}/{variant.name}.wgsl ({dtype})",
                self.gpu.shader_module,
                code,
                f"{variant.op}/{variant.name}/{dtype}",
            )
            self._modules[code] = module
        stage = {"module": module, "entry_point": entry}
        if consts:
            stage["constants"] = {k: float(v) for k, v in consts}
        pipeline = gpu_call(
            f"creating the pipeline for {variant.op}/{variant.name}:{entry} ({dtype}, {dict(consts)})",
            self.gpu.device.create_compute_pipeline,
            label=f"{variant.op}/{variant.name}",
            layout="auto",
            compute=stage,
        )
        self._pipelines[key] = pipeline
        return pipeline


@dataclass(frozen=True)
class Rule:
    """A profile entry: for `op` on shapes matching `when`, use `variant` with `constants`.

    `when` maps a shape field to a value (equality) or to {"min": a, "max": b} (inclusive).
    """

    op: str
    variant: str
    when: tuple = ()  # ((field, value-or-range), ...) kept hashable
    constants: tuple = ()  # ((name, value), ...)
    why: str = field(default="", compare=False)

    def matches(self, shape: dict) -> bool:
        for key, cond in self.when:
            v = shape.get(key)
            if v is None:
                return False
            if isinstance(cond, tuple):  # (min, max), either may be None
                lo, hi = cond
                if (lo is not None and v < lo) or (hi is not None and v > hi):
                    return False
            elif v != cond:
                return False
        return True


@dataclass
class Decision:
    op: str
    shape: dict
    variant: str
    constants: dict
    why: str
    dtype: str | None = None  # the element type the call ran in, where the caller said


def decision_key(op: str, shape: dict, dtype: str | None = None) -> tuple:
    """Selection.decisions' key of a call: its op, shape and element type."""
    return op, tuple(sorted(shape.items())), dtype


@dataclass
class Selection:
    """Which variant each op uses on this adapter: the data every dispatch consults.

    `rules` come from a profile, first match wins; an op no rule matches uses "reference". A
    rule may name the element type it holds for ("dtype": "f32", "f16" or "f16s"), matched
    against the type the call runs in; rules without one hold for every type.
    A matched variant the adapter cannot run (missing feature) or that does not apply to the
    shape falls back to "reference", and the reason is kept in `warnings`. Every distinct
    (op, shape) decision is kept in `decisions` for `farm engine explain`.
    """

    features: frozenset[str]
    rules: list[Rule] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    decisions: dict[tuple, Decision] = field(default_factory=dict)
    profile_name: str = "reference"

    def choose(self, op: str, shape: dict | None = None, dtype: str | None = None) -> tuple[Variant, dict]:
        """The variant and constants of `op` on `shape`, run in element type `dtype` (what a
        rule's "dtype" condition is matched against; None matches no such rule)."""
        shape = shape or {}
        key = decision_key(op, shape, dtype)
        known = self.decisions.get(key)
        table = variants(op)
        if known is not None:
            return table[known.variant], known.constants
        matched = shape if dtype is None else {**shape, "dtype": dtype}
        v, consts, why = table["reference"], {}, "no profile rule matches"
        for rule in self.rules:
            if rule.op != op or not rule.matches(matched):
                continue
            cand = table.get(rule.variant)
            if cand is None:
                raise EngineError(
                    f"profile selects unknown variant {rule.variant!r} for op {op!r}; valid: {', '.join(sorted(table))}"
                )
            missing = cand.requires - self.features
            reason = None
            if missing:
                reason = f"needs {', '.join(sorted(missing))}"
            elif cand.applies is not None:
                reason = cand.applies(shape)
            if reason:
                msg = f"{op} {dict(shape)}: variant {cand.name!r} {reason}; using 'reference'"
                if msg not in self.warnings:
                    self.warnings.append(msg)
                    warnings.warn(msg, stacklevel=3)
                why = f"profile chose {cand.name!r}, but it {reason}"
                break
            v, consts = cand, dict(rule.constants)
            why = f"profile {self.profile_name!r}: {rule.why or dict(rule.when) or 'any shape'}"
            break
        self.decisions[key] = Decision(op, dict(shape), v.name, consts, why, dtype)
        return v, consts

    def variant(self, op: str, shape: dict | None = None, dtype: str | None = None) -> Variant:
        return self.choose(op, shape, dtype)[0]

    @classmethod
    def forcing(cls, features, choices: dict[str, str], name: str = "custom") -> Selection:
        """Every shape of each named op uses the named variant (ablations, tuning)."""
        return cls(frozenset(features), [Rule(op, v) for op, v in choices.items()], profile_name=name)


def conv_out_size(h: int, w: int, kh: int, kw: int, stride: int, pads) -> tuple[int, int]:
    """A convolution's output height and width (pads: top, bottom, left, right)."""
    pt, pb, pl, pr = pads
    return (h + pt + pb - kh) // stride + 1, (w + pl + pr - kw) // stride + 1
