"""The plan executor of the Python engine: runs an engine plan (engine/plan.py) through
wgpu-native. Everything a dispatch needs is built once, when the plan is loaded (pipelines,
buffers, uniform buffers, bind groups), so replaying a stage is a walk over prepared commands
with no allocation, no kernel selection and no Python work per tensor. On one adapter it runs
the kernels `Pipeline.generate` runs, in the same order, and gives the same bits.

`PlanPipeline` puts the Pipeline API (tokenize, encode_text, unet, decode, generate) over
plans: `engine.load_pipeline(model, executor="plan")`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .device import GPU, JS_LIMIT_NAMES, gpu_call
from .errors import EngineError, FitError, GPUError, InputError, ModelError
from .gpu import DTYPES, Fence, GpuContext, StagingRing, read_array, write_array
from .kernels import storage_dtype
from .pipeline import (
    STAGE_WEIGHTS,
    BasePipeline,
    GenerationResult,
    decode_in_f32,
    first_sample,
    image_from_decoded,
    non_finite_warnings,
    overflow_note,
    prepare_image,
)
from .plan import check_plan, stage_inputs

SUBMIT_EVERY = 64  # dispatches per queue submit, as engine.gpu does

_STORED = {"F32": np.float32, "F16": np.float16}


def read_weight(model_dir: Path, buffer: dict[str, Any]) -> np.ndarray:
    """A plan weight's values from its byte range, checked against its sha256, in the plan's
    GPU element type."""
    import hashlib

    path = Path(model_dir) / buffer["file"]
    try:
        with open(path, "rb") as f:
            f.seek(buffer["offset"])
            raw = f.read(buffer["length"])
    except OSError as exc:
        raise ModelError(f"weight {buffer['component']}/{buffer['name']}: cannot read {path}: {exc}") from exc
    if len(raw) != buffer["length"] or hashlib.sha256(raw).hexdigest() != buffer["sha256"]:
        raise ModelError(f"weight {buffer['component']}/{buffer['name']}: bytes {buffer['offset']}-"
                         f"{buffer['offset'] + buffer['length']} of {path} do not match the plan's sha256")
    stored = buffer["stored"]
    if stored == "BF16":
        values = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif stored in _STORED:
        values = np.frombuffer(raw, _STORED[stored])
    else:
        raise ModelError(f"weight {buffer['name']}: stored as {stored}, which the engine does not read")
    return values.astype(DTYPES[buffer["dtype"]])


@dataclass
class _Dispatch:
    pipeline: Any
    bind_group: Any
    groups: tuple[int, int, int]
    label: str


class _KernelClock:
    """Timestamp queries around each dispatch of a profiled replay, added up per kernel label
    (as engine.gpu's profiling does): each dispatch gets a pass of its own, so a profiled
    replay is never a timed one."""

    def __init__(self, device, period_ns: float, capacity: int = 2048, each: bool = False):
        self.device, self.period_ns, self.capacity = device, period_ns, capacity
        self.query_set = device.create_query_set(type="timestamp", count=2 * capacity)
        self.labels: list[str] = []  # of the queries written since the last resolve
        self.totals: dict[str, dict[str, float]] = {}
        self.each = each  # totals per dispatch of a replay (its index, from 0 each replay), not per label
        self.index = 0

    def begin_pass(self, encoder, label: str):
        i = len(self.labels)
        if self.each:
            label, self.index = str(self.index), self.index + 1
        self.labels.append(label)
        return encoder.begin_compute_pass(timestamp_writes={
            "query_set": self.query_set, "beginning_of_pass_write_index": 2 * i, "end_of_pass_write_index": 2 * i + 1})

    @property
    def full(self) -> bool:
        return len(self.labels) >= self.capacity

    def resolve(self, encoder):
        """Record the copy of the queries written so far into a buffer read after the submit."""
        import wgpu

        if not self.labels:
            return None
        n = len(self.labels)
        buffer = self.device.create_buffer(size=16 * n, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        encoder.resolve_query_set(self.query_set, 0, 2 * n, buffer, 0)
        return buffer

    def read(self, buffer) -> None:
        ticks = np.frombuffer(self.device.queue.read_buffer(buffer), dtype=np.uint64).reshape(-1, 2)
        for label, (t0, t1) in zip(self.labels, ticks, strict=True):
            t = self.totals.setdefault(label, {"calls": 0, "total_ms": 0.0})
            t["calls"] += 1
            t["total_ms"] += max(int(t1) - int(t0), 0) * self.period_ns / 1e6
        buffer.destroy()
        self.labels.clear()


class PlanExecutor:
    """One plan loaded on one GPU: `run(stage, inputs)` for a stage alone, `generate(...)`
    for the whole generation.

    Its buffers are held as `residency` says (engine.fit): "resident", all allocated and every
    weight uploaded at load (`weights` may then be shared between executors of one model:
    (component, name, dtype) -> GPU buffer), or "staged", what a stage owns (its weights and
    scratch) allocated and uploaded from the model folder before the stage runs and released
    when another stage runs; "auto" stages only when that alone fits `budget_bytes`. A plan
    that does not fit the adapter or the budget raises FitError before anything is allocated.
    `live_bytes` counts every GPU byte the executor holds, `peak_bytes` the most it held."""

    def __init__(self, plan: dict[str, Any], model_dir: Path | None, gpu: GPU,
                 weights: dict[tuple, Any] | None = None, *, budget_bytes: int | None = None,
                 residency: str = "auto"):
        import wgpu

        from .fit import fit_plan, plan_memory

        check_plan(plan)
        self.plan, self.gpu, self.device = plan, gpu, gpu.device
        self._check_adapter(gpu.caps)
        self.fit = fit_plan(plan, gpu.caps, budget_bytes, residency)
        if not self.fit.fits:
            raise FitError(self.fit.reasons)
        self.residency = self.fit.residency
        self.memory = plan_memory(plan)
        for b in plan["buffers"]:
            if b["kind"] == "weight" and (model_dir is None or "file" not in b):
                raise ModelError(f"plan weight {b['component']}/{b['name']} has no file to load it from")
        self.model_dir = model_dir
        self.weights = {} if weights is None or self.residency == "staged" else weights
        self._usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.buffers: list[Any] = [None] * len(plan["buffers"])
        self.live_bytes = self.peak_bytes = 0
        self.upload_ms = 0.0  # spent on staged buffers (outside every stage's time)
        self._host: dict[tuple, np.ndarray] = {}  # staged: each weight's values, read and checked once
        self.uniforms = [self.device.create_buffer_with_data(data=_unb64(u), usage=wgpu.BufferUsage.UNIFORM)
                         for u in plan["uniforms"]]
        self._hold(sum(len(_unb64(u)) for u in plan["uniforms"]))
        self._allocate(self.memory.persistent)
        if self.residency == "resident":
            self._allocate(range(len(plan["buffers"])))
        # the plan's buffers other than weights
        self.bytes = sum(b["size"] for b in plan["buffers"] if b["kind"] != "weight")
        self.pipelines = self._pipelines()
        self._prepared: dict[str, list[tuple]] = {}  # stage -> commands ready to run
        if self.residency == "resident":
            for name in plan["stages"]:
                self._stage(name)
        self.program = self._prepare(plan["generate"])
        self._encoder = self._pass = None
        self._recorded = 0
        self._clock: _KernelClock | None = None  # set while kernel_times replays a stage
        self._fence = Fence(self.device)
        self.stage_ms: dict[str, float] = {}
        # generate()'s denoising loop runs its steps back to back, with no wait for the GPU
        # between them (the three waits a step it had left the GPU idle while the next commands
        # were recorded: 3 ms a step on an H100); it is timed as a whole, from its first step to
        # the next stage, as stage_ms["unet_step"] over loop_steps steps
        self.loop_steps = 0
        self._loop_t0: float | None = None

    # ---- buffers: resident or staged ------------------------------------------------------------

    def _hold(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _allocate(self, ids) -> None:
        """Create the buffers `ids` that are not on the GPU: weights uploaded (or taken from the
        shared `weights`), constants written, the rest empty. Weights go up as
        GpuContext.upload_way says (through a StagingRing, or a write_buffer each)."""
        ids = list(ids)
        pending = [self.plan["buffers"][i]["size"] for i in ids if self.buffers[i] is None
                   and self.plan["buffers"][i]["kind"] == "weight"]
        ring = StagingRing.sized(self.device, sum(pending) + 8 * len(pending)) \
            if GpuContext.upload_way == "ring" and pending else None
        try:
            self._allocate_with(ids, ring)
            if ring is not None:
                ring.flush()
        finally:
            if ring is not None:
                ring.destroy()

    def _allocate_with(self, ids, ring) -> None:
        for i in ids:
            if self.buffers[i] is not None:
                continue
            b = self.plan["buffers"][i]
            if b["kind"] == "weight":
                key = (b["component"], b["name"], b["dtype"])
                if key not in self.weights:
                    buf = gpu_call(f"allocating weight {b['name']}", self.device.create_buffer, size=b["size"],
                                   usage=self._usage)
                    (self._write if ring is None else ring.write)(buf, self._host_weight(b))
                    self.weights[key] = buf
                buf = self.weights[key]
            else:
                buf = gpu_call(f"allocating plan buffer {b['id']} ({b['size']} bytes)", self.device.create_buffer,
                               size=b["size"], usage=self._usage)
                if b["kind"] == "constant":
                    self._write(buf, np.frombuffer(_unb64(b["data"]), np.uint8))
            self.buffers[i] = buf
            self._hold(b["size"])

    def _host_weight(self, b: dict) -> np.ndarray:
        """A weight's values in the GPU's element type. Staged, they are read from the model
        folder and checked once, then kept in host memory (as the native pipeline keeps its
        staged weights), so each later stage's upload is a copy to the GPU alone, not a read,
        a hash and a conversion of the whole network again."""
        if self.residency != "staged":
            return read_weight(self.model_dir, b)
        key = (b["component"], b["name"], b["dtype"])
        values = self._host.get(key)
        if values is None:
            values = self._host[key] = read_weight(self.model_dir, b)
        return values

    def _release(self, ids) -> None:
        for i in ids:
            buf = self.buffers[i]
            if buf is None:
                continue
            b = self.plan["buffers"][i]
            if b["kind"] == "weight":
                self.weights.pop((b["component"], b["name"], b["dtype"]), None)
            buf.destroy()
            self.buffers[i] = None
            self.live_bytes -= b["size"]

    def _stage(self, name: str) -> list[tuple]:
        """A stage's commands, ready to run: under staged residency what it owns is allocated
        and uploaded first, after what the other stages own is released."""
        prepared = self._prepared.get(name)
        if prepared is not None:
            return prepared
        if name not in self.plan["stages"]:
            raise InputError(f"the plan has no stage {name!r}; it has {', '.join(self.plan['stages'])}")
        if self.residency == "staged":
            self.sync()  # the GPU is done with what is released
            t0 = time.perf_counter()
            for other, ids in self.memory.stage_buffers.items():
                if other != name:
                    self._prepared.pop(other, None)  # its bind groups name buffers released here
                    self._release(ids)
            self._allocate(self.memory.stage_buffers[name])
            self.upload_ms += (time.perf_counter() - t0) * 1e3
        prepared = self._prepared[name] = self._prepare(self.plan["stages"][name]["commands"])
        return prepared

    def release_stages(self) -> None:
        """Staged residency: give back what every stage owns (its weights and scratch) now, as
        running another stage would; a stage allocates and uploads it again when it runs next.
        Resident: nothing is given back."""
        if self.residency != "staged":
            return
        self.sync()  # the GPU is done with what is released
        for name, ids in self.memory.stage_buffers.items():
            self._prepared.pop(name, None)  # its bind groups name buffers released here
            self._release(ids)

    def _check_adapter(self, caps) -> None:
        missing = sorted(set(self.plan["requires"]["features"]) - set(caps.features))
        if missing:
            raise GPUError(f"the plan needs adapter feature(s) {', '.join(missing)}, which {caps.device!r} lacks")
        for ours, js in JS_LIMIT_NAMES.items():
            need, have = self.plan["requires"]["limits"].get(js), caps.limits.get(ours)
            if need is not None and have is not None and need > have:
                raise GPUError(f"the plan needs {js} >= {need}; {caps.device!r} allows {have}")

    def _write(self, buffer, array: np.ndarray) -> None:
        write_array(self.device, buffer, array)

    def _pipelines(self) -> list[Any]:
        from . import ops  # noqa: F401  (importing it registers every kernel variant)
        from .kernels import PipelineCache, variants

        cache = PipelineCache(self.gpu)
        out = []
        for p in self.plan["pipelines"]:
            op, name = p["shader"].split("/")[-2:]  # "packed/<op>/<variant>" for f16-storage
            table = variants(op)
            if name not in table:
                raise EngineError(f"the plan names kernel {p['shader']}, which this engine does not have")
            out.append(cache.get(table[name], p["dtype"], p["constants"] or None, p["entry"]))
        return out

    def _prepare(self, commands: list[dict[str, Any]]) -> list[tuple]:
        prepared = []
        for c in commands:
            op = c["op"]
            if op == "dispatch":
                pipeline = self.pipelines[c["pipeline"]]
                entries = [{"binding": 0, "resource": {"buffer": self.uniforms[c["uniform"]]}}]
                entries += [{"binding": n, "resource": {"buffer": self.buffers[b], "offset": 0, "size": size}}
                            for n, b, size in c["bindings"]]
                group = gpu_call(f"binding the buffers of {c['label']}", self.device.create_bind_group,
                                 layout=pipeline.get_bind_group_layout(0), entries=entries)
                prepared.append(("dispatch", _Dispatch(pipeline, group, tuple(c["groups"]), c["label"])))
            elif op == "write":
                prepared.append(("write", self.buffers[c["buffer"]], _unb64(c["data"])))
            elif op == "copy":
                prepared.append(("copy", self.buffers[c["src"]], self.buffers[c["dst"]], c["size"]))
            elif op in ("run", "input", "step"):
                prepared.append((op, c))
            else:
                raise InputError(f"the plan has a command {op!r} this executor does not know")
        return prepared

    # ---- running --------------------------------------------------------------------------------

    def _flush(self) -> None:
        if self._encoder is None:
            return
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        timestamps = self._clock.resolve(self._encoder) if self._clock is not None else None
        gpu_call("submitting plan work", self.device.queue.submit, [self._encoder.finish()])
        self._encoder, self._recorded = None, 0
        if timestamps is not None:
            self._clock.read(timestamps)

    def sync(self) -> None:
        self._flush()
        self._fence.wait()

    def _walk(self, commands: list[tuple], inputs: dict[str, Any]) -> None:
        for c in commands:
            kind = c[0]
            if kind == "dispatch":
                d = c[1]
                if self._clock is not None and self._clock.full:
                    self._flush()
                if self._encoder is None:
                    self._encoder = self.device.create_command_encoder()
                if self._clock is not None:
                    cpass = self._clock.begin_pass(self._encoder, d.label)
                else:
                    if self._pass is None:
                        self._pass = self._encoder.begin_compute_pass()
                    cpass = self._pass
                cpass.set_pipeline(d.pipeline)
                cpass.set_bind_group(0, d.bind_group)
                cpass.dispatch_workgroups(*d.groups)
                if self._clock is not None:
                    cpass.end()
                self._recorded += 1
                if self._recorded >= SUBMIT_EVERY:
                    self._flush()
            elif kind == "write":
                self._flush()
                self.device.queue.write_buffer(c[1], 0, c[2])
            elif kind == "copy":
                if self._encoder is None:
                    self._encoder = self.device.create_command_encoder()
                if self._pass is not None:
                    self._pass.end()
                    self._pass = None
                self._encoder.copy_buffer_to_buffer(c[1], 0, c[2], 0, c[3])
            elif kind == "run":  # timed to GPU completion, as engine.gpu.StageTimer does
                name = c[1]["stage"]
                if self._loop_t0 is not None and name == "unet_step":  # inside the loop: no wait
                    self._walk(self._stage(name), inputs)
                    continue
                self.sync()
                if self._loop_t0 is not None:  # the loop is done: the stage after it starts
                    self.stage_ms["unet_step"] = (time.perf_counter() - self._loop_t0) * 1e3
                    self._loop_t0 = None
                stage = self._stage(name)  # staged weights go up outside the stage's time
                t0 = time.perf_counter()
                self._walk(stage, inputs)
                self.sync()
                self.stage_ms[name] = self.stage_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
            elif kind == "input":
                spec = c[1]
                value = inputs[spec["name"]]
                if spec["name"] == "noise":
                    value = value[spec["index"]]
                self._flush()
                self._write(self.buffers[spec["buffer"]], value)
            elif kind == "step":
                if self._loop_t0 is None:
                    if "unet_step" in self.plan["stages"]:
                        self._stage("unet_step")  # the loop's weights go up before it is timed
                    self.sync()
                    self._loop_t0 = time.perf_counter()
                self.loop_steps += 1

    def read(self, io: dict[str, Any]) -> np.ndarray:
        self._flush()
        return read_array(self.device, self.buffers[io["buffer"]], io["dtype"], tuple(io["shape"]))

    def run(self, stage: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Write a stage's inputs, run it, read its outputs (host arrays in, host arrays out)."""
        spec = self.plan["stages"].get(stage)
        values = stage_inputs(self.plan, stage, inputs)
        commands = self._stage(stage)  # staged: its buffers exist from here
        self._flush()
        for name, io in spec["inputs"].items():
            self._write(self.buffers[io["buffer"]], values[name])
        self._walk(commands, {})
        return {name: self.read(io) for name, io in spec["outputs"].items()}

    def time_stage(self, stage: str, repetitions: int, warmup: int = 1, seed: int = 0) -> list[float]:
        """Wall times (ms, to GPU completion) of `repetitions` replays of a stage after `warmup`
        untimed ones, its inputs written once (random, as a latency job's)."""
        from .gpu import DTYPES

        commands = self._stage(stage)  # staged: its buffers exist from here
        rng = np.random.default_rng(seed)
        for io in self.plan["stages"][stage]["inputs"].values():
            shape = tuple(io["shape"])
            value = rng.integers(0, 100, shape) if io["dtype"] == "u32" else rng.standard_normal(shape)
            self._write(self.buffers[io["buffer"]], np.asarray(value).astype(DTYPES[io["dtype"]]))
        times = []
        for r in range(warmup + repetitions):
            self.sync()
            t0 = time.perf_counter()
            self._walk(commands, {})
            self.sync()
            if r >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return times

    def kernel_times(self, stage: str, repetitions: int = 1, each: bool = False) -> dict[str, dict[str, float]] | None:
        """Per-kernel GPU times of `repetitions` replays of a stage, as BrowserExecutor's:
        {label: {"calls", "total_ms"}}, None when the adapter has no timestamp-query. The stage
        runs on what its input buffers hold (time_stage writes random inputs). `each`: keyed by
        the dispatch's index in the stage ("0", "1", ...) instead of its label."""
        if not self.gpu.caps.has_timestamps:
            return None
        self.sync()
        self._clock = _KernelClock(self.device, self.gpu.caps.timestamp_period_ns, each=each)
        try:
            commands = self._stage(stage)
            for _ in range(repetitions):
                self._clock.index = 0
                self._walk(commands, {})
            self.sync()
            return self._clock.totals
        finally:
            self._clock.query_set.destroy()
            self._clock = None

    def generate(self, input_ids: np.ndarray, latents: np.ndarray | None, noise: list[np.ndarray],
                 image: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The whole generation: token ids, the first sample (initial latents times the loop's
        init_noise_sigma) or, for an image-to-image plan, the image, and the noise draws in;
        the image (decoded, float) and the final latents out."""
        from .gpu import DTYPES

        inputs: dict[str, Any] = {"input_ids": np.asarray(input_ids).astype(np.uint32),
                                  "noise": [np.asarray(n, np.float32) for n in noise]}
        if "image" in self.plan["inputs"]:
            if image is None:
                raise InputError("this plan is image-to-image: it needs an image")
            inputs["image"] = np.asarray(image).astype(DTYPES[self.plan["inputs"]["image"]["dtype"]])
        else:
            inputs["latents"] = np.asarray(latents, np.float32)
        if len(inputs["noise"]) != self.plan["inputs"]["noise"]["count"]:
            raise InputError(f"the plan draws {self.plan['inputs']['noise']['count']} noise tensors; "
                             f"{len(inputs['noise'])} given")
        self.stage_ms, self.loop_steps, self._loop_t0, self.upload_ms = {}, 0, None, 0.0
        try:
            self._walk(self.program, inputs)
            self.sync()
            if self._loop_t0 is not None:  # a loop with no stage after it
                self.stage_ms["unet_step"] = (time.perf_counter() - self._loop_t0) * 1e3
        finally:
            self._loop_t0 = None
        return {name: self.read(io) for name, io in self.plan["outputs"].items()}


def plan_gpu_bytes(executor) -> int:
    """The most GPU memory an executor has held: its buffers, uniforms and weights (a
    BrowserExecutor reports the page's count)."""
    return executor.peak_bytes


def stage_peak_bytes(executor, stage: str) -> int:
    """The GPU memory an executor holds while `stage` runs: all it holds when its buffers are
    resident; the plan's persistent buffers and what the stage owns when they are staged."""
    if executor.residency != "staged":
        return plan_gpu_bytes(executor)
    memory = executor.memory
    return memory.persistent_bytes + memory.stage_bytes[stage]


# A plan's stages under the names GenerationResult.stage_peak_gpu_bytes gives them.
PEAK_STAGES = {"text_encoder": "text_encoder", "unet_context": "unet_context", "vae_encode": "vae_encode",
               "unet_step": "unet", "vae_decode": "vae_decode"}


def _unb64(text: str) -> bytes:
    import base64

    return base64.b64decode(text)


class PlanPipeline(BasePipeline):
    """The Pipeline API over plans run by PlanExecutor: each call runs the stage (or the whole
    generation) of a plan recorded for its shapes on this GPU's adapter; plans are recorded on
    first use and kept, and share one copy of the weights."""

    executor = "plan"

    def __init__(self, model_dir: Path, config, tokenizer, caps, precision: str, profile=None, *,
                 gpu: GPU | None = None, make_executor=None, budget_bytes: int | None = None,
                 residency: str = "auto"):
        super().__init__(config, tokenizer)
        self.model_dir, self.caps, self._gpu = Path(model_dir), caps, gpu
        self.precision, self.profile = precision, profile
        self.budget_bytes, self._residency = budget_bytes, residency
        self._weights: dict[tuple, Any] = {}
        if make_executor is None:
            if gpu is None:
                raise ValueError("PlanPipeline needs a GPU or a make_executor")
            make_executor = lambda plan: PlanExecutor(plan, self.model_dir, gpu, self._weights,  # noqa: E731
                                                      budget_bytes=self.budget_bytes, residency=self._residency)
        self._make_executor = make_executor
        self._last: Any = None  # the executor used last
        self._executors: dict[tuple, Any] = {}
        self.plans: dict[tuple, dict[str, Any]] = {}
        self._closers: list = []
        self.decode_notes: list[str] = []  # what the last decode or generation did beyond the plan's decode

    @property
    def residency(self) -> str:
        """How the last plan run held its weights (resident or staged); before any, as asked."""
        return getattr(self._last, "residency", None) or self._residency

    def on_close(self, fn) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        """Give back what this pipeline started (a browser session)."""
        while self._closers:
            self._closers.pop()()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_profile(self, profile) -> None:
        """Kernel selection for the plans made from now on (a profile spec, as load_pipeline
        takes); the plans made so far are dropped, the weights on the GPU kept."""
        self.profile = profile
        self._executors.clear()
        self.plans.clear()

    def plan_executor(self, height: int, width: int, steps: int = 1, scheduler: str = "euler",
                 guidance_scale: float = 7.5, strength: float | None = None):
        from .plan import record_plan_within

        key = (height, width, steps, scheduler, float(guidance_scale), strength)
        if key not in self._executors:
            plan = record_plan_within(self.config, self.caps, self.budget_bytes, self._residency,
                                      model_dir=self.model_dir, precision=self.precision,
                               height=height, width=width, steps=steps, scheduler=scheduler,
                               guidance_scale=guidance_scale, profile=self.profile, model_name=self.model_dir.name,
                               strength=strength,
                               # on this process's GPU a decoder in halves that overflows decodes again
                               # (_decoded); a page cannot
                               decodes_again=self._gpu is not None)
            self.plans[key] = plan
            self._executors[key] = self._make_executor(plan)
        self._last = self._executors[key]
        return self._last

    def _stage_executor(self, batch: int, latent_hw: tuple[int, int] | None = None) -> PlanExecutor:
        h, w = (latent_hw[0] * self.vae_scale_factor, latent_hw[1] * self.vae_scale_factor) if latent_hw \
            else self.native_size
        return self.plan_executor(h, w, guidance_scale=7.5 if batch == 2 else 1.0)

    @property
    def dtype(self) -> str:
        return storage_dtype(self.precision, self.caps.has_f16)

    def encode_text(self, input_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(input_ids)
        return self._stage_executor(ids.shape[0]).run("text_encoder", {"input_ids": ids})["context"] \
            .astype(np.float32)

    def unet(self, sample: np.ndarray, timestep, encoder_hidden_states: np.ndarray) -> np.ndarray:
        sample = np.asarray(sample, np.float32)
        temb = self._temb_array(timestep, sample.shape[0])
        ex = self._stage_executor(sample.shape[0], sample.shape[2:])
        ex.run("unet_context", {"context": np.asarray(encoder_hidden_states, np.float32)})
        return ex.run("unet_step", {"sample": sample, "timestep_embedding": temb})["noise_pred"].astype(np.float32)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        latents = np.asarray(latents, np.float32)
        if latents.shape[0] != 1:
            raise InputError(f"a plan decodes one latent at a time; got batch {latents.shape[0]}")
        ex = self._stage_executor(1, latents.shape[2:])
        self.decode_notes = []
        return self._decoded(ex, latents, ex.run("vae_decode", {"latents": latents})["image"].astype(np.float32))

    def _decoded(self, ex, latents: np.ndarray, image: np.ndarray) -> np.ndarray:
        """`image`, executor `ex`'s decode of `latents`; or, where its decoder in halves overflowed
        (an inf or NaN in the image of finite latents) on this process's GPU, the latents decoded
        again in f32, as the native pipeline does (decode_notes says so), after a staged executor
        has given back what its stages hold. A browser page's plan is not decoded again: its
        result says what went non-finite."""
        vae_dtype = ex.plan["vae_dtype"]
        if vae_dtype == "f32" or self._gpu is None or np.isfinite(image).all() or not np.isfinite(latents).all():
            return image
        self.decode_notes.append(overflow_note(vae_dtype))
        ex.release_stages()
        return self._decode_in_f32(ex.plan, latents)

    def _decode_in_f32(self, plan: dict[str, Any], latents: np.ndarray) -> np.ndarray:
        """The latents decoded eagerly by the VAE decoder in f32, on f32 copies of the weights
        the plan names (read from the model folder, checked against its hashes), which are
        given back at once."""
        from .models.common import GPUWeights
        from .ops import Ops
        from .pipeline import _selection, scratch_scale

        wanted = STAGE_WEIGHTS["vae_decoder"][1]
        rt = GpuContext(self._gpu)
        state = {b["name"]: read_weight(self.model_dir, {**b, "dtype": "f32"}).reshape(b["shape"])
                 for b in plan["buffers"] if b["kind"] == "weight" and b["component"] == "vae" and wanted(b["name"])}
        weights = GPUWeights(rt, state, "f32")
        try:
            ops = Ops(rt, rt.pipeline_cache(self._gpu), _selection(self.caps, self.profile), "f32",
                      scratch_scale=scratch_scale("vae_decoder"))
            return decode_in_f32(ops, self.config, weights, rt.upload(np.asarray(latents, np.float32), "f32"))
        finally:
            weights.release(rt)

    def encode_image(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(1, 3, H, W) in [-1, 1] -> (mean, logvar) of the latent distribution, unscaled."""
        image = np.asarray(image, np.float32)
        if image.ndim != 4 or image.shape[0] != 1:
            raise InputError(f"a plan encodes one image (1, 3, H, W) at a time; got {image.shape}")
        ex = self.plan_executor(image.shape[2], image.shape[3], steps=1, strength=1.0)
        moments = ex.run("vae_encode", {"image": image})["moments"].astype(np.float32)
        mean, logvar = np.split(moments, 2, axis=1)
        return mean, np.clip(logvar, -30.0, 20.0)

    def _generate(self, prompt, negative_prompt, steps, guidance_scale, seed, height, width, scheduler,
                  latents, progress, init_image, strength) -> GenerationResult:
        t_start = time.perf_counter()
        ex = self.plan_executor(height, width, steps, scheduler, guidance_scale,
                           None if init_image is None else float(strength))
        plan = ex.plan
        cfg_on = plan["batch"] == 2
        shape = tuple(plan["inputs"]["noise"]["shape"])
        rng = np.random.default_rng(seed)
        x0 = image = None
        if init_image is None:
            x0 = first_sample(rng, latents, shape, plan["loop"]["init_noise_sigma"], (height, width))
        else:
            image = prepare_image(init_image, height, width)
        noise = [rng.standard_normal(shape, dtype=np.float32) for _ in range(plan["inputs"]["noise"]["count"])]
        ids = self.tokenize([negative_prompt, prompt] if cfg_on else [prompt])
        out = ex.generate(ids, x0, noise, image=image)
        self.decode_notes = []
        decoded = self._decoded(ex, out["latents"], out["image"])
        if progress is not None:
            progress(steps, steps)
        timings = {("unet_total_ms" if k == "unet_step" else f"{k}_ms"): v for k, v in ex.stage_ms.items()}
        # the mean step of the loop, which runs back to back (PlanExecutor.loop_steps)
        timings["unet_step_ms"] = ex.stage_ms.get("unet_step", 0.0) / ex.loop_steps if ex.loop_steps else 0.0
        timings["total_ms"] = (time.perf_counter() - t_start) * 1e3
        if getattr(ex, "upload_ms", 0.0):
            timings["weight_upload_ms"] = ex.upload_ms
        # the working buffers live through the whole generation: each stage's peak is the plan's
        peak = plan_gpu_bytes(ex)
        vae_dtype = "f32" if self.decode_notes else plan["vae_dtype"]
        return GenerationResult(image=image_from_decoded(decoded), latents=out["latents"], timings=timings,
                                peak_gpu_bytes=peak,
                                warnings=list(plan.get("warnings", [])) + self.decode_notes + non_finite_warnings(
                                    out["latents"], decoded, plan["dtype"], vae_dtype),
                                stage_peak_gpu_bytes={name: stage_peak_bytes(ex, s) for s, name in PEAK_STAGES.items()
                                                      if s in plan["stages"]})
