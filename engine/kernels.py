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
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from .device import GPU, gpu_call
from .errors import EngineError

SHADER_ROOT = Path(__file__).resolve().parent.parent / "shaders"


@dataclass(frozen=True)
class Variant:
    op: str
    name: str
    entry: str = "main"
    requires: frozenset[str] = frozenset()  # adapter features the variant cannot run without
    doc: str = ""

    @property
    def path(self) -> Path:
        return SHADER_ROOT / self.op / f"{self.name}.wgsl"


REGISTRY: dict[str, dict[str, Variant]] = {}


def register(op: str, name: str, *, entry: str = "main", requires=(), doc: str = "") -> Variant:
    v = Variant(op, name, entry, frozenset(requires), doc)
    REGISTRY.setdefault(op, {})[name] = v
    return v


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


def specialise(variant: Variant, dtype: str) -> str:
    """The WGSL source of `variant` with its storage element type fixed."""
    header = "enable f16;\nalias T = f16;\n" if dtype == "f16" else "alias T = f32;\n"
    return header + _source(variant.path)


class PipelineCache:
    """Compiled compute pipelines by (variant, element type, override constants)."""

    def __init__(self, gpu: GPU):
        self.gpu = gpu
        self._modules: dict[tuple, object] = {}
        self._pipelines: dict[tuple, object] = {}

    def get(
        self,
        variant: Variant,
        dtype: str,
        constants: dict[str, float | int | bool] | None = None,
        entry: str | None = None,
    ):
        entry = entry or variant.entry
        consts = tuple(sorted((constants or {}).items()))
        key = (variant.op, variant.name, dtype, consts, entry)
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            return pipeline
        mkey = (variant.op, variant.name, dtype)
        module = self._modules.get(mkey)
        if module is None:
            module = gpu_call(
                f"compiling shaders/{variant.op}/{variant.name}.wgsl ({dtype})",
                self.gpu.device.create_shader_module,
                label=f"{variant.op}/{variant.name}/{dtype}",
                code=specialise(variant, dtype),
            )
            self._modules[mkey] = module
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


@dataclass
class Selection:
    """Which variant each op uses on this adapter: the data every dispatch consults.

    `choices` maps op -> variant name (from a profile); ops it does not name use "reference".
    Fallbacks (a chosen variant the adapter cannot run) are recorded in `warnings`.
    """

    features: frozenset[str]
    choices: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def variant(self, op: str) -> Variant:
        table = variants(op)
        name = self.choices.get(op, "reference")
        v = table.get(name)
        if v is None:
            raise EngineError(
                f"profile selects unknown variant {name!r} for op {op!r}; valid: {', '.join(sorted(table))}"
            )
        missing = v.requires - self.features
        if missing:
            msg = f"{op}: variant {name!r} needs {', '.join(sorted(missing))}; using 'reference'"
            if msg not in self.warnings:
                self.warnings.append(msg)
                warnings.warn(msg, stacklevel=2)
            v = table["reference"]
        return v
