"""The model a GPU benchmark runs and its size, as the benchmarks that take them say them on
the command line: a diffusers folder (--model) or a preset's random-weight model made for the
run (--preset), in --precision, at --resolution."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """--model or --preset (one of them), --precision and --resolution."""
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="diffusers model folder")
    src.add_argument("--preset", choices=["tiny", "sd14"], help="make a random-weight model first")
    ap.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    ap.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: native)")


def model_folder(args: argparse.Namespace, tmp: Path) -> Path:
    """args.model, or a random-weight model of args.preset written under `tmp` in args.precision."""
    if args.model is not None:
        return args.model
    from engine.make_model import make_model

    t0 = time.perf_counter()
    model = make_model(args.preset, 0, tmp / args.preset, dtype=args.precision)
    print(f"made {args.preset} model in {time.perf_counter() - t0:.1f} s", flush=True)
    return model


def use_dawn() -> None:
    """Run this process's WebGPU through Dawn (`wgpudawn`, what Chrome runs) on Vulkan instead of
    wgpu-native: call before anything imports engine.device. Timestamps unquantized: Dawn rounds
    them down to 65,536 ns by default (its `timestamp_quantization`, against timing attacks), which
    turned every kernel under about 0.1 ms of a tune into a tie (0.0, 0.066 or 0.131 ms)."""
    import wgpudawn
    import wgpudawn.backends.dawn.extras  # noqa: F401  (a submodule the package does not import itself)

    wgpudawn.backends.dawn.extras.set_instance_extras(backends=["Vulkan"], enable_toggles=["allow_unsafe_apis"],
                                                      disable_toggles=["timestamp_quantization"])
    wgpudawn.install_as_wgpu()
