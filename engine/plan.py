"""Engine plans: what the engine runs for one model, profile, precision, image size, step count
and scheduler, written down as data that any WebGPU runtime can execute (docs/engine-plans.md
is the format's reference; engine/plan_exec.py and engine/web/plan.js are its executors).

A plan is recorded, not written by hand: the networks run on a `PlanRecorder`, a GPU context that
keeps every buffer, pipeline and dispatch the real GPU context would make, in the same order, with
the buffer pool's reuse (so an executor needs no allocator of its own), and the denoising loop
(engine/denoise.py, the one `Pipeline.generate` runs) is recorded as it runs the scheduler's
own program (engine/schedulers/program.py), unrolled into dispatches. So a plan replayed
through wgpu-native runs exactly the kernels `Pipeline.generate` runs, in the same order, and
gives the same bits on the same adapter.

Weights are named, never embedded: component, tensor name and byte range in the model's
safetensors file, the stored and the GPU element type, and the sha256 of the stored bytes
(the device caches them by it). Host data a generation needs whatever its seed (timestep
embeddings, uniform parameters) is embedded, base64; what depends on the request (token ids,
initial latents, noise draws) is an input the caller writes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .denoise import DenoisingLoop
from .device import JS_LIMIT_NAMES
from .errors import InputError
from .gpu import DTYPES, Tensor, _align, _Memory, dtype_of, pack_params
from .kernels import (
    SHADER_HEADERS,
    SHADER_ROOT,
    Variant,
    precision_notes,
    shader_name,
    storage_dtype,
)

SCHEMA = 1
FORMAT = "devicefarm-engine-plan"

@dataclass(frozen=True)
class WeightRef:
    """A weight by where it lives, not by its values (a PlanRecorder uploads these)."""

    component: str
    name: str
    shape: tuple[int, ...]
    stored: str  # safetensors dtype tag: F32, F16, BF16
    file: str | None = None  # relative to the model folder; None for shape-only plans
    offset: int | None = None
    length: int | None = None
    sha256: str | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


class _Buf:
    """A recorded buffer: an id and a size."""

    __slots__ = ("id", "size")

    def __init__(self, buffer_id: int, size: int):
        self.id, self.size = buffer_id, size

    def destroy(self):
        pass  # buffers of a plan live as long as the plan's executor


class PipelineRef:
    __slots__ = ("id",)

    def __init__(self, pipeline_id: int):
        self.id = pipeline_id


class _RecordingPipelines:
    """PipelineCache's interface, handing out plan pipeline ids instead of compiled pipelines."""

    def __init__(self, recorder: PlanRecorder):
        self.recorder = recorder

    def get(self, variant: Variant, dtype: str, constants=None, entry: str | None = None):
        return self.recorder.pipeline(variant, dtype, constants or {}, entry or variant.entry)


