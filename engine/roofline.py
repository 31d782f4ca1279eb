"""The roofline of a UNet step: per op family, GPU time, the work the op must do (FLOPs of the
direct algorithm, bytes of its inputs, weights and outputs read or written once) and how close
the kernels come to the adapter's own ceilings, which the micro-kernels of
shaders/roofline/ measure on the spot (no datasheet constant).

FLOPs are the direct algorithm's (2 m n k for a product; a Winograd convolution is credited
with the direct convolution's FLOPs, so its rate may pass the SIMT peak). Bytes are the
compulsory traffic, so GB/s is a lower bound of what the kernels move.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import numpy as np

from .gpu import GpuContext, time_gpu_work
from .kernels import SHADER_ROOT

ITEM = {"f32": 4, "f16": 2, "f16s": 2}  # f16s: halves in memory, f32 arithmetic


def op_work(op: str, shape: dict, dtype: str) -> tuple[float, float]:
    """(FLOPs, compulsory bytes) of one call of a variant op on `shape`."""
    e = ITEM[dtype]
    if op == "linear":
        m, n, k = shape["m"], shape["n"], shape["k"]
        return 2.0 * m * n * k, float(e * (m * k + n * k + m * n))
    if op == "linear_nchw":
        m, n, k = shape["b"] * shape["t"], shape["n"], shape["k"]
        return 2.0 * m * n * k, float(e * (m * k + n * k + 2 * m * n))
    if op == "conv2d":
        b, cin, cout, h, w, k, s = (shape[x] for x in ("b", "cin", "cout", "h", "w", "k", "stride"))
        oh, ow = math.ceil(h / s), math.ceil(w / s)
        return 2.0 * b * cout * oh * ow * cin * k * k, float(e * (b * cin * h * w + cout * cin * k * k + b * cout * oh * ow))
    if op == "attention":
        b, hd, tq, tk, dh = (shape[x] for x in ("b", "heads", "tq", "tk", "dh"))
        return 4.0 * b * hd * tq * tk * dh, float(e * b * hd * (2 * tq * dh + 2 * tk * dh))
    if op == "group_norm":
        n = shape["b"] * shape["c"] * shape["s"]
        return 8.0 * n, float(2 * e * n)
    if op == "layer_norm":
        n = shape["rows"] * shape["d"]
        return 8.0 * n, float(2 * e * n)
    if op == "geglu":
        n = shape["m"] * shape["f"]
        return 10.0 * n, float(3 * e * n)
    if op == "activation":
        return 8.0 * shape["n"], float(2 * e * shape["n"])
    return 0.0, 0.0


@dataclass
class Peaks:
    """The adapter's ceilings as its micro-kernels reach them."""

    f32_tflops: float
    f16_tflops: float | None  # None without shader-f16
    gbps: float

    def simt(self, dtype: str) -> float:
        return (self.f16_tflops if dtype == "f16" and self.f16_tflops else self.f32_tflops)


def _pipeline(gpu, file: str, entry: str):
    code = (SHADER_ROOT / "roofline" / file).read_text()
    module = gpu.shader_module(code, f"roofline/{file}")  # as the engine's kernels are compiled
    return gpu.device.create_compute_pipeline(label=f"roofline/{entry}", layout="auto",
                                              compute={"module": module, "entry_point": entry})


def measure_peaks(gpu, rt: GpuContext | None = None, reps: int = 5) -> Peaks:
    """FMA throughput in f32 and f16 and copy bandwidth, medians of `reps` timed dispatches,
    each chain lengthened until one dispatch takes at least 2 ms."""
    rt = rt or GpuContext(gpu)
    seeds = rt.upload(np.random.default_rng(0).random(256, dtype=np.float32), "f32")

    cpu = gpu.caps.adapter_type.lower() == "cpu"

    def fma_rate(file: str, entry: str) -> float:
        pipe = _pipeline(gpu, file, entry)
        # enough invocations to fill any GPU (4096 x 256 = 1M), then chains long enough that a
        # dispatch takes 2 ms or more
        groups, iters = (16 if cpu else 4096), 16
        out = rt.empty((groups * 256 * 4,), "f32")
        grid = (groups, 1, 1)
        while True:
            params = (iters, groups * 256)
            ms = statistics.median(time_gpu_work(
                rt, lambda p=params: rt.dispatch(pipe, f"roofline.{entry}", p, [seeds, out], grid), 1, reps))
            if ms >= 2.0 or iters >= 1 << 16:
                break
            iters = min(1 << 16, int(iters * min(16.0, max(2.0, 2.5 / max(ms, 1e-3)))))
        flops = groups * 256 * iters * 8 * 4 * 2  # invocations x steps x chains x lanes x (mul + add)
        return flops / (ms * 1e-3) / 1e12

    f32 = fma_rate("peak.wgsl", "fma_f32")
    f16 = fma_rate("peak_f16.wgsl", "fma_f16") if gpu.caps.has_f16 else None
    n = min(64 << 20, rt.caps.max_binding_bytes) // 16  # vec4<u32> elements: 64 MiB each way at most
    if cpu:
        n = min(n, 1 << 20)
    src, dst = rt.empty((n * 4,), "f32"), rt.empty((n * 4,), "f32")
    pipe = _pipeline(gpu, "peak.wgsl", "copy")
    groups = math.ceil(n / 256)
    gx, gy = min(groups, 65535), math.ceil(groups / 65535)
    ms = statistics.median(time_gpu_work(
        rt, lambda: rt.dispatch(pipe, "roofline.copy", (0, n), [src, dst], (gx, gy, 1)), 1, reps))
    # Four significant digits, not four decimals: a CPU adapter's peak is a small fraction of a
    # TFLOPS (lavapipe on a loaded 2-core machine measured under 0.00005, printed as 0.0).
    return Peaks(_digits(f32), _digits(f16) if f16 is not None else None, _digits(2 * n * 16 / (ms * 1e-3) / 1e9))


