"""On-device autotuning: for every distinct (op, shape) of a model, time every variant (and
constant setting) the adapter can run, and write a profile for this exact GPU that picks the
fastest, with the measurements inside.

Timing: warm-up runs, then the median of `repeats` rounds in which every candidate runs once
(interleaved, in a rotating order, with the reference kernel as the control that tells a slow
spell of the GPU: `interleaved`), each measured with GPU timestamp queries around every dispatch
(ticks times the queue's timestamp period) when the adapter has timestamp-query and is not a CPU
adapter, else wall-clock to GPU completion. A product is timed with what its caller does after
it (GEGLU, a residual add), fused or not as the candidate can (`_as_called`). The profile is written to a temporary
file and renamed into place at the end, so an interrupted tune leaves no half-written profile.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import EngineError
from .explain import NETWORKS, call_dtype, distinct_calls, random_like
from .gpu import GpuContext, Tensor, time_gpu_work
from .kernels import PipelineCache, Rule, Selection, variants
from .ops import Ops, Prepared
from .profiles import SCHEMA_ID, SHAPE_FIELDS, auto_profile, gpu_architecture

MAX_CONSTANT_SETTINGS = 4  # per variant, to bound tuning time


def _settings(variant, dtype: str) -> list[dict]:
    """The variant's defaults ({}), then its declared candidates (and its f16 ones where the call
    computes in f16), or else settings spread evenly over its constants' product."""
    if variant.candidates:
        extra = variant.f16_candidates if dtype == "f16" else ()
        return [{}] + [dict(c) for c in (*variant.candidates, *extra)]
    if not variant.constants:
        return [{}]
    names = sorted(variant.constants)
    combos = list(itertools.product(*(variant.constants[n] for n in names)))
    step = max(1, len(combos) // (MAX_CONSTANT_SETTINGS - 1))
    return [{}] + [dict(zip(names, c, strict=True)) for c in combos[step // 2 :: step][: MAX_CONSTANT_SETTINGS - 1]]


# A round whose control (the reference kernel, timed in every round) took this much more than its
# median was a slow spell of the GPU: its samples are dropped (while most rounds remain).
SLOW_SPELL = 1.25

# A GPU timer whose every reading is a multiple of this many nanoseconds or more is quantized:
# Dawn rounds timestamps down to 65,536 ns unless its `timestamp_quantization` toggle is off, and
# Chrome does the same to a page's. Kernels shorter than the step are then ties.
QUANTIZED_NS = 10_000


class TimerQuantizedWarning(UserWarning):
    """The tune's GPU times came in steps too coarse to tell its short kernels apart."""


def timer_quantum_ns(measurements: list[dict]) -> int:
    """The step of the timer `measurements` were read with: the greatest common divisor, in whole
    nanoseconds, of every candidate's fastest and slowest sample (1 where none is shared, as for
    a timer of nanoseconds or the wall clock, and where fewer than 4 distinct readings leave the
    divisor to chance)."""
    readings = {round(ms * 1e6) for m in measurements for r in m["results"] for ms in (r["min_ms"], r["max_ms"])}
    readings.discard(0)
    return math.gcd(*readings) if len(readings) >= 4 else 1


def interleaved(rt: GpuContext, fns: list[Callable], warmup: int, repeats: int,
                control: int | None) -> tuple[list[list[float]], int]:
    """Time every candidate in `repeats` rounds, one sample each per round, in an order that
    rotates from round to round, so a slow spell of the GPU (the H100's made whole shapes 2-6x
    slow for seconds: docs/benchmarks.md) falls on every candidate alike instead of on the
    ones measured while it lasted. fns[control] (the reference kernel) is the control: rounds
    whose control sample is above SLOW_SPELL times its median are dropped, unless that would
    leave fewer than half. Returns each candidate's samples and the rounds dropped."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    rt.sync()
    n = len(fns)
    rounds = []
    for r in range(repeats):
        row = [0.0] * n
        for j in range(n):
            i = (j + r) % n
            row[i] = time_gpu_work(rt, fns[i], 0, 1)[0]
        rounds.append(row)
    kept = rounds
    if control is not None and rounds:
        calm = statistics.median(row[control] for row in rounds) * SLOW_SPELL
        kept = [row for row in rounds if row[control] <= calm]
        if 2 * len(kept) < len(rounds):
            kept = rounds
    return [[row[i] for row in kept] for i in range(n)], len(rounds) - len(kept)


def _as_called(op: str, shape: dict, v, consts: dict, ops: Ops, args: tuple, after: dict) -> Callable:
    """The call of variant `v` with `consts` as a pipeline makes it: a product whose caller does
    work after it (`after`: Ops.calls' epilogue, a GEGLU or a residual add) goes through the same
    Ops method the pipeline called, on a selection that picks `v` with `consts`, so the work is
    in the product's epilogue where this variant and setting can take it and a kernel after it
    where not, exactly as Ops decides."""
    if op not in ("linear", "conv2d") or not after:
        return lambda: v.launch(ops, v, consts, *args)
    rule = Rule(op, v.name, constants=tuple(sorted(consts.items())))
    as_chosen = Ops(ops.rt, ops.pipelines, Selection(ops.selection.features, [rule], profile_name="tuning"),
                    ops.dtype, scratch_scale=ops.scratch_scale)
    as_chosen.prepared = ops.prepared  # what the setting keeps (PRETRANSFORM), kept across the timed calls
    if after.get("geglu"):
        return lambda: as_chosen.linear_geglu(*args)
    if op == "conv2d":
        return lambda: as_chosen.conv2d(*args, residual=after["residual"])
    return lambda: as_chosen.linear(*args, residual=after["residual"])


WARM_UP_S = 2.0  # GPU work before the first measurement


def warm_up(rt: GpuContext, fn: Callable, seconds: float = WARM_UP_S) -> int:
    """Run `fn` (GPU work) to completion again and again for `seconds`; returns the calls made.
    Meant for a GPU fresh from idle. On the H100 of 2026-11-25 it did not remove the slow spells
    that made a tune's first shapes 2-6x slow (docs/benchmarks.md, "Fifth increment")."""
    calls, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        fn()
        rt.sync()
        calls += 1
    return calls


def shape_filter(where: dict, ops: set[str] | None) -> Rule:
    """A profile rule's `when` ({field: value or {"min": a, "max": b}}) as a filter of the calls a
    tune measures: `tune(where=...)` re-times only the shapes it holds for (a new variant's few
    shapes, without re-timing every other). Its fields must be shape fields of at
    least one op tuned; a call whose op lacks a field named is not measured."""
    if not isinstance(where, dict) or not where:
        raise EngineError('a shape filter is a non-empty object such as {"cout": {"max": 4}}')
    fields = {f for op, fs in SHAPE_FIELDS.items() if ops is None or op in ops for f in fs}
    conds = []
    for key, cond in where.items():
        if key not in fields:
            raise EngineError(f"shape filter: {key!r} is not a shape field of "
                              f"{', '.join(sorted(ops)) if ops else 'any op'}; choose from {', '.join(sorted(fields))}")
        if isinstance(cond, dict) and cond and set(cond) <= {"min", "max"} and all(
                isinstance(v, int) for v in cond.values()):
            conds.append((key, (cond.get("min"), cond.get("max"))))
        elif isinstance(cond, int) and not isinstance(cond, bool):
            conds.append((key, cond))
        else:
            raise EngineError(f'shape filter: {key}={cond!r} is neither an integer nor a range {{"min": a, "max": b}}')
    return Rule("*", "*", tuple(conds))


def tune(
    config,
    gpu,
    dtype: str,
    height: int,
    width: int,
    out: Path,
    warmup: int = 1,
    repeats: int = 5,
    time_budget_s: float = 600.0,
    progress: Callable[[int, int, str], None] | None = None,
    ops: set[str] | None = None,
    networks: set[str] | None = None,
    vae_dtype: str | None = None,
    where: dict | None = None,
    base: dict | None = None,
) -> dict:
    """Measure, choose, and write the profile document to `out` (atomically). Returns it.
    `ops` limits the tuning to those ops, `networks` to those networks' calls (text_encoder,
    unet, vae_decoder); the profile then has rules for them only. `vae_dtype` times the VAE
    decoder in that element type instead of the pipeline's (an f16 VAE where SD 1.x's runs in
    f32): its rules then name it (`when.dtype`), so a VAE in another type keeps its own. A tune
    in f16-storage (`dtype` f16s: packed halves, f32 arithmetic, what Chrome runs where it offers
    no shader-f16) names the element type in every rule and measurement, so that one profile
    holds its settings beside f16's for the same shapes (`base`).
    `where` (shape_filter) limits it to the shapes a rule's `when` would hold for. `base`, a
    profile document, completes what the tune did not measure (merge_tune) before it is written."""
    caps, op_filter = gpu.caps, ops  # (`ops` names each candidate's Ops below)
    unknown_networks = set(networks or ()) - set(NETWORKS)
    if unknown_networks:
        raise EngineError(f"no network {', '.join(sorted(unknown_networks))} to tune; choose from {', '.join(NETWORKS)}")
    calls = distinct_calls(config, caps, dtype, height, width, networks, vae_dtype)
    vae_keys = set()
    if vae_dtype:
        vae_keys = {(op, json.dumps(shape, sort_keys=True))
                    for op, shape, *_ in distinct_calls(config, caps, dtype, height, width, {"vae_decoder"}, vae_dtype)}
    if ops:
        unknown = set(ops) - {c[0] for c in calls}
        if unknown:
            raise EngineError(f"the model has no {', '.join(sorted(unknown))} calls to tune")
        calls = [c for c in calls if c[0] in ops]
    if where is not None:
        keep = shape_filter(where, ops)
        calls = [c for c in calls if keep.matches(c[1])]
        if not calls:
            raise EngineError(f"no call of the model has a shape {json.dumps(where)} holds for")
    rt = GpuContext(gpu)
    pipelines = PipelineCache(gpu)
    rng = np.random.default_rng(0)
    rules, measurements = [], []
    deadline = time.monotonic() + time_budget_s
    selection = Selection(frozenset(caps.features))  # every variant's own defaults, no profile
    # A variant composed of other ops' kernels (linear_nchw's reference: a linear, a transpose and
    # an add) runs them as this adapter's profile chooses, as a pipeline would: with every op's
    # reference kernel instead it would be timed 35x slow (10.7 ms against 0.31 for the H100's
    # 4096-token proj_out) and lose to anything.
    baseline = auto_profile(caps).selection(caps)
    if calls and rt.caps.adapter_type.lower() != "cpu":
        op, shape, args, scale, _ = calls[0]
        first, v = random_like(rt, args, rng), variants(op)["reference"]
        ops0 = Ops(rt, pipelines, selection, call_dtype(first, dtype), scratch_scale=scale)
        warm_up(rt, lambda: v.launch(ops0, v, {}, *first))
    for i, (op, shape, args, scale, epilogue) in enumerate(calls):
        if progress:
            progress(i, len(calls), f"{op} {shape}")
        real = random_like(rt, args, rng)
        done_after = {k: random_like(rt, (v,), rng)[0] if isinstance(v, Tensor) else v for k, v in epilogue.items()}
        # the call's own element type: a VAE in f32 in a pipeline of halves is timed in f32
        dtype_of_call = call_dtype(real, dtype)
        candidates = []  # (variant name, constants, the call as a pipeline would make it)
        for v in variants(op).values():
            if v.requires - caps.features or (v.applies and v.applies(shape)):
                continue
            for consts in _settings(v, dtype_of_call):
                if time.monotonic() > deadline and v.name != "reference":
                    continue  # out of time: only the baseline is still measured
                composed = getattr(v.launch, "composed", False)
                ops = Ops(rt, pipelines, baseline if composed else selection, dtype_of_call, scratch_scale=scale)
                ops.prepared = Prepared()  # what a setting derives from the weights once (PRETRANSFORM): as a generation keeps it
                fn = _as_called(op, shape, v, consts, ops, real, done_after)
                try:
                    fn()  # a setting this shape or adapter cannot take raises here (e.g. a head dim above MAX_DH)
                    rt.sync()
                except EngineError:
                    continue
                candidates.append((v.name, consts, fn))
        control = next((j for j, (name, consts, _) in enumerate(candidates) if name == "reference" and not consts), None)
        samples, dropped = interleaved(rt, [fn for *_, fn in candidates], warmup, repeats, control)
        results = [{"variant": name, "constants": consts, "median_ms": statistics.median(times),
                    "min_ms": min(times), "max_ms": max(times)}
                   for (name, consts, _), times in zip(candidates, samples, strict=True)]
        if not results:
            raise EngineError(f"no variant of {op} could run {shape} in {dtype} on {caps.device}")
        best = min(results, key=lambda r: r["median_ms"])
        # the element type the rule holds for: the VAE's where it was asked for, every call's in
        # an f16-storage tune
        tag = dtype_of_call if dtype == "f16s" or (op, json.dumps(shape, sort_keys=True)) in vae_keys else None
        measurements.append({"op": op, "shape": shape, **({"dtype": tag} if tag else {}),
                             "results": results, "chosen": best["variant"],
                             **({"epilogue": sorted(epilogue)} if epilogue else {}),
                             **({"slow_rounds_dropped": dropped} if dropped else {})})
        # a rule for the reference kernel too where the rule names its type: a profile's rule for
        # the shape in every type (the one merged in: `base`) must not serve a call measured here.
        # Not for an op with no other kernel (activation, geglu): nothing chooses among one.
        if best["variant"] != "reference" or best["constants"] or (tag and len(variants(op)) > 1):
            rule = {"op": op, "variant": best["variant"], "when": shape}
            if tag:
                rule["when"] = {**shape, "dtype": tag}
            if best["constants"]:
                rule["constants"] = best["constants"]
            rules.append(rule)
    if progress:
        progress(len(calls), len(calls), "done")
    architecture = gpu_architecture(caps)
    doc = {
        "schema": SCHEMA_ID,
        "name": f"tuned-{re.sub(r'[^a-z0-9]+', '-', caps.device.lower()).strip('-')}",
        "description": f"measured by farm engine tune on {caps.device} ({caps.backend}, {caps.description}), "
        f"{dtype}, {height}x{width}, {time.strftime('%Y-%m-%d')}",
        "priority": 100,
        "match": {"vendor_id": [caps.vendor_id], "device": f"^{re.escape(caps.device)}$"},
        **({"architecture": architecture} if architecture else {}),
        "rules": rules,
        "measurements": measurements,
    }
    quantum = timer_quantum_ns(measurements)
    if quantum >= QUANTIZED_NS:
        said = (f"this GPU's timestamps came in steps of {quantum / 1000:g} us: kernels shorter than that are "
                "not told apart (Dawn: turn its timestamp_quantization toggle off)")
        doc["description"] += f"; {said}"
        warnings.warn(said, TimerQuantizedWarning, stacklevel=2)
    if base is not None:
        merge_tune(doc, base, op_filter)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return doc


def estimated_gain(doc: dict, baseline, caps) -> dict:
    """What a tuned profile saves against `baseline` (a Profile: the GPU family's), from the
    tune's own kernel measurements: the sum over measured calls of the baseline's choice's
    median time over the sum of the tuned choice's. Calls where the baseline picks a setting
    the tune did not measure are left out and counted. An estimate from single kernels, not a
    UNet step: only a latency run with each profile measures the gain."""
    from .profiles import parse_profile

    tuned_sel, base_sel = parse_profile(doc).selection(caps), baseline.selection(caps)
    total_base = total_tuned = 0.0
    pairs = skipped = 0
    for m in doc.get("measurements", []):
        times = {(r["variant"], json.dumps(r["constants"], sort_keys=True)): r["median_ms"] for r in m["results"]}
        picks = []
        for sel in (base_sel, tuned_sel):  # in the element type the measurement names (its rules name it too)
            variant, consts = sel.choose(m["op"], m["shape"], m.get("dtype"))
            picks.append(times.get((variant.name, json.dumps(dict(consts), sort_keys=True))))
        if None in picks:
            skipped += 1
            continue
        total_base, total_tuned, pairs = total_base + picks[0], total_tuned + picks[1], pairs + 1
    return {"baseline": baseline.name, "gain": total_base / total_tuned if total_tuned > 0 else None,
            "calls": pairs, "calls_not_comparable": skipped}


def merge_tune(doc: dict, base: dict, ops: set[str] | None) -> dict:
    """`doc` (a tune of `ops`, or of every op when None) completed from `base`, another profile
    of the same model: the rules and measurements of the ops not tuned and of the shapes the tune
    did not measure (another network, or another element type: a VAE tuned in f16 keeps base's
    f32 rules), and for every shape the tune measured only with the reference kernel (its time
    budget ran out before the variants: a reference-only result is no verdict), base's rules and
    measurement of that shape instead. Returns doc, changed in place."""
    def key(op: str, when: dict) -> tuple:
        return op, json.dumps(when, sort_keys=True)

    def mkey(m: dict) -> tuple:  # a measurement's shape, with the element type it names
        return key(m["op"], {**m["shape"], **({"dtype": m["dtype"]} if "dtype" in m else {})})

    cut = {mkey(m) for m in doc["measurements"]
           if all(r["variant"] == "reference" for r in m["results"])
           and any(name != "reference" for name in variants(m["op"]))}
    measured = {mkey(m) for m in doc["measurements"]}

    def from_base(k: tuple) -> bool:
        if ops is not None and k[0] not in ops:
            return True
        # a shape the tune cut, or did not measure at all (a tune of some networks, or of another
        # element type): base's rule stays
        return k[1] != "null" and (k in cut or k not in measured)

    doc["measurements"] = [m for m in doc["measurements"] if mkey(m) not in cut]
    doc["measurements"] += [m for m in base.get("measurements", []) if from_base(mkey(m))]
    doc["rules"] += [r for r in base["rules"] if from_base(key(r["op"], r.get("when")))]
    what = f"{', '.join(sorted(ops))} re-tuned" if ops else "re-tuned"
    doc["description"] += f"; {what}, the rest from {base['name']}"
    if cut:
        shapes = f"{len(cut)} shape the time budget cut short keeps" if len(cut) == 1 else \
            f"{len(cut)} shapes the time budget cut short keep"
        doc["description"] += f" ({shapes} {base['name']}'s rules)"
    return doc
