"""The GEMM core against the tiled kernels on a model's own products: every distinct linear
shape of the model (text encoder, UNet, VAE) and the batched products its Winograd
convolutions would hand the core (36 per convolution: tiles x Cin by Cout), each timed at every
tile setting the tuner may pick, with the adapter's measured SIMT peak beside them.

    python benchmarks/gemm_core.py --preset sd14 --precision fp16 --json out.json \\
        [--profile engine/profiles/tuned-nvidia-h100-80gb-hbm3.json --write-profile merged.json]

--write-profile writes `--profile` with a rule per linear shape in front, choosing the fastest
of what was measured (the "gemm" core or the tiled kernels), so that a UNet step can be timed
with it (benchmarks/engine_ablation.py bench --tuned merged.json).
Prints a table, writes JSON; medians of --reps timed runs after --warmup, GPU timestamps.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def f16_context():
    """(gpu, a GpuContext on it, its measured peaks) for timing the GEMM core, which needs
    shader-f16; where the adapter has none, that is said on stderr and the script exits 2."""
    from engine.device import get_gpu
    from engine.gpu import GpuContext
    from engine.roofline import measure_peaks

    gpu = get_gpu()
    if not gpu.caps.has_f16:
        print("the GEMM core needs shader-f16; this adapter has none", file=sys.stderr)
        sys.exit(2)
    rt = GpuContext(gpu)
    return gpu, rt, measure_peaks(gpu, rt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=["tiny", "sd14"], default="sd14")
    ap.add_argument("--precision", choices=["fp16"], default="fp16")
    ap.add_argument("--resolution", type=int, help="image side (default: the preset's native)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile", type=Path, help="the profile whose linear constants are the baseline")
    ap.add_argument("--write-profile", type=Path)
    ap.add_argument("--winograd", action="store_true", help="also time Winograd's batched products")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import numpy as np

    from engine.errors import EngineError
    from engine.explain import distinct_calls
    from engine.gpu import time_gpu_work
    from engine.kernels import PipelineCache, Selection, variants
    from engine.make_model import preset_model_config
    from engine.ops import Ops
    from engine.profiles import parse_profile
    from engine.variants import gemm as core

    gpu, rt, peaks = f16_context()
    config = preset_model_config(args.preset)
    res = args.resolution or config.native_size[0]
    pipes = PipelineCache(gpu)
    rng = np.random.default_rng(0)
    print(f"{gpu.caps.device} ({gpu.caps.backend}): measured peaks f32 {peaks.f32_tflops} TFLOP/s, "
          f"f16 {peaks.f16_tflops} TFLOP/s, copy {peaks.gbps} GB/s")
    base_doc = json.loads(args.profile.read_text()) if args.profile else None
    base_sel = parse_profile(base_doc).selection(gpu.caps) if base_doc else Selection(frozenset(gpu.caps.features))

    def ops():
        return Ops(rt, pipes, Selection(frozenset(gpu.caps.features)), "f16")

    def timed(fn) -> float:
        return statistics.median(time_gpu_work(rt, fn, args.warmup, args.reps))

    def upload(*shape, scale=1.0):
        return rt.upload((rng.standard_normal(shape) * scale).astype(np.float32), "f16")

    rows = []
    shapes = [s for op, s, *_ in distinct_calls(config, gpu.caps, "f16", res, res) if op == "linear"]
    for shape in shapes:
        m, n, k = shape["m"], shape["n"], shape["k"]
        x, w, b = upload(m, k), upload(n, k, scale=k**-0.5), upload(n)
        flops = 2.0 * m * n * k
        results = []
        bv, bc = base_sel.choose("linear", shape)
        for name, settings in (("tiled_f16", [{}, {"TILE_M": 64, "TILE_N": 32, "TILE_K": 32}]),
                               ("gemm", [{}, *core.CANDIDATES])):
            v = variants("linear")[name]
            for c in settings:
                try:
                    ms = timed(lambda v=v, c=c: v.launch(ops(), v, c, x, w, b))  # noqa: B023 (timed at once)
                except EngineError as exc:
                    print(f"  skipped {name} {c}: {exc}")
                    continue
                results.append({"variant": name, "constants": c, "median_ms": round(ms, 4),
                                "tflops": round(flops / ms / 1e9, 2)})
        try:
            base_ms = timed(lambda: bv.launch(ops(), bv, bc, x, w, b))  # noqa: B023 (timed at once)
        except EngineError:
            base_ms = None
        best = min(results, key=lambda r: r["median_ms"])
        best_gemm = min((r for r in results if r["variant"] == "gemm"), key=lambda r: r["median_ms"], default=None)
        rows.append({"kind": "linear", "shape": shape, "gflop": flops / 1e9, "baseline": {
            "variant": bv.name, "constants": bc, "median_ms": base_ms}, "best": best, "results": results})
        print(f"linear m={m:5d} n={n:5d} k={k:5d}  baseline {bv.name:9s} {base_ms or float('nan'):7.3f} ms  "
              f"best {best['variant']:9s} {best['constants']} {best['median_ms']:7.3f} ms "
              f"{best['tflops']:6.1f} TFLOP/s ({best['tflops'] / peaks.simt('f16'):.0%} of SIMT f16)"
              + (f"; gemm best {best_gemm['constants']} {best_gemm['median_ms']:.3f} ms" if best_gemm else ""))

    if args.winograd:
        convs = {tuple(sorted(s.items())): s for op, s, *_ in distinct_calls(config, gpu.caps, "f16", res, res)
                 if op == "conv2d" and s["k"] == 3 and s["stride"] == 1 and s["cin"] >= 64}
        for s in convs.values():
            p, cin, cout = s["b"] * s["tiles"], s["cin"], s["cout"]
            a, bt = upload(36, p, cin), upload(36, cout, cin, scale=cin**-0.5)
            flops = 2.0 * 36 * p * cin * cout
            results = []
            for c in [{}, *core.CANDIDATES]:
                try:
                    ms = timed(lambda c=c: core.gemm(ops(), c, a, bt, p, cout, cin, batch=36))  # noqa: B023
                except EngineError:
                    continue
                results.append({"constants": c, "median_ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 2)})
            if not results:
                print(f"winograd {s}: the core cannot run it (N or K not a multiple of 4)")
                continue
            best = min(results, key=lambda r: r["median_ms"])
            direct = 2.0 * s["b"] * cout * s["h"] * s["w"] * cin * 9
            rows.append({"kind": "winograd_gemm", "shape": s, "gflop": flops / 1e9, "best": best, "results": results,
                         "direct_equivalent_tflops": round(direct / best["median_ms"] / 1e9, 2)})
            print(f"winograd 36 x ({p:5d} x {cin:4d}) x {cout:4d}  best {best['constants']} {best['median_ms']:7.3f} ms "
                  f"{best['tflops']:6.1f} TFLOP/s; direct-equivalent {direct / best['median_ms'] / 1e9:6.1f}")

    lin = [r for r in rows if r["kind"] == "linear"]
    if all(r["baseline"]["median_ms"] for r in lin):
        total_base = sum(r["baseline"]["median_ms"] for r in lin)
        total_best = sum(r["best"]["median_ms"] for r in lin)
        print(f"linear shapes, one call each: baseline {total_base:.3f} ms, best {total_best:.3f} ms "
              f"({total_base / total_best:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({
            "date": dt.date.today().isoformat(), "adapter": gpu.caps.device, "backend": gpu.caps.backend,
            "driver": gpu.caps.description, "preset": args.preset, "resolution": res, "reps": args.reps,
            "peaks": {"f32_tflops": peaks.f32_tflops, "f16_tflops": peaks.f16_tflops, "gbps": peaks.gbps},
            "rows": rows}, indent=1))
    if args.write_profile:
        if base_doc is None:
            print("--write-profile needs --profile", file=sys.stderr)
            return 2
        rules = [{"op": "linear", "variant": r["best"]["variant"], "when": r["shape"],
                  **({"constants": r["best"]["constants"]} if r["best"]["constants"] else {})} for r in lin]
        doc = {**base_doc, "rules": rules + [r for r in base_doc["rules"] if r["op"] != "linear"],
               "description": base_doc.get("description", "") + "; linear rules from benchmarks/gemm_core.py"}
        args.write_profile.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.write_profile}: {len(rules)} linear rules")
    return 0 if math.isfinite(sum(r["best"]["median_ms"] for r in rows)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
