"""This machine's speed index: how long the tiny random-weight model's UNet step (fp32, 64x64,
classifier-free guidance, so batch 2) takes on this process's WebGPU adapter, and the CPU's
vector width. On machines without a GPU the adapter is a software one (lavapipe, SwiftShader)
and everything GPU-bound (the test suite, the demo) runs at its pace: two 2-core machines of
one kind measured 136-165 ms (AVX-512) and 650-740 ms (AVX2) per step. The suite and the demo
print it first, and test times are recorded beside it, so times from different machines can
be compared.

    python -m engine.speed [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

WARMUP = 1  # the first call compiles every pipeline: 2-3x a timed step
REPETITIONS = 3


def cpu_vector_bits() -> int:
    """The widest SIMD registers the CPU offers (what LLVM's software GPUs compile for): 512
    with AVX-512, 256 with AVX/AVX2, 128 otherwise (SSE, NEON)."""
    try:
        flags = set()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        flags = set()
    if "avx512f" in flags:
        return 512
    if "avx2" in flags or "avx" in flags:
        return 256
    return 128


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure(model_dir: Path | None = None, repetitions: int = REPETITIONS) -> dict:
    """{"unet_step_ms": median, "samples_ms", "adapter", "cpu", "cpu_vector_bits"}: a few
    seconds (the model is made in a temporary folder unless one is given)."""
    import numpy as np

    from . import load_pipeline
    from .make_model import make_model

    with tempfile.TemporaryDirectory(prefix="speed-index-") as scratch:
        model = model_dir or make_model("tiny", 0, Path(scratch) / "tiny")
        pipe = load_pipeline(model, precision="fp32")
        ctx = pipe.encode_text(pipe.tokenize(["", "a speed index"]))
        sample = np.random.default_rng(0).standard_normal((2, 4, 8, 8), dtype=np.float32)  # (B, 4, h, w)
        samples = []
        for i in range(WARMUP + repetitions):
            started = time.perf_counter()
            pipe.unet(sample, 500, ctx)
            if i >= WARMUP:
                samples.append((time.perf_counter() - started) * 1000)
    from .device import get_gpu

    caps = get_gpu().caps
    adapter = caps.device + (f" ({caps.description})" if caps.description else "")
    return {"unet_step_ms": round(statistics.median(samples), 1), "samples_ms": [round(s, 1) for s in samples],
            "adapter": adapter, "cpu": cpu_name(), "cpu_vector_bits": cpu_vector_bits()}


def describe(index: dict) -> str:
    """One line: 'speed index: 742 ms a tiny UNet step on llvmpipe (...); CPU AMD EPYC, 256-bit vectors'."""
    return (f"speed index: {index['unet_step_ms']:.0f} ms a tiny-model UNet step on {index['adapter']}; "
            f"CPU {index['cpu']}, {index['cpu_vector_bits']}-bit vectors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the measurement here")
    args = ap.parse_args()
    index = measure()
    print(describe(index), flush=True)
    if args.json:
        args.json.write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