class PlanRecorder(_Memory):
    """A GPU context that records instead of running: buffers, pipelines, uniform data and the
    commands of the block being recorded (`commands_into`). Reads return zeros."""

    def __init__(self, caps):
        self.caps = caps
        self.buffers: list[dict[str, Any]] = []
        self.pipelines: list[dict[str, Any]] = []
        self._pipeline_ids: dict[tuple, int] = {}
        self.uniforms: list[str] = []  # base64 of each uniform buffer's bytes
        self._uniform_ids: dict[bytes, int] = {}
        self.commands: list[dict[str, Any]] | None = None
        self.dispatches = 0
        self.max_groups = 0
        self.max_bindings = 0
        self.max_binding_bytes = 0
        limit = caps.limits.get("max-buffer-size")
        self._init_memory(lambda size: self._buffer("activation", size), None if limit is None else int(limit))

    def pipeline_cache(self, gpu=None) -> _RecordingPipelines:
        return _RecordingPipelines(self)

    # ---- buffers --------------------------------------------------------------------------

    def _buffer(self, kind: str, size: int, **info) -> _Buf:
        buf = _Buf(len(self.buffers), _align(max(size, 4)))
        self.buffers.append({"id": buf.id, "kind": kind, "size": buf.size, **info})
        return buf

    def empty(self, shape, dtype: str = "f32", at_least: int = 0) -> Tensor:
        return self._pooled(shape, dtype, at_least)

    def state(self, shape, dtype: str, name: str) -> Tensor:
        """A buffer outside the pool (the denoising loop's state: it outlives every stage)."""
        nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
        return self._static(self._buffer("state", nbytes, name=name), _align(max(nbytes, 4)), shape, dtype)

    def upload(self, array, dtype: str | None = None, static: bool = False) -> Tensor:
        if isinstance(array, WeightRef):
            nbytes = math.prod(array.shape) * np.dtype(DTYPES[dtype]).itemsize
            info = {"component": array.component, "name": array.name, "shape": list(array.shape),
                    "dtype": dtype, "stored": array.stored}
            if array.file is not None:
                info |= {"file": array.file, "offset": array.offset, "length": array.length,
                         "sha256": array.sha256}
            buf = self._buffer("weight", nbytes, **info)
            return self._static(buf, buf.size, array.shape, dtype)
        data = np.ascontiguousarray(array, dtype=DTYPES[dtype or dtype_of(np.asarray(array))])
        dtype = dtype or dtype_of(data)
        if static:
            buf = self._buffer("constant", data.nbytes, dtype=dtype, shape=list(data.shape), data=_b64(data))
            return self._static(buf, buf.size, data.shape, dtype)
        t = self.empty(data.shape, dtype)
        self.write(t, data)
        return t

    def write(self, t: Tensor, data: np.ndarray) -> None:
        raw = np.ascontiguousarray(data, dtype=DTYPES[t.dtype]).tobytes()
        self._emit({"op": "write", "buffer": t.storage.buffer.id, "data": base64.b64encode(raw).decode()})

    def read(self, t: Tensor) -> np.ndarray:
        return np.zeros(t.shape, DTYPES[t.dtype])

    def flush(self):
        pass

    def sync(self):
        pass

    # ---- pipelines and dispatches ---------------------------------------------------------

    def pipeline(self, variant: Variant, dtype: str, constants: dict, entry: str) -> PipelineRef:
        key = (variant.op, variant.name, dtype, tuple(sorted(constants.items())), entry)
        pid = self._pipeline_ids.get(key)
        if pid is None:
            pid = self._pipeline_ids[key] = len(self.pipelines)
            self.pipelines.append({"id": pid, "shader": shader_name(variant, dtype), "dtype": dtype,
                                   "entry": entry, "constants": {k: v for k, v in sorted(constants.items())},
                                   "requires": sorted(variant.requires)})
        return PipelineRef(pid)

    def _uniform(self, params: tuple) -> int:
        raw = pack_params(params)
        uid = self._uniform_ids.get(raw)
        if uid is None:
            uid = self._uniform_ids[raw] = len(self.uniforms)
            self.uniforms.append(base64.b64encode(raw).decode())
        return uid

    def dispatch(self, pipeline: PipelineRef, label: str, params: tuple, tensors: list, groups):
        gx, gy, gz = groups
        if max(gx, gy, gz) > self.caps.max_workgroups:
            raise InputError(f"{label}: grid {groups} exceeds max-compute-workgroups-per-dimension")
        if gx == 0 or gy == 0 or gz == 0:
            return
        bindings = [[i + 1, t.storage.buffer.id, t.binding_bytes] for i, t in enumerate(tensors) if t is not None]
        self.max_groups = max(self.max_groups, gx, gy, gz)
        self.max_bindings = max(self.max_bindings, len(bindings))
        self.max_binding_bytes = max([self.max_binding_bytes, *(b[2] for b in bindings)])
        self.dispatches += 1
        self._emit({"op": "dispatch", "pipeline": pipeline.id, "uniform": self._uniform(params),
                    "bindings": bindings, "groups": [gx, gy, gz], "label": label})

    # ---- command lists ----------------------------------------------------------------------

    def _emit(self, command: dict[str, Any]) -> None:
        if self.commands is None:
            raise RuntimeError(f"{command['op']} recorded outside any command list")
        self.commands.append(command)

    @contextmanager
    def commands_into(self, commands: list[dict[str, Any]]):
        outer, self.commands = self.commands, commands
        try:
            yield commands
        finally:
            self.commands = outer

    def emit(self, op: str, **fields) -> None:
        self._emit({"op": op, **fields})


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode()


def _io(t: Tensor) -> dict[str, Any]:
    return {"buffer": t.storage.buffer.id, "dtype": t.dtype, "shape": list(t.shape)}


