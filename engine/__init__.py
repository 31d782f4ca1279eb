"""Stable Diffusion 1.x on WebGPU: WGSL kernels run through wgpu, numerically equal to
diffusers. Public entry point: `load_pipeline(model_dir, precision, profile) -> Pipeline`."""

from .errors import EngineError

__all__ = ["EngineError", "GenerationResult", "Pipeline", "load_pipeline"]


def __getattr__(name):
    # The pipeline pulls in wgpu; importing `engine` for its errors or tools should not.
    if name == "load_pipeline":
        from .load import load_pipeline

        return load_pipeline
    if name in ("Pipeline", "GenerationResult"):
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
