"""How a model's f16-storage kernels store what they write: the elements of one call of a
network (SD 1.4's UNet at 512x512, batch 2, by default), from shapes alone, by the way the
packed kernel (shaders/packed/) writes each output binding:

  halves   a lone half: atomicAnd then atomicOr on its u32 word, two global atomics an element
  pairs    NAME_pair: the whole word by one atomicStore (the buffer also has lone halves)
  words    a plain u32 or vec2<u32> store of whole words, no atomics

f16-storage is what fp16 runs as where there is no shader-f16: Dawn on NVIDIA's Vulkan driver,
which is what a Chrome tab runs, and many phones' browsers. The selection is the shipped
profile's for an adapter without shader-f16 (the H100's through Dawn by default). `--rev` reads
the packed kernels of another commit, for a before/after on the same shapes. A count, not a
timing: the time it saves is measured on the GPU (plan_replay.py --backend dawn).

    python benchmarks/packed_stores.py --json stores.json [--rev a7fa8f0~1]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DECL = re.compile(r"@binding\((\d+)\)\s*var<storage,\s*read_write>\s+(\w+)\s*:\s*array<([^;]*)>\s*;")


def packed_source(path: Path, rev: str | None, cache: dict) -> str:
    rel = path.resolve().relative_to(ROOT)
    packed = Path("shaders/packed", *rel.parts[1:]) if rel.parts[1] != "packed" else rel
    if packed not in cache:
        if rev is None:
            cache[packed] = (ROOT / packed).read_text()
        else:
            cache[packed] = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{packed}"], check=True,
                                           capture_output=True, text=True).stdout
    return cache[packed]


def how_stored(source: str, binding: int) -> str | None:
    """halves, pairs or words for a read_write binding of T's packed form; None for another."""
    for m in DECL.finditer(source):
        if int(m.group(1)) == binding:
            name, word = m.group(2), m.group(3)
            if word in ("u32", "vec2<u32>"):
                return "words"
            if word == "atomic<u32>":
                return "pairs" if f"fn {name}_pair" in source else "halves"
            return None  # f32 scratch (vec4<f32> partial sums) and the like
    return None


def count(config, caps, network: str, size: int, rev: str | None) -> dict:
    from engine.explain import trace_calls
    from engine.gpu import TraceContext
    from engine.ops import Ops
    from engine.profiles import auto_profile

    cache: dict = {}
    rows: dict = collections.defaultdict(lambda: collections.Counter())
    pipeline, dispatch = Ops.pipeline, TraceContext.dispatch

    def traced_pipeline(self, variant, entry=None, **constants):
        return variant

    def traced_dispatch(self, variant, label, params, tensors, groups, *args, **kwargs):
        self.dispatches += 1
        if variant is None:
            return
        source = packed_source(variant.path, rev, cache)
        for i, t in enumerate(tensors):
            if t is not None and t.dtype == "f16s" and (how := how_stored(source, i + 1)):
                rows[label][how] += math.prod(t.shape)

    Ops.pipeline, TraceContext.dispatch = traced_pipeline, traced_dispatch
    try:
        selection = auto_profile(caps).selection(caps)
        trace_calls(config, selection, caps, "f16s", size, size, networks={network})
    finally:
        Ops.pipeline, TraceContext.dispatch = pipeline, dispatch
    return {label: dict(c) for label, c in rows.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=("tiny", "sd14"), default="sd14")
    ap.add_argument("--network", choices=("text_encoder", "unet", "vae_decoder"), default="unet")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--adapter", default="h100", help="h100 (its caps without shader-f16, as Dawn gives) or a "
                    "JSON file of DeviceCaps fields (engine/adapters/*.json)")
    ap.add_argument("--rev", help="also count with the packed kernels of this git revision (before)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from memory_estimate import H100, config_for

    from engine.device import caps_from_dict

    if args.adapter == "h100":
        caps = dataclasses.replace(H100, features=H100.features - {"shader-f16"}, architecture="hopper")
    else:
        caps = caps_from_dict(json.loads(Path(args.adapter).read_text()))
    config = config_for(None, args.preset)
    runs = {"now": count(config, caps, args.network, args.size, None)}
    if args.rev:
        runs = {args.rev: count(config, caps, args.network, args.size, args.rev), **runs}
    kinds = ("halves", "pairs", "words")
    print(f"{args.preset} {args.network} {args.size}x{args.size}, f16-storage on {caps.device or caps.description}: "
          "millions of elements stored, by how")
    labels = sorted({lbl for r in runs.values() for lbl in r}, key=lambda lbl: -sum(runs["now"].get(lbl, {}).values()))
    head = "".join(f" {f'{k} ({name})':>22s}" for name in runs for k in kinds)
    print(f"{'dispatch':32s}{head}")
    for label in labels:
        print(f"{label:32s}" + "".join(f" {runs[name].get(label, {}).get(k, 0) / 1e6:22.1f}" for name in runs
                                       for k in kinds))
    totals = {name: {k: sum(c.get(k, 0) for c in r.values()) for k in kinds} for name, r in runs.items()}
    print(f"{'total':32s}" + "".join(f" {totals[name][k] / 1e6:22.1f}" for name in runs for k in kinds))
    for name, t in totals.items():
        print(f"{name}: {2 * t['halves'] / 1e6:.1f} M global atomic read-modify-writes, "
              f"{t['pairs'] / 2e6:.1f} M atomic word stores")
    if args.json:
        args.json.write_text(json.dumps({"date": dt.date.today().isoformat(), "preset": args.preset,
                                         "network": args.network, "size": args.size, "adapter": caps.device or caps.description,
                                         "features": sorted(caps.features), "elements": runs, "totals": totals},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