def _digits(value: float, significant: int = 4) -> float:
    return float(f"{value:.{significant}g}")


@dataclass
class RooflineRow:
    family: str
    calls: int
    ms: float
    gflop: float
    mbytes: float
    tflops: float
    gbps: float
    simt_fraction: float  # achieved TFLOP/s over the measured SIMT peak of the model's element type
    bandwidth_fraction: float


def roofline(times: dict, work: dict, peaks: Peaks, dtype: str) -> list[RooflineRow]:
    """Rows per op family from `times` (op -> KernelTime, the second of GpuContext.take_times())
    and `work` (op -> [calls, FLOPs, bytes], GpuContext.take_work()), largest time first; kernels
    outside the variant ops (add, concat, transpose, ...) are one row, "other"."""
    rows, other = [], [0, 0.0]
    for family, kt in times.items():
        if family not in work:
            other[0] += kt.calls
            other[1] += kt.total_ms
            continue
        _, flops, nbytes = work[family]
        s = kt.total_ms * 1e-3
        tf, gb = flops / s / 1e12 if s else 0.0, nbytes / s / 1e9 if s else 0.0
        rows.append(RooflineRow(family, work[family][0], round(kt.total_ms, 3), round(flops / 1e9, 3),
                                round(nbytes / 1e6, 2), round(tf, 4), round(gb, 2),
                                round(tf / peaks.simt(dtype), 4), round(gb / peaks.gbps, 4)))
    rows.sort(key=lambda r: -r.ms)
    if other[0]:
        rows.append(RooflineRow("other", other[0], round(other[1], 3), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    return rows


def rows_as_json(rows: list[RooflineRow]) -> list[dict]:
    return [asdict(r) for r in rows]


COLUMNS = ("family", "calls", "ms", "GFLOP", "MB", "TFLOP/s", "GB/s", "of SIMT", "of BW")


def title(doc: dict) -> str:
    """What a roofline document ({"peaks", "dtype", "rows"}) is measured against."""
    pk = doc["peaks"]
    return (f"roofline ({doc['dtype']}; measured peaks: f32 {pk['f32_tflops']} TFLOP/s, "
            f"f16 {pk['f16_tflops'] if pk['f16_tflops'] is not None else '-'} TFLOP/s, copy {pk['gbps']} GB/s)")


def cells(row: dict) -> list[str]:
    """One row of a roofline document as the table's COLUMNS."""
    return [row["family"], str(row["calls"]), f"{row['ms']:.2f}", f"{row['gflop']:.1f}", f"{row['mbytes']:.1f}",
            f"{row['tflops']:.3f}", f"{row['gbps']:.1f}", f"{row['simt_fraction']:.1%}",
            f"{row['bandwidth_fraction']:.1%}"]


def print_roofline(doc: dict, out=print) -> None:
    """Print a roofline document (an AblationRow's) as a plain-text table."""
    widths = (14, 5, 8, 8, 8, 8, 8, 8, 6)
    out(title(doc))
    for row in [list(COLUMNS), *(cells(r) for r in doc["rows"])]:
        out(" ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    total, gflop = sum(r["ms"] for r in doc["rows"]), sum(r["gflop"] for r in doc["rows"])
    out(f"{'total':14s} {sum(r['calls'] for r in doc['rows']):5d} {total:8.2f} {gflop:8.1f} {'':8s} "
        f"{gflop / total if total else 0:8.2f}")
