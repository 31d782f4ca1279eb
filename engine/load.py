"""`load_pipeline`: the engine's entry point, which picks who runs a model. Every executor gives
the same Pipeline API (engine.pipeline.BasePipeline):

    native   this process, eagerly (engine/pipeline.py)
    plan     this process, replaying engine plans (engine/plan_exec.py)
    browser  a WebGPU page running the same plans (engine/browser.py)
"""

from __future__ import annotations

from pathlib import Path

from .errors import InputError, ModelError
from .kernels import PRECISIONS
from .pipeline import BasePipeline, check_residency, load_native_pipeline

EXECUTORS = ("native", "plan", "browser")


def load_pipeline(
    model_dir, precision: str = "fp32", profile=None, tokenizer_dir=None, residency: str | None = None,
    executor: str = "native", budget_bytes: int | None = None, **browser_options,
) -> BasePipeline:
    """Load a model (diffusers folder or SD 1.x single-file checkpoint) for the GPU: its
    weights onto it ("resident"), or into host memory, to go up one network at a time
    ("staged"). `executor` picks who runs it (see the module docstring). The plan and browser
    executors hold a plan's GPU memory within `budget_bytes` (a plan that cannot fit is refused
    with engine.errors.FitError before anything is allocated) and by default ("auto") stage
    weights only when the budget needs it; natively the default is "resident" and there is no
    budget. `browser_options` go to engine.browser.browser_pipeline (a `session` another
    program hosts, a `chromium`, a `cdp` endpoint, `manual`)."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if executor not in EXECUTORS:
        raise InputError(f"executor {executor!r} is not one of {', '.join(EXECUTORS)}")
    if budget_bytes is not None and (budget_bytes <= 0 or int(budget_bytes) != budget_bytes):
        raise InputError(f"budget_bytes {budget_bytes!r}: expected a positive whole number of bytes")
    if executor == "native":
        if budget_bytes is not None:
            raise InputError("a GPU memory budget is kept by the plan and browser executors; the native executor has none")
        residency = residency or "resident"
        check_residency(residency)
        return load_native_pipeline(model_dir, precision, profile, tokenizer_dir, residency)
    residency = residency or "auto"
    if residency != "auto":
        check_residency(residency)
    from .models.config import load_model_config
    from .tokenizer import CLIPTokenizer

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelError(f"executor {executor!r} runs diffusers model folders; {model_dir} is not one")
    config = load_model_config(model_dir)
    tokenizer = CLIPTokenizer(tokenizer_dir or config.tokenizer_dir)
    if executor == "plan":
        from .device import get_gpu
        from .plan_exec import PlanPipeline

        gpu = get_gpu()
        return PlanPipeline(model_dir, config, tokenizer, gpu.caps, precision, profile, gpu=gpu,
                            budget_bytes=budget_bytes, residency=residency)
    from .browser import browser_pipeline

    return browser_pipeline(model_dir, config, tokenizer, precision, profile, budget_bytes=budget_bytes,
                            residency=residency, **browser_options)
