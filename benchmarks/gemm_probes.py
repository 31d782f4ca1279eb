"""Where the GEMM core's time goes: the core timed as shipped and with parts of its main loop
taken out, on a few SD shapes, so that the cost of each part shows as the time it saves.

    python benchmarks/gemm_probes.py --json out.json [--reps 20]

A probe is the shipped shader (shaders/linear/gemm.wgsl) with one textual change:

  noflush    the f16 partial sums added to the f32 accumulators once, at the end, not per slab
  nosplat    each row's operand used as the whole vec4 it was read as, not splat per row
  noglobal   no global loads after the first slab (the same staged data is multiplied again)
  nostore    no stores of the next slab to workgroup memory
  nobarrier  no barrier between slabs
  halflds    half the workgroup-memory reads: each invocation's second operand vec4s of A and B
             are its first ones, lanes reversed (same FMAs, same kind of values)
  loop       noglobal + nostore + nobarrier: only the workgroup-memory reads and the FMAs
  loop+...   the loop with one more part out
  flush2     no edit: the shipped core with FLUSH 2 (the slabs in pairs, one flush per pair)

Every probe but the shipped one and flush2 computes a wrong product: this is a measurement of cost, and
its outputs are not checked. Prints a table of medians (GPU timestamps) and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FLUSH_IF = "if (!more || (t - first + 1u) % FLUSH == 0u) {"
PREFETCH_IF = "if (more && PREFETCH) {"
LATE_IF = "if (more && !PREFETCH) {"
STORE_IF = "        if (more) {\n            if (li < qa) { store_a(1u - s"
LOOP_BARRIER = "        workgroupBarrier();\n    }\n\n    let n_lo"


def _splat_out(src: str) -> str:
    for i, (reg, lane) in enumerate([("a0", c) for c in "xyzw"] + [("a1", c) for c in "xyzw"]):
        src = src.replace(f"let x{i} = vec4<f16>({reg}.{lane});", f"let x{i} = {reg};")
    return src


EDITS = {
    "noflush": lambda s: s.replace(FLUSH_IF, "if (!more) {"),
    "nosplat": _splat_out,
    "noglobal": lambda s: s.replace(PREFETCH_IF, "if (false) {").replace(LATE_IF, "if (false) {"),
    "nostore": lambda s: s.replace(STORE_IF, "        if (false) {\n            if (li < qa) { store_a(1u - s"),
    "nobarrier": lambda s: s.replace(LOOP_BARRIER, "    }\n\n    let n_lo"),
    "halflds": lambda s: s.replace("let a1 = As[at + TILE_M / 8u];", "let a1 = a0.wzyx;")
                          .replace("let b1 = Bs[bt + TILE_N / 8u];", "let b1 = b0.wzyx;"),
}
# flash_packed (shaders/attention/flash_packed.wgsl) with a part of its key-block loop taken out:
#   noglobal  K and V staged from Q's workgroup rows instead of global memory (what their loads cost)
#   nos       no S = Q K^T products (the scores stay 0)
#   nopv      no P V products
#   nored     each invocation's row maxima its own: no reads of the other invocations' maxima
#   flush10   no edit: summation lengths of 10 vec4 columns in halves (one flush a block at head dim 40)
ATTN_EDITS = {
    "noglobal": lambda s: s.replace("    if (src == 1u) { return k[i]; }\n    return v[i];",
                                    "    if (p.H == 0u) { return k[i] + v[i]; }  // never: keeps the bindings\n"
                                    "    return qs[(e / DV) * DVP + dv];"),
    "nos": lambda s: s.replace("for (var d0 = 0u; d0 < DV; d0 += FLUSH_DV) {", "for (var d0 = 0u; d0 < 0u; d0 += FLUSH_DV) {"),
    "nopv": lambda s: s.replace("for (var jj = 0u; jj < BK; jj += 4u) {", "for (var jj = 0u; jj < 0u; jj += 4u) {"),
    "nored": lambda s: s.replace("for (var u = 0u; u < TX; u++) { m_new = max(m_new, red[u * TYP + ty]); }",
                                 "m_new = max(m_new, smax);"),
}
ATTN_PROBES = {"shipped": (), "noglobal": ("noglobal",), "nos": ("nos",), "nopv": ("nopv",), "nored": ("nored",),
               "flush10": ()}
ATTN_PROBE_CONSTANTS = {"flush10": {"FLUSH_DV": 10}}
# (label, batch, tokens, heads, head dim, the H100 profile's constants for the shape)
ATTN_SHAPES = (("self-attention 4096 tokens, head dim 40", 2, 4096, 8, 40, {"BQ": 128, "TX": 10, "KPI": 8}),
               ("self-attention 1024 tokens, head dim 80", 2, 1024, 8, 80, {"BQ": 128, "TX": 10}))
PROBES = {
    "shipped": (),
    "noflush": ("noflush",),
    "nosplat": ("nosplat",),
    "noglobal": ("noglobal",),
    "nostore": ("nostore",),
    "nobarrier": ("nobarrier",),
    "loop": ("noglobal", "nostore", "nobarrier"),
    "loop+noflush": ("noglobal", "nostore", "nobarrier", "noflush"),
    "loop+nosplat": ("noglobal", "nostore", "nobarrier", "nosplat"),
    "halflds": ("halflds",),
    "loop+halflds": ("noglobal", "nostore", "nobarrier", "halflds"),
    "flush2": (),
}
PROBE_CONSTANTS = {"flush2": {"FLUSH": 2}}  # probes that set constants rather than edit the source
# (label, batch, m, n, k, B is K x N, tile settings)
SHAPES = (
    ("linear FF1 64x64", 1, 8192, 2560, 320, False, {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16, "PREFETCH": 0}),
    ("linear FF2 64x64", 1, 8192, 320, 1280, False, {"TILE_M": 64, "TILE_N": 128, "TILE_K": 16, "PREFETCH": 0}),
    ("linear qkv 64x64", 1, 8192, 320, 320, False, {}),
    ("winograd 640->640 64x64", 16, 640, 2048, 640, True, {"TILE_M": 128, "TILE_N": 64, "TILE_K": 16}),
    ("im2col 1280->1280 8x8", 2, 1280, 64, 11520, True, {"TILE_M": 32, "TILE_N": 64, "TILE_K": 16, "SPLIT_K": 8}),
)


def probe_source(text: str, edits: tuple[str, ...], table: dict = EDITS, file: str = "linear/gemm.wgsl") -> str:
    for e in edits:
        changed = table[e](text)
        if changed == text:
            raise SystemExit(f"probe edit {e!r} no longer matches shaders/{file}: update the probe")
        text = changed
    return text


def timing_keys(names: list[str]) -> list[str]:
    """A key per timing: a probe named twice is timed twice ("NAME again", "NAME again 2"): the
    shipped kernel first and last shows whether the probes between them left the GPU slower."""
    keys = []
    for i, n in enumerate(names):
        seen = names[:i].count(n)
        keys.append(n if not seen else f"{n} again" if seen == 1 else f"{n} again {seen}")
    return keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--probes", default=",".join(PROBES), help="comma-separated, of: " + ", ".join(PROBES))
    ap.add_argument("--shapes", help="comma-separated indices into the shape list (default: all)")
    ap.add_argument("--data", choices=["normal", "zeros", "ones"], default="normal",
                    help="the operands: N(0,1) (B scaled by K^-0.5), all zero, or all one (B 1/K), and attention's Q, K "
                    "and V the same way: a GPU whose clock falls with its power draw runs the same instructions "
                    "faster on quiet data")
    ap.add_argument("--attention", action="store_true", help="also time flash_packed as the H100 profile runs it, "
                    "with parts of its loop taken out, and again as shipped")
    ap.add_argument("--attention-probes", default="shipped,noglobal,nos,nopv,nored,flush10,shipped",
                    help="comma-separated, of: " + ", ".join(ATTN_PROBES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import numpy as np
    from gemm_core import f16_context

    from engine import kernels
    from engine.gpu import time_gpu_work
    from engine.kernels import PipelineCache, Selection, Variant, variants
    from engine.ops import Ops
    from engine.variants import gemm as core

    gpu, rt, peaks = f16_context()
    print(f"{gpu.caps.device} ({gpu.caps.backend}): measured f16 SIMT peak {peaks.f16_tflops} TFLOP/s")
    rng = np.random.default_rng(0)
    shipped = variants("linear")["gemm"]
    source = shipped.path.read_text()
    tmp = Path(tempfile.mkdtemp(prefix="gemm-probes-"))

    @dataclasses.dataclass(frozen=True)
    class Probe(Variant):
        file: str = ""

        @property
        def path(self) -> Path:
            return Path(self.file)

    names = [p.strip() for p in args.probes.split(",") if p.strip()]
    unknown = [p for p in names if p not in PROBES]
    if unknown:
        ap.error(f"unknown probes {unknown}; known: {', '.join(PROBES)}")
    rows = []
    keys = timing_keys(names)
    print(f"{'shape':28s} " + " ".join(f"{p:>13s}" for p in keys) + "   (ms; TFLOP/s below)")
    chosen = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else list(SHAPES)
    for label, batch, m, n, k, b_kn, tiles in chosen:
        bshape = (batch, k, n) if b_kn else (batch, n, k)
        if args.data == "normal":
            a_np, b_np = rng.standard_normal((batch, m, k)), rng.standard_normal(bshape) * k**-0.5
        else:
            fill = 0.0 if args.data == "zeros" else 1.0
            a_np, b_np = np.full((batch, m, k), fill), np.full(bshape, fill / k)
        a, b = rt.upload(a_np.astype(np.float32), "f16"), rt.upload(b_np.astype(np.float32), "f16")
        flops = 2.0 * batch * m * n * k
        times = {}
        for key in keys:
            name = key.split(" again")[0]
            f = tmp / f"gemm_{name.replace('+', '_')}.wgsl"
            f.write_text(probe_source(source, PROBES[name]))
            probe = Probe(**{fld.name: getattr(shipped, fld.name) for fld in dataclasses.fields(Variant)},
                          file=str(f))
            probe = dataclasses.replace(probe, name=f"gemm~{name}")
            kernels.REGISTRY["linear"]["gemm"] = probe
            try:
                ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f16")
                consts = {**tiles, **PROBE_CONSTANTS.get(name, {})}
                times[key] = statistics.median(time_gpu_work(
                    rt, lambda o=ops, c=consts: core.gemm(o, c, a, b, m, n, k, batch=batch, b_kn=b_kn),  # noqa: B023 (timed at once)
                    args.warmup, args.reps))
            finally:
                kernels.REGISTRY["linear"]["gemm"] = shipped
        rows.append({"shape": label, "batch": batch, "m": m, "n": n, "k": k, "b_kn": b_kn, "constants": tiles,
                     "gflop": flops / 1e9, "ms": {p: round(t, 4) for p, t in times.items()},
                     "tflops": {p: round(flops / t / 1e9, 2) for p, t in times.items()}})
        print(f"{label:28s} " + " ".join(f"{times[p]:13.4f}" for p in keys))
        print(f"{'':28s} " + " ".join(f"{flops / times[p] / 1e9:13.1f}" for p in keys))
    attn_rows = []
    if args.attention:
        packed = variants("attention")["flash_packed"]
        asrc = packed.path.read_text()
        anames = [p.strip() for p in args.attention_probes.split(",") if p.strip()]
        if unknown := [p for p in anames if p not in ATTN_PROBES]:
            ap.error(f"unknown attention probes {unknown}; known: {', '.join(ATTN_PROBES)}")
        akeys = timing_keys(anames)
        for label, bsz, t, heads, dh, shape_consts in ATTN_SHAPES:
            shape = (bsz, t, heads * dh)  # --data as for the products (ones: every score equal)
            q, kk, vv = (rt.upload((rng.standard_normal(shape) if args.data == "normal" else
                                    np.full(shape, 0.0 if args.data == "zeros" else 1.0)).astype(np.float32), "f16")
                         for _ in range(3))
            flops = 4.0 * bsz * heads * t * t * dh
            times = {}
            for key in akeys:
                name = key.split(" again")[0]
                f = tmp / f"flash_packed_{name}.wgsl"
                f.write_text(probe_source(asrc, ATTN_PROBES[name], ATTN_EDITS, "attention/flash_packed.wgsl"))
                probe = Probe(**{fld.name: getattr(packed, fld.name) for fld in dataclasses.fields(Variant)}, file=str(f))
                probe = dataclasses.replace(probe, name=f"flash_packed~{name}")
                ops = Ops(rt, PipelineCache(gpu), Selection(frozenset(gpu.caps.features)), "f16")
                consts = {**shape_consts, **ATTN_PROBE_CONSTANTS.get(name, {})}
                times[key] = statistics.median(time_gpu_work(
                    rt, lambda o=ops, pr=probe, c=consts: pr.launch(o, pr, c, q, kk, vv, heads, False, dh**-0.5),  # noqa: B023
                    args.warmup, args.reps))
            attn_rows.append({"shape": label, "constants": shape_consts, "gflop": flops / 1e9, "ms": {p: round(t, 4) for p, t in times.items()},
                              "tflops": {p: round(flops / t / 1e9, 2) for p, t in times.items()}})
            print(f"{label:40s} " + "  ".join(f"{p} {t:.4f} ms ({flops / t / 1e9:.1f} TFLOP/s)" for p, t in times.items()))
    if args.json:
        args.json.write_text(json.dumps({
            "date": dt.date.today().isoformat(), "adapter": gpu.caps.device, "backend": gpu.caps.backend,
            "driver": gpu.caps.description, "reps": args.reps, "data": args.data, "f16_peak_tflops": peaks.f16_tflops,
            "probes": {p: list(PROBES[p]) for p in set(names)}, "rows": rows,
            "attention_probes": {p: list(ATTN_PROBES[p]) + [f"{c}={x}" for c, x in ATTN_PROBE_CONSTANTS.get(p, {}).items()]
                                 for p in set(anames)} if args.attention else {},
            "attention": attn_rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
