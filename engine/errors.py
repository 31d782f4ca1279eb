"""The engine's exception types: every user-facing failure is one of these, with a message
that names the bad value (file, config key, argument) and what was expected instead."""


class EngineError(Exception):
    """Base class: the CLI prints the message and exits non-zero, without a traceback."""


class ModelError(EngineError):
    """A model directory or checkpoint is missing, corrupt, or of an unsupported kind."""


class UnsupportedModelError(ModelError):
    """The files are readable but describe a model family the engine does not run."""


class InputError(EngineError):
    """A generation argument is out of range (size, steps, scheduler name, strength...)."""


class AdapterError(EngineError):
    """No usable WebGPU adapter, or the adapter lacks something the engine needs."""


class GPUError(EngineError):
    """WebGPU reported a validation, out-of-memory or internal error."""


class BrowserError(GPUError):
    """What a browser page reported (`kind`: no-webgpu, missing-feature, limit, schema,
    plan-hash, shader-compile, pipeline, weight-fetch, hash-mismatch, out-of-memory,
    over-budget, validation, device-lost, input, internal), or that it stopped answering
    ("timeout", "page-lost")."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"browser: {kind}: {message}")
        self.kind = kind


class FitError(EngineError):
    """A plan does not fit the adapter or the GPU memory budget it was given; `reasons` says
    what does not fit and by how much (engine.fit). Raised before anything is allocated."""

    def __init__(self, reasons: list[str]):
        super().__init__("the plan does not fit: " + "; ".join(reasons))
        self.reasons = list(reasons)
