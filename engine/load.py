"""`load_pipeline`: the engine's entry point, which picks who runs a model. Every runtime gives
the same Pipeline API (engine.pipeline.BasePipeline):

    native   this process, eagerly (engine/pipeline.py)
    plan     this process, replaying engine plans (engine/plan_exec.py)
    browser  a WebGPU page running the same plans (engine/browser.py)
"""

from __future__ import annotations

from pathlib import Path

from .errors import InputError, ModelError
from .pipeline import PRECISIONS, BasePipeline, check_residency, load_native_pipeline

RUNTIMES = ("native", "plan", "browser")


def load_pipeline(
    model_dir, precision: str = "fp32", profile=None, tokenizer_dir=None, residency: str = "resident",
    runtime: str = "native", **browser_options,
) -> BasePipeline:
    """Load a model (diffusers folder or SD 1.x single-file checkpoint) for the GPU: its
    weights onto it ("resident"), or into host memory, to go up one network at a time
    ("staged"; native only). `runtime` picks who runs it (see the module docstring);
    `browser_options` go to engine.browser.browser_pipeline (a `session` another program
    hosts, a `chromium`, a `cdp` endpoint, `manual`)."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if runtime not in RUNTIMES:
        raise InputError(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}")
    check_residency(residency)
    if runtime == "native":
        return load_native_pipeline(model_dir, precision, profile, tokenizer_dir, residency)
    if residency != "resident":
        raise InputError(f"residency {residency!r} is for the native runtime; plans keep their weights resident")
    from .models.config import load_model_config
    from .tokenizer import CLIPTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"runtime {runtime!r} runs diffusers model folders; {model_dir} is not one")
    config = load_model_config(model_dir)
    tokenizer = CLIPTokenizer(tokenizer_dir or config.tokenizer_dir)
    if runtime == "plan":
        from .device import get_gpu
        from .plan_exec import PlanPipeline

        gpu = get_gpu()
        return PlanPipeline(model_dir, config, tokenizer, gpu.caps, precision, profile, gpu=gpu)
    from .browser import browser_pipeline

    return browser_pipeline(model_dir, config, tokenizer, precision, profile, **browser_options)