# ---- weights -----------------------------------------------------------------------------------


def weight_refs(config, model_dir: Path | None, *, hashes: bool = True) -> dict[str, dict[str, WeightRef]]:
    """{component: {parameter name: WeightRef}}: where each parameter lives in the model's
    safetensors (and its sha256), or shapes alone when there is no model folder."""
    from .models import params
    from .weights.loader import check_shapes, component_tensors

    shapes = {"text_encoder": params.clip_param_shapes(config.text_encoder),
              "unet": params.unet_param_shapes(config.unet), "vae": params.vae_param_shapes(config.vae)}
    refs: dict[str, dict[str, WeightRef]] = {}
    for component, expected in shapes.items():
        if model_dir is None:
            refs[component] = {k: WeightRef(component, k, tuple(s), "F32") for k, s in expected.items()}
            continue
        source = component_tensors(model_dir, component)
        check_shapes(expected, {k: (h.tensors[fk].shape, h.tensors[fk].dtype, h.path)
                                for k, (h, fk) in source.items()}, component)
        out = {}
        for key in expected:
            header, file_key = source[key]
            info = header.tensors[file_key]
            digest = _range_sha256(header.path, info.begin, info.end) if hashes else None
            out[key] = WeightRef(component, key, tuple(info.shape), info.dtype,
                                 str(Path(header.path).resolve().relative_to(Path(model_dir).resolve())),
                                 info.begin, info.end - info.begin, digest)
        refs[component] = out
    return refs


