"""How fast a network's weights go from host memory to the GPU, by the ways WebGPU offers.

    python benchmarks/weight_upload.py [--component unet] [--dtype f16] [--reps 5] [--json out.json]

A staged generation (engine.fit's "staged" residency: what fits a phone's budget) uploads each
network's weights when its stage starts, so its time is the generation's time. This times one
network's weights (SD 1.4's real names and shapes, random values already in the GPU element
type in host memory, as a staged pipeline holds them) uploaded one buffer per weight, each way
to completion on the GPU (a readback of the last buffer waits for the queue):

  copy+write      the array's bytes copied (tobytes), then queue.write_buffer: what the engine did
  write           queue.write_buffer straight from the array (no host copy of ours)
  mapped          create_buffer(mapped_at_creation) and the array written into the mapping
  ring            engine.gpu.StagingRing: two 64 MiB mapped staging buffers reused in turn,
                  copied to the weights' buffers by one submission each
  one-write       every weight's bytes in one host buffer and one write_buffer into one GPU buffer:
                  the ceiling of one call (not a layout the engine binds)

Every way's bytes are read back for three weights and compared. Prints a table (median of
--reps after one warm-up) and writes JSON.

With --generation MODEL it also runs staged 20-step 512x512 generations of that model (fp16, the
native pipeline, one warm-up, then two timed, the last profiled) with each way the engine can
upload weights (GpuContext.upload_way): where a staged generation's time goes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def weights(component: str, dtype: str, seed: int = 0) -> dict[str, np.ndarray]:
    from engine.make_model import preset_model_config
    from engine.models.params import param_shapes

    config = preset_model_config("sd14")
    cfg = {"unet": config.unet, "vae": config.vae, "text_encoder": config.text_encoder}[component]
    rng = np.random.default_rng(seed)
    np_dtype = {"f16": np.float16, "f32": np.float32}[dtype]
    return {name: rng.standard_normal(shape, dtype=np.float32).astype(np_dtype)
            for name, shape in param_shapes(component, cfg).items()}


def _padded(nbytes: int) -> int:
    return max(4, (nbytes + 3) & ~3)


def upload(device, way: str, arrays: list[np.ndarray]) -> list:
    import wgpu

    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    out = []
    if way == "one-write":
        blob = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
        blob = np.concatenate([blob, np.zeros(_padded(blob.nbytes) - blob.nbytes, np.uint8)])
        buf = device.create_buffer(size=blob.nbytes, usage=usage)
        device.queue.write_buffer(buf, 0, blob)
        return [buf]
    if way == "ring":
        from engine.gpu import StagingRing

        ring = StagingRing(device)
        for a in arrays:
            buf = device.create_buffer(size=_padded(a.nbytes), usage=usage)
            ring.write(buf, a)
            out.append(buf)
        ring.flush()
        ring.destroy()
        return out
    for a in arrays:
        size = _padded(a.nbytes)
        if way == "mapped":
            buf = device.create_buffer(size=size, usage=usage, mapped_at_creation=True)
            buf.write_mapped(a.reshape(-1).view(np.uint8))
            buf.unmap()
        else:
            buf = device.create_buffer(size=size, usage=usage)
            data = a.tobytes() if way == "copy+write" else a.reshape(-1).view(np.uint8)
            if data.__len__() % 4:
                data = bytes(data) + b"\0" * (4 - len(data) % 4)
            device.queue.write_buffer(buf, 0, data)
        out.append(buf)
    return out


def profile_generation(model: Path, steps: int) -> dict:
    from engine.gpu import GpuContext

    out = {}
    for way in ("write", "ring"):
        GpuContext.upload_way = way
        out[way] = _profile_generation(model, steps, way)
    return out


def _profile_generation(model: Path, steps: int, way: str) -> dict:
    import cProfile
    import io
    import pstats

    from engine.pipeline import load_native_pipeline

    pipe = load_native_pipeline(model, "fp16", residency="staged")
    runs = []
    for i in range(3):
        profiler = cProfile.Profile() if i == 2 else None
        if profiler:
            profiler.enable()
        r = pipe.generate("a photograph of an astronaut riding a horse", steps=steps, height=512, width=512, seed=i)
        if profiler:
            profiler.disable()
        runs.append({k: v for k, v in r.timings.items() if isinstance(v, float | int)})
        print(f"staged generation {i} ({way}): total {r.timings['total_ms']:.0f} ms, uploads "
              f"{r.timings.get('weights_upload_ms', 0):.0f} ms", flush=True)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue()[-4000:], flush=True)
    return {"runs": runs, "profile_top": text.getvalue()[-12000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--component", choices=["unet", "vae", "text_encoder"], default="unet")
    ap.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ways", default="copy+write,write,mapped,ring,one-write")
    ap.add_argument("--generation", type=Path, help="also profile staged generations of this model folder")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from engine.device import get_gpu

    gpu = get_gpu()
    device = gpu.device
    state = weights(args.component, args.dtype)
    arrays = list(state.values())
    total = sum(a.nbytes for a in arrays)
    print(f"{gpu.caps.device} ({gpu.caps.backend}): {args.component} {args.dtype}, {len(arrays)} weights, "
          f"{total / 1e9:.3f} GB", flush=True)
    probe = [0, len(arrays) // 2, len(arrays) - 1]
    rows = []
    for way in args.ways.split(","):
        times = []
        for rep in range(args.reps + 1):
            t0 = time.perf_counter()
            bufs = upload(device, way, arrays)
            device.queue.read_buffer(bufs[-1], 0, 4)  # waits for every write before it
            ms = (time.perf_counter() - t0) * 1e3
            if rep == 0 and way != "one-write":  # the bytes arrived
                for i in probe:
                    got = np.frombuffer(device.queue.read_buffer(bufs[i], 0, _padded(arrays[i].nbytes)), np.uint8)
                    assert np.array_equal(got[:arrays[i].nbytes], arrays[i].reshape(-1).view(np.uint8)), (way, i)
            for b in bufs:
                b.destroy()
            if rep:
                times.append(ms)
        med = statistics.median(times)
        rows.append({"way": way, "median_ms": med, "min_ms": min(times), "max_ms": max(times),
                     "gb_per_s": total / med / 1e6, "times_ms": times})
        print(f"{way:12s} {med:9.1f} ms ({min(times):.1f}-{max(times):.1f})  {total / med / 1e6:6.2f} GB/s",
              flush=True)
    generation = profile_generation(args.generation, args.steps) if args.generation else None
    doc = {"benchmark": "weight_upload", "generation": generation, "date": time.strftime("%Y-%m-%d"), "adapter": gpu.caps.device,
           "backend": gpu.caps.backend, "component": args.component, "dtype": args.dtype, "weights": len(arrays),
           "bytes": total, "reps": args.reps, "python": platform.python_version(), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