def _range_sha256(path: Path, begin: int, end: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(begin)
        left = end - begin
        while left:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                raise InputError(f"{path} ends before byte {end}")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


# ---- the plan -----------------------------------------------------------------------------------


def record_plan(config, caps, *, model_dir: Path | None = None, precision: str = "fp32", height: int | None = None,
                width: int | None = None, steps: int = 20, scheduler: str = "pndm", guidance_scale: float = 7.5,
                profile=None, model_name: str = "", hashes: bool = True,
                strength: float | None = None, scratch_divisor: int = 1,
                vae_dtype: str | None = None, keep_derived: bool = True,
                decodes_again: bool = False) -> dict[str, Any]:
    """The plan of one generation configuration on an adapter with `caps` (its features decide
    shader-f16 and which variants may run, its limits the chunking and grids), recorded from the
    denoising loop `Pipeline.generate` runs (engine/denoise.py). Needs the
    model's config alone; `model_dir` adds where each weight lives (without it the plan names
    tensors and shapes only, for inspection). With `strength`, image-to-image: the plan also
    encodes an input image (stage vae_encode) and denoises the last int(steps * strength)
    steps from it.

    A VAE the model marks force_upcast runs in f32 in a model of halves, unless the plan is for an
    executor that decodes again in f32 where its halves overflow (`decodes_again`: the native plan
    executor; then in f16, engine.pipeline._vae_dtype), and except where an f32 decoder would
    bind a tensor over the adapter's
    max-storage-buffer-binding-size (SD 1.4 at 512x512: 256 MiB, where some Qualcomm drivers
    give 128): then its tensors are stored as halves too (`vae_dtype` f16s, arithmetic still f32),
    and the plan says so in its warnings. `keep_derived=False` makes what a profile would keep for a
    generation (Winograd's transformed filters, PRETRANSFORM) at every step instead: less memory
    (record_plan_within's first step down for a budget)."""
    from .kernels import PRECISIONS
    from .models.unet import ContextKV
    from .pipeline import (
        STAGE_WEIGHTS,
        Pipeline,
        _PaddingTokenizer,
        _selection,
        _vae_dtype,
        check_generate_args,
        vae_input_scale,
    )
    from .schedulers.program import loop_program

    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    height, width = height or config.native_size[0], width or config.native_size[1]
    check_generate_args(config.vae.vae_scale_factor, steps, height, width, scheduler, guidance_scale, strength)
    f = config.vae.vae_scale_factor
    dtype = storage_dtype(precision, caps.has_f16)
    notes = precision_notes(caps.device, precision, dtype)
    rule = _vae_dtype(config, dtype, decodes_again)
    asked_vae_dtype, vae_dtype = vae_dtype, vae_dtype or rule
    if asked_vae_dtype == "f16s" and rule == "f32":
        notes.append("the VAE decoder's f32 tensors exceed the adapter's max-storage-buffer-binding-size: it "
                     "stores them as halves (f16-storage, f32 arithmetic) although the model asks for f32")
    selection = _selection(caps, profile)
    if not keep_derived and _prepares(selection):
        selection.rules = [replace(r, constants=tuple((k, v) for k, v in r.constants if k != "PRETRANSFORM"))
                           for r in selection.rules]
        notes.append("Winograd's transformed filters are made at every step, not kept for the generation: "
                     "the plan fits its memory budget only so")
    refs = weight_refs(config, model_dir, hashes=hashes)
    if strength is None:  # text to image binds no VAE encoder weight: the plan holds none (130 MiB in SD 1.4)
        encoder = STAGE_WEIGHTS["vae_encoder"][1]
        refs = {**refs, "vae": {k: r for k, r in refs["vae"].items() if not encoder(k)}}
    rec = PlanRecorder(caps)
    pipe = Pipeline(config, _PaddingTokenizer(), refs, None, dtype, selection, [], "resident", rt=rec,
                    scratch_divisor=scratch_divisor, vae_dtype=vae_dtype)
    cfg_on = guidance_scale > 1.0
    batch = 2 if cfg_on else 1
    latent = (1, config.unet.in_channels, height // f, width // f)
    stages: dict[str, dict[str, Any]] = {}

    def stage(name: str, inputs: dict[str, Tensor], body):
        commands: list[dict[str, Any]] = []
        with rec.commands_into(commands):
            outputs = body()
        stages[name] = {"inputs": {k: _io(t) for k, t in inputs.items()},
                        "outputs": {k: _io(t) for k, t in outputs.items()}, "commands": commands}
        return outputs

    ids = rec.empty((batch, 77), "u32")
    ctx = stage("text_encoder", {"input_ids": ids}, lambda: {"context": pipe.text_encoder(ids)})["context"]
    # the cross-attentions' keys and values of the context: once a generation, in buffers of the
    # plan's that unet_step reads (not outputs: no caller reads them back)
    kv = ContextKV()
    sample = rec.empty((batch, *latent[1:]), dtype)
    temb = rec.empty((batch, config.unet.block_out_channels[0]), dtype)

    def project_context():
        kv.update(pipe.unet_model.context_kv(ctx))
        if _prepares(selection):
            # what the step derives from its weights once (Ops.prepare) is made here, once a
            # generation: a step recorded and thrown away, whose fills go to this stage's list
            kv.prepared.sink, kept, counted = rec.commands, len(rec.commands), rec.dispatches
            with rec.commands_into([]):
                pipe.unet_model(sample, temb, kv)
            kv.prepared.sink = None
            rec.dispatches = counted + sum(c["op"] == "dispatch" for c in rec.commands[kept:])
        return {}

    stage("unet_context", {"context": ctx}, project_context)
    eps = stage("unet_step", {"sample": sample, "timestep_embedding": temb},
                lambda: {"noise_pred": pipe.unet_model(sample, temb, kv)})["noise_pred"]
    latents_in = rec.empty(latent, "f32")
    scale = vae_input_scale(config)
    image = stage("vae_decode", {"latents": latents_in},
                  lambda: {"image": pipe.vae.decode(pipe.vae.ops.step_prepare(latents_in, scale, 1))})["image"]

    if strength is not None:
        image_in = rec.empty((1, 3, height, width), vae_dtype)
        moments = stage("vae_encode", {"image": image_in}, lambda: {"moments": pipe.vae.encode(image_in)})["moments"]
    program = loop_program(scheduler, config.scheduler, steps, latent, strength=strength)
    loop = _RecordedLoop(rec, pipe, program, float(guidance_scale) if cfg_on else None, latent,
                         sample=sample, temb=temb, eps=eps)
    generate: list[dict[str, Any]] = []
    with rec.commands_into(generate):
        rec.emit("input", name="input_ids", buffer=ids.storage.buffer.id)
        rec.emit("run", stage="text_encoder")
        rec.emit("run", stage="unet_context")
        if strength is None:
            first = {"x0": loop.out("x0")}
            rec.emit("input", name="latents", buffer=first["x0"].storage.buffer.id)
        else:
            rec.emit("input", name="image", buffer=image_in.storage.buffer.id)
            rec.emit("run", stage="vae_encode")
            i0 = loop.out("i0")
            n0 = rec.state(latent, "f32", "posterior_noise")
            rec.emit("input", name="noise", index=0, buffer=n0.storage.buffer.id)
            first = {"i0": pipe.vae.ops.step_posterior(moments, n0, float(np.float32(config.vae.scaling_factor)),
                                                       out=i0)}
            first["n1"] = loop.draw("n1")
        final = loop.run(first)
        rec.emit("copy", src=final.storage.buffer.id, dst=latents_in.storage.buffer.id, size=final.binding_bytes)
        rec.emit("run", stage="vae_decode")

    plan = _assemble(rec, dtype, vae_dtype, {
        "model": {"name": model_name, "config_sha256": _config_hash(config)},
        "precision": precision, "dtype": dtype, "vae_dtype": vae_dtype, "scratch_divisor": scratch_divisor,
        "height": height, "width": width, "steps": steps, "scheduler": scheduler,
        "guidance_scale": float(guidance_scale), "batch": batch, "strength": strength,
        "profile": {"name": selection.profile_name, "decisions": _decisions(selection)},
        "warnings": notes + list(selection.warnings),
        "adapter": {"vendor": caps.vendor, "architecture": caps.architecture, "device": caps.device},
        "stages": stages,
        "loop": {**program.as_dict(), "slots": loop.slots},
        "inputs": {"input_ids": {"dtype": "u32", "shape": [batch, 77]},
                   **({"latents": {"dtype": "f32", "shape": list(latent)}} if strength is None else
                      {"image": {"dtype": vae_dtype, "shape": [1, 3, height, width]}}),
                   "noise": {"dtype": "f32", "shape": list(latent), "count": program.noise_draws}},
        "outputs": {"image": _io(image), "latents": _io(final)},
        "generate": generate,
    })
    limit = caps.limits.get("max-storage-buffer-binding-size")
    vae_stages = [s for s in ("vae_decode", "vae_encode") if s in stages]
    if (asked_vae_dtype is None and dtype in ("f16", "f16s") and vae_dtype == "f32" and limit
            and max(b[2] for s in vae_stages for c in stages[s]["commands"] if c["op"] == "dispatch"
                    for b in c["bindings"]) > limit):
        return record_plan(config, caps, model_dir=model_dir, precision=precision, height=height, width=width,
                           steps=steps, scheduler=scheduler, guidance_scale=guidance_scale, profile=profile,
                           model_name=model_name, hashes=hashes, strength=strength, scratch_divisor=scratch_divisor,
                           vae_dtype="f16s", keep_derived=keep_derived)
    return plan


def _prepares(selection) -> bool:
    """Whether a profile's rules keep anything a step derives from its weights (PRETRANSFORM)."""
    return any(dict(r.constants).get("PRETRANSFORM") for r in selection.rules)


# Divisors of the chunked kernels' scratch bounds a plan for a memory budget tries, in order: each
# halves the Winograd, im2col and split-K scratch (more, smaller dispatches) and so the stage
# whose working set is the peak (SD 1.4's UNet at 512x512: 16 MiB bounds are ~20 MB of its 2.1 GB).
SCRATCH_DIVISORS = (1, 2, 4)


def record_plan_within(config, caps, budget_bytes: int | None, residency: str = "auto", **kwargs) -> dict[str, Any]:
    """record_plan, within `budget_bytes` in `residency` (engine.fit; staged keeps nothing derived
    for a generation): first without what the profile keeps for a generation (keep_derived=False:
    about 1 GB in SD 1.4 where a profile keeps Winograd's filters), then with the scratch bounds
    divided (SCRATCH_DIVISORS), until the plan's peak fits: the first plan that fits, or the last
    one tried (whose fit says what does not fit). No budget: record_plan's plan."""
    from .fit import effective_budget, plan_memory

    # staged residency is the one kept within a memory budget: it keeps nothing derived (as a
    # staged Pipeline's context_kv)
    plan = record_plan(config, caps, keep_derived=residency != "staged", **kwargs)
    budget_bytes = effective_budget(caps, budget_bytes)
    if budget_bytes is None or plan_memory(plan).peak(residency) <= budget_bytes:
        return plan
    keeps = any(d["constants"].get("PRETRANSFORM") for d in plan["profile"]["decisions"])  # else keep_derived changes nothing
    smaller = [d for d in SCRATCH_DIVISORS if d > 1]
    tries = [(1, False)] * keeps + [(d, False) for d in smaller] + [(d, True) for d in smaller] * keeps
    for divisor, keep in tries:
        plan = record_plan(config, caps, scratch_divisor=divisor, keep_derived=keep, **kwargs)
        if plan_memory(plan).peak(residency) <= budget_bytes:
            break
    return plan


def _assemble(rec: PlanRecorder, *dtypes_and_fields) -> dict[str, Any]:
    """A plan from what `rec` recorded plus the caller's fields, with what it requires of the
    adapter and its hash."""
    *dtypes, fields = dtypes_and_fields
    features = {f for p in rec.pipelines for f in p["requires"]} | ({"shader-f16"} if "f16" in dtypes else set())
    plan = {
        "format": FORMAT, "schema": SCHEMA, **fields,
        "requires": {"features": sorted(features),
                     "limits": {JS_LIMIT_NAMES[k]: v for k, v in (
                         ("max-storage-buffer-binding-size", rec.max_binding_bytes),
                         ("max-buffer-size", max(b["size"] for b in rec.buffers)),
                         ("max-compute-workgroups-per-dimension", rec.max_groups),
                         ("max-storage-buffers-per-shader-stage", rec.max_bindings))}},
        "shaders": _shaders(rec.pipelines),
        "shader_header": dict(SHADER_HEADERS),
        "pipelines": rec.pipelines,
        "uniforms": rec.uniforms,
        "buffers": rec.buffers,
    }
    plan["sha256"] = plan_hash(plan)
    return plan


def op_plan(caps, dtype: str, inputs: dict[str, tuple[tuple[int, ...], str]], build, name: str = "op") -> dict:
    """A plan of one stage, `name`, that runs what `build(recorder, {input: tensor})` records
    (an op, or a few) and returns (a tensor or {output name: tensor}): how single kernels are
    checked in an executor (the browser's tests)."""
    rec = PlanRecorder(caps)
    tensors = {k: rec.empty(shape, dt) for k, (shape, dt) in inputs.items()}
    commands: list[dict[str, Any]] = []
    with rec.commands_into(commands):
        out = build(rec, tensors)
    outputs = out if isinstance(out, dict) else {"out": out}
    return _assemble(rec, dtype, {
        "stages": {name: {"inputs": {k: _io(t) for k, t in tensors.items()},
                          "outputs": {k: _io(t) for k, t in outputs.items()}, "commands": commands}},
        "inputs": {}, "outputs": {}, "generate": [],
    })


class _RecordedLoop(DenoisingLoop):
    """The denoising loop on a PlanRecorder: every source gets a state buffer (a slot), taken
    when the loop first writes it and reusing one whose source is no longer read, so the loop
    needs the fewest latent-sized buffers; each UNet call becomes a run of stage unet_step and
    each noise draw an input the caller writes."""

    def __init__(self, rec: PlanRecorder, pipe, program, guidance_scale: float | None, latent: tuple, *,
                 sample: Tensor, temb: Tensor, eps: Tensor):
        super().__init__(pipe.ops, program, guidance_scale)
        self.rec, self.pipe, self.latent = rec, pipe, latent
        self.sample, self.temb, self.eps = sample, temb, eps  # unet_step's inputs and output
        self.last_use = program.last_use()
        self.slots: list[dict] = []
        self._live: dict[str, Tensor] = {}  # source -> its slot, until the step after its last read
        self._free: list[Tensor] = []

    def out(self, name: str) -> Tensor:
        if name == "sample":
            return self.sample
        # sources read at this step stay live: an op's output never shares a buffer with its
        # inputs (WebGPU refuses a buffer bound for reading and writing at once)
        for done in [n for n in self._live if self.last_use.get(n, -1) < self.step_index]:
            self._free.append(self._live.pop(done))
        t = self._free.pop() if self._free else self.rec.state(self.latent, "f32", f"slot{len(self.slots)}")
        if t.storage.buffer.id not in {s["buffer"] for s in self.slots}:
            self.slots.append({"buffer": t.storage.buffer.id})
        self._live[name] = t
        return t

    def unet(self, sample: Tensor, timestep: float) -> Tensor:
        # sample is unet_step's own input buffer (out("sample")): the stage reads it there
        self.rec.write(self.temb, self.pipe._temb_array(timestep, self.batch))
        self.rec.emit("run", stage="unet_step")
        return self.eps

    def draw(self, name: str) -> Tensor:
        t = self.out(name)  # n{k}: the caller's k-th noise tensor
        self.rec.emit("input", name="noise", index=int(name[1:]), buffer=t.storage.buffer.id)
        return t

    def begin_step(self, step) -> None:
        self.rec.emit("step", index=step.index, timestep=step.timestep)


def _decisions(selection) -> list[dict[str, Any]]:
    return [{"op": d.op, "shape": d.shape, "variant": d.variant, "constants": d.constants,
             **({"dtype": d.dtype} if d.dtype else {})}
            for d in selection.decisions.values()]


def _shaders(pipelines: list[dict]) -> dict[str, dict[str, str]]:
    out = {}
    for p in pipelines:
        path = SHADER_ROOT / f"{p['shader']}.wgsl"
        out[p["shader"]] = {"path": f"shaders/{p['shader']}.wgsl",
                            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return dict(sorted(out.items()))


def _config_hash(config) -> str:
    import dataclasses

    # the networks and the scheduler; not where the model was read from
    doc = {"text_encoder": dataclasses.asdict(config.text_encoder), "unet": dataclasses.asdict(config.unet),
           "vae": dataclasses.asdict(config.vae), "scheduler": dict(config.scheduler)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def canonical(plan: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in plan.items() if k != "sha256"}, sort_keys=True,
                      separators=(",", ":")).encode()


def plan_hash(plan: dict[str, Any]) -> str:
    """sha256 of the plan's canonical JSON (sorted keys, no spaces) without its own hash."""
    return hashlib.sha256(canonical(plan)).hexdigest()


def stage_inputs(plan: dict[str, Any], stage: str, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """A stage's inputs, each checked against the plan (present, right shape) and in the
    element type the plan gives it; what every executor writes before running a stage."""
    spec = plan["stages"].get(stage)
    if spec is None:
        raise InputError(f"the plan has no stage {stage!r}; it has {', '.join(plan['stages'])}")
    out = {}
    for name, io in spec["inputs"].items():
        if name not in inputs:
            raise InputError(f"stage {stage} needs input {name!r} {tuple(io['shape'])}")
        value = np.asarray(inputs[name])
        if tuple(value.shape) != tuple(io["shape"]):
            raise InputError(f"stage {stage} input {name!r} must have shape {tuple(io['shape'])}, got {value.shape}")
        out[name] = np.ascontiguousarray(value, dtype=DTYPES[io["dtype"]])
    return out


def write_plan(plan: dict[str, Any], out: Path) -> None:
    """Write a plan as compact JSON, atomically (a reader never sees half a plan)."""
    import os

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(plan, separators=(",", ":")))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def load_plan(path: Path) -> dict[str, Any]:
    """A plan file, checked (check_plan)."""
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read plan {path}: {exc}") from exc
    check_plan(plan)
    return plan


def check_plan(plan: dict[str, Any]) -> None:
    """Refuse what an executor cannot run: another format or schema version, a wrong hash."""
    if not isinstance(plan, dict) or plan.get("format") != FORMAT:
        raise InputError(f"not an engine plan (format {plan.get('format') if isinstance(plan, dict) else None!r}, "
                         f"expected {FORMAT!r})")
    if plan.get("schema") != SCHEMA:
        raise InputError(f"plan schema {plan.get('schema')!r}; this engine reads schema {SCHEMA}")
    if plan.get("sha256") != plan_hash(plan):
        raise InputError("plan content does not match its sha256: it was altered or damaged")


def shader_source(plan_pipeline: dict[str, Any]) -> str:
    """The WGSL a plan pipeline compiles, as engine.kernels.specialise makes it."""
    from . import ops  # noqa: F401  (importing it registers every kernel variant)
    from .kernels import specialise, variants

    op, name = plan_pipeline["shader"].split("/")[-2:]  # "packed/<op>/<variant>" for f16-storage
    return specialise(variants(op)[name], plan_pipeline["dtype"])
