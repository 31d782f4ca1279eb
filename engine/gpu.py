"""Run-time GPU state: tensors, the buffer pool they are drawn from, command recording and
GPU timing.

A `Tensor` is a shaped view of a pooled buffer. Buffers are made in size classes (at most
25% above the tensor), go back to the pool when the last tensor using them is garbage
collected, and are reused by the next allocation of the same class; that is safe without
fences because WebGPU orders every dispatch after the ones recorded before it. A kernel binds
only its tensor's bytes, never the slack. Peak GPU memory is weights plus every buffer the
pool holds, free or not; the pipeline trims the free ones between stages. Dispatches are recorded into one open compute pass and submitted on
`flush()` (before any upload or readback). With profiling on, each dispatch gets its own
pass bracketed by timestamp queries, and its GPU time is added to its label.
"""

from __future__ import annotations

import math
import struct
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from .device import GPU, gpu_call
from .errors import GPUError

# Tensor element types. "f16s" (f16-storage) holds the same bytes as "f16", packed halves, but
# its kernels need no shader-f16: they unpack to f32, compute in f32 and pack what they store
# (shaders/packed/, engine.kernels.specialise).
DTYPES = {"f32": np.float32, "f16": np.float16, "f16s": np.float16, "u32": np.uint32, "i32": np.int32}
WG_1D = 256  # invocations per workgroup of the one-dimensional kernels
CLASS_BITS = 2  # 2**CLASS_BITS buffer size classes per power of two (at most 25% slack)
CLASSES_PER_DOUBLING = 2**CLASS_BITS
MIN_CLASS_BYTES = 256
SUBMIT_EVERY = 64  # dispatches per queue submit (see GpuContext.dispatch)


def dtype_of(array: np.ndarray) -> str:
    """The tensor element type of a host array."""
    return {np.float32: "f32", np.float16: "f16", np.int32: "i32", np.uint32: "u32"}[array.dtype.type]


def _align(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


def size_class(nbytes: int) -> int:
    """The byte size of the pool buffer that holds a request of `nbytes`: `nbytes` rounded up
    to one of CLASSES_PER_DOUBLING evenly spaced sizes in each power-of-two range (so a buffer
    is at most 1/CLASSES_PER_DOUBLING larger than the tensor it was made for), in steps of at
    least MIN_CLASS_BYTES. Tensors of nearby sizes then share buffers instead of each size keeping
    its own."""
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    step = 1 << max(MIN_CLASS_BYTES.bit_length() - 1, nbytes.bit_length() - 1 - CLASS_BITS)
    return (nbytes + step - 1) // step * step


def pack_params(values: tuple) -> bytes:
    """A dispatch's uniform parameters as the shaders read them: int -> u32, float -> f32,
    little-endian, padded to a multiple of 16 bytes (the GPU context and the plan recorder both
    pack this way, so a replayed plan binds the same bytes)."""
    raw = b"".join(
        struct.pack("<f", v) if isinstance(v, float) else struct.pack("<I", int(v) & 0xFFFFFFFF)
        for v in values
    )
    return raw + b"\0" * (_align(max(len(raw), 16)) - len(raw))


def padded_bytes(data: np.ndarray) -> np.ndarray:
    """A host array's bytes, padded to a multiple of 4 as WebGPU's copies require: the array's
    own memory (no copy) when it is contiguous and already a multiple of 4."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.nbytes % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.nbytes % 4, np.uint8)])
    return raw


def write_array(device, buffer, data: np.ndarray) -> None:
    """Queue a write of a host array's bytes to the start of `buffer` (padded_bytes)."""
    device.queue.write_buffer(buffer, 0, padded_bytes(data))


class StagingRing:
    """Host-to-GPU copies through `slots` staging buffers of `chunk` bytes, mapped for writing
    and reused in turn: each is filled, unmapped, copied to its destinations by one submission,
    and mapped again (waiting for that copy) when its turn comes back, so filling one overlaps
    the other's copy. queue.write_buffer instead allocates a staging buffer for every write.
    Destinations must be COPY_DST buffers with room for the data padded to 4 bytes."""

    CHUNK = 64 << 20

    def __init__(self, device, chunk: int = CHUNK, slots: int = 2):
        import wgpu

        if chunk % 8:
            raise ValueError(f"a staging chunk is a multiple of 8 bytes, not {chunk}")
        self.device, self.chunk, self._wgpu = device, chunk, wgpu
        usage = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
        self.slots = [gpu_call("allocating a staging buffer", device.create_buffer, size=chunk, usage=usage,
                               mapped_at_creation=True) for _ in range(slots)]
        self.mapped = [True] * slots
        self.turn = self.used = 0
        self.copies: list[tuple[int, Any, int, int]] = []  # (staging offset, destination, its offset, bytes)

    @classmethod
    def sized(cls, device, nbytes: int) -> StagingRing:
        """A ring for about `nbytes` of uploads: chunks no larger than they need be."""
        return cls(device, chunk=max(8, min(cls.CHUNK, (nbytes + 7) & ~7)))

    def write(self, buffer, data: np.ndarray) -> None:
        raw = padded_bytes(data)
        done = 0
        while done < raw.nbytes:
            if self.used == self.chunk:
                self.flush()
            slot = self._slot()
            n = min(raw.nbytes - done, self.chunk - self.used)
            slot.write_mapped(raw[done:done + n], self.used)
            self.copies.append((self.used, buffer, done, n))
            self.used = (self.used + n + 7) & ~7  # a mapped write starts at a multiple of 8
            done += n

    def _slot(self):
        if not self.mapped[self.turn]:  # its last copy must be done before it is written again
            self.slots[self.turn].map_sync(self._wgpu.MapMode.WRITE)
            self.mapped[self.turn] = True
        return self.slots[self.turn]

    def flush(self) -> None:
        """Submit the copies of what was written since the last flush."""
        if not self.copies:
            return
        slot = self.slots[self.turn]
        slot.unmap()
        self.mapped[self.turn] = False
        encoder = self.device.create_command_encoder()
        for at, buffer, offset, n in self.copies:
            encoder.copy_buffer_to_buffer(slot, at, buffer, offset, n)
        self.device.queue.submit([encoder.finish()])
        self.copies, self.used = [], 0
        self.turn = (self.turn + 1) % len(self.slots)

    def destroy(self) -> None:
        """Free the staging buffers (the copies submitted still complete)."""
        for slot in self.slots:
            slot.destroy()
        self.slots = []


def read_array(device, buffer, dtype: str, shape) -> np.ndarray:
    """The first prod(shape) elements of `buffer` as a host array (waits for the GPU)."""
    n = math.prod(shape)
    nbytes = _align(n * np.dtype(DTYPES[dtype]).itemsize, 4)
    raw = gpu_call("reading a buffer back", device.queue.read_buffer, buffer, 0, nbytes)
    return np.frombuffer(raw, dtype=DTYPES[dtype], count=n).reshape(shape).copy()


class Fence:
    """Waits until the GPU has finished everything submitted so far:
    queue.on_submitted_work_done_sync() is broken in wgpu-py 0.32 (callback signature mismatch
    with wgpu-native), and mapping a buffer also waits for all earlier submissions."""

    def __init__(self, device):
        self.device = device
        self._buffer = None

    def wait(self) -> None:
        import wgpu

        if self._buffer is None:
            usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
            self._buffer = self.device.create_buffer(size=4, usage=usage)
        self.device.queue.read_buffer(self._buffer, 0, 4)


class _Storage:
    """One GPU buffer; returns itself to its pool when no tensor refers to it any more.
    Weights have no pool: they live until `release_weights`."""

    __slots__ = ("buffer", "nbytes", "pool", "__weakref__")

    def __init__(self, buffer, nbytes: int, pool: BufferPool | None):
        self.buffer = buffer
        self.nbytes = nbytes  # of the buffer, which may be larger than the tensors viewing it
        self.pool = pool

    def __del__(self):
        if self.pool is not None:
            self.pool.release(self.buffer, self.nbytes)


class Tensor:
    """A shaped, typed view of a GPU buffer (row-major, contiguous, from the buffer's start)."""

    __slots__ = ("storage", "shape", "dtype")

    def __init__(self, storage: _Storage, shape: tuple[int, ...], dtype: str):
        self.storage = storage
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype

    @property
    def buffer(self):
        return self.storage.buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(DTYPES[self.dtype]).itemsize

    @property
    def binding_bytes(self) -> int:
        """The bytes a kernel binds: the tensor, padded to 16 as every buffer used to be; the
        rest of a size-class buffer stays outside the binding."""
        return _align(max(self.nbytes, 4))

    def reshape(self, *shape: int) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.numel // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.numel:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return Tensor(self.storage, shape, self.dtype)

    def __repr__(self) -> str:
        return f"Tensor({self.shape}, {self.dtype})"


class BufferPool:
    """Free activation buffers by size class, plus the accounting behind peak GPU memory.

    Buffers are created at their class size (`size_class`) and never shrink or move between
    classes; `trim` destroys the free ones. `pooled_bytes` is what the pool really holds on
    the GPU: every buffer it created and has not destroyed, free or in use."""

    def __init__(self, create, max_buffer_bytes: int | None = None):
        self.create = create  # nbytes -> a new buffer
        self.max_buffer_bytes = max_buffer_bytes
        self.free: dict[int, list] = defaultdict(list)
        self.pooled_bytes = 0
        self.in_use_bytes = 0
        self.created = 0  # buffers created, for tests and the memory estimate
        # Every buffer the pool created and has not destroyed. A buffer in use is otherwise
        # referenced by its _Storage alone; when a reference cycle (an exception's traceback
        # holding a frame that holds a tensor) is collected, Python finalises everything it
        # reaches in one sweep, so the buffer's wrapper could be released before _Storage.__del__
        # hands the buffer back to the free list. Held here, the buffer is never in that sweep.
        self.owned: set = set()

    def buffer_bytes(self, nbytes: int) -> int:
        size = size_class(nbytes)
        if self.max_buffer_bytes is not None and size > self.max_buffer_bytes:
            size = _align(max(nbytes, 4))  # the class would not fit one buffer; the tensor does
        return size

    def take(self, nbytes: int) -> tuple[object, int, bool]:
        """(buffer, its size, whether it was newly created) for a tensor of `nbytes`."""
        size = self.buffer_bytes(nbytes)
        bucket = self.free.get(size)
        if bucket:
            buf, new = bucket.pop(), False
        else:
            buf, new = self.create(size), True
            self.owned.add(buf)
            self.pooled_bytes += size
            self.created += 1
        self.in_use_bytes += size
        return buf, size, new

    def release(self, buffer, nbytes: int):
        self.free[nbytes].append(buffer)
        self.in_use_bytes -= nbytes

    @property
    def free_bytes(self) -> int:
        return self.pooled_bytes - self.in_use_bytes

    def trim(self):
        """Destroy every free buffer (between pipeline stages and jobs, not between steps).
        The caller flushes first: a free buffer may still be named by recorded commands."""
        for nbytes, bucket in self.free.items():
            for buf in bucket:
                buf.destroy()
                self.owned.discard(buf)
                self.pooled_bytes -= nbytes
        self.free.clear()


class PeakWatch:
    """The highest GPU memory (weights + pool) seen while the watch is open."""

    def __init__(self, bytes_now: int):
        self.start_bytes = bytes_now
        self.peak_bytes = bytes_now


class _Memory:
    """What GpuContext and TraceContext share: the pool, the weights' byte count and the peak
    accounting, so a shape-only run accounts memory exactly as a real one does."""

    def _init_memory(self, create_buffer, max_buffer_bytes: int | None):
        self.pool = BufferPool(create_buffer, max_buffer_bytes)
        self.static_bytes = 0  # weights and other buffers that live until released
        self.peak_bytes = 0
        self._watches: list[PeakWatch] = []

    @property
    def gpu_bytes(self) -> int:
        """What this context holds on the GPU now: weights plus every pool buffer."""
        return self.static_bytes + self.pool.pooled_bytes

    def _note_peak(self):
        now = self.gpu_bytes
        self.peak_bytes = max(self.peak_bytes, now)
        for w in self._watches:
            w.peak_bytes = max(w.peak_bytes, now)

    @contextmanager
    def watch_peak(self):
        """Yield a PeakWatch of the memory high-water mark inside the `with` block."""
        w = PeakWatch(self.gpu_bytes)
        self._watches.append(w)
        try:
            yield w
        finally:
            self._watches.remove(w)

    def trim(self):
        """Destroy the pool's free buffers, after submitting the commands that may use them."""
        self.flush()
        self.pool.trim()

    def reset_peak(self):
        """Forget free pool buffers and start a new peak measurement from what is live now."""
        self.trim()
        self.peak_bytes = self.gpu_bytes

    def _pooled(self, shape, dtype: str, at_least: int = 0) -> Tensor:
        nbytes = max(math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize, at_least)
        buf, size, new = self.pool.take(nbytes)
        if new:
            self._note_peak()
        return Tensor(_Storage(buf, size, self.pool), shape, dtype)

    def _static(self, buffer, nbytes: int, shape, dtype: str) -> Tensor:
        self.static_bytes += nbytes
        self._note_peak()
        return Tensor(_Storage(buffer, nbytes, None), shape, dtype)

    def upload_weights(self, arrays: dict[str, np.ndarray], dtype: str) -> dict[str, Tensor]:
        """Upload a network's weights (static tensors, by name) in element type `dtype`."""
        return {name: self.upload(a, dtype, static=True) for name, a in arrays.items()}

    def release_weights(self, tensors) -> None:
        """Destroy the buffers of weights (tensors made by upload(static=True)) now. Any
        tensor still viewing them must not be used again."""
        self.flush()  # recorded commands may still read them
        seen = set()
        for t in tensors:
            s = t.storage
            if s.pool is not None:
                raise ValueError(f"{t} is a pooled activation, not a weight")
            if id(s) in seen or s.buffer is None:
                continue
            seen.add(id(s))
            s.buffer.destroy()
            s.buffer = None
            self.static_bytes -= s.nbytes


@dataclass
class KernelTime:
    calls: int = 0
    total_ms: float = 0.0


class _TraceBuffer:
    """A buffer that exists only as a size, for TraceContext."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def destroy(self):
        pass


class TraceContext(_Memory):
    """A GPU context that only follows shapes: no GPU memory, no dispatches. Running a model on it
    reveals every (op, shape) the model would dispatch, which `explain` and `tune` need, in
    milliseconds and without weights; its pool and weight accounting are Runtime's, so it also
    gives the peak GPU memory a real run would report (benchmarks/memory_estimate.py).
    Readbacks return zeros."""

    def __init__(self, caps):
        self.caps = caps
        self.dispatches = 0
        limit = getattr(caps, "limits", {}).get("max-buffer-size")
        self._init_memory(_TraceBuffer, None if limit is None else int(limit))

    def pipeline_cache(self, gpu=None):
        return None  # nothing is compiled

    def empty(self, shape, dtype: str = "f32", at_least: int = 0) -> Tensor:
        return self._pooled(shape, dtype, at_least)

    def upload(self, array, dtype: str | None = None, static: bool = False) -> Tensor:
        dtype = dtype or dtype_of(np.asarray(array))
        shape = np.shape(array)
        if static:
            nbytes = _align(max(math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize, 4))
            return self._static(_TraceBuffer(nbytes), nbytes, shape, dtype)
        return self.empty(shape, dtype)

    def read(self, t: Tensor) -> np.ndarray:
        return np.zeros(t.shape, DTYPES[t.dtype])

    def dispatch(self, *args, **kwargs):
        self.dispatches += 1

    def flush(self):
        pass

    def sync(self):
        pass


class GpuContext(_Memory):
    """Allocation, upload/readback and dispatch recording on one GPU."""

    def __init__(self, gpu: GPU, poison: bool = False):
        import wgpu

        self.gpu = gpu
        self.device = gpu.device
        self.caps = gpu.caps
        self._usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self._uniform_usage = wgpu.BufferUsage.UNIFORM
        limit = self.caps.limits.get("max-buffer-size")
        self._init_memory(self._create_buffer, None if limit is None else int(limit))
        self._params: dict[bytes, object] = {}
        # Bind groups by (pipeline, params, bound buffers and sizes): a denoising step binds the
        # same pool buffers in the same order every time, so after the first step no dispatch
        # creates one. The keys hold the buffers, so an id is never reused while cached; the cache
        # is emptied whenever buffers are destroyed (trim, release_weights).
        self._bind_groups: dict[tuple, object] = {}
        self._encoder = None
        self._pass = None
        self._fence = Fence(self.device)
        self.dispatches = 0
        self._recorded = 0  # dispatches recorded since the last submit
        # Tests fill every new activation with NaN so a kernel that skips an element fails.
        self.poison = poison
        # profiling
        self.profiling = False
        self.kernel_times: dict[str, KernelTime] = defaultdict(KernelTime)
        self.family_times: dict[str, KernelTime] = defaultdict(KernelTime)  # by the op that dispatched
        self.op_family: str | None = None  # the variant op being launched (Ops sets it)
        self.work: dict[str, list] = {}  # op -> [calls, FLOPs, bytes] while profiling (engine.roofline)
        self._query_set = None
        self._query_capacity = 0
        self._query_labels: list[str] = []

    def pipeline_cache(self, gpu):
        from .kernels import PipelineCache

        return PipelineCache(gpu)

    def trim(self):
        super().trim()
        self._bind_groups.clear()

    def release_weights(self, tensors) -> None:
        super().release_weights(tensors)
        self._bind_groups.clear()

    # ---- memory -------------------------------------------------------------------------

    def _create_buffer(self, nbytes: int, what: str = "an activation buffer"):
        return gpu_call(f"allocating {what} of {nbytes} bytes", self.device.create_buffer, size=nbytes, usage=self._usage)

    def _check_binding(self, nbytes: int, shape, what: str):
        limit = self.caps.max_binding_bytes
        if nbytes > limit:
            raise GPUError(
                f"{what} of shape {tuple(shape)} needs {nbytes / 2**20:.1f} MiB in one storage "
                f"binding, above this adapter's max-storage-buffer-binding-size of "
                f"{limit / 2**20:.1f} MiB; use a smaller resolution or batch"
            )

    def empty(self, shape, dtype: str = "f32", at_least: int = 0) -> Tensor:
        """A pooled tensor. `at_least`: take a buffer of at least that many bytes, so scratch of
        varying shapes (bounded by one budget) reuses one size class instead of adding many."""
        self._check_binding(math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize, shape, "an activation")
        t = self._pooled(shape, dtype, at_least)
        if self.poison:  # the whole buffer, so a kernel reading past its tensor sees NaN too
            self.flush()
            self.device.queue.write_buffer(t.buffer, 0, b"\xff" * t.storage.nbytes)
        return t

    def upload(self, array: np.ndarray, dtype: str | None = None, static: bool = False) -> Tensor:
        """Copy a host array to the GPU. Static tensors (weights) bypass the pool and live
        until `release_weights`."""
        dtype = dtype or dtype_of(array)
        data = np.ascontiguousarray(array, dtype=DTYPES[dtype])
        if static:
            return self._weight(data, dtype, self.queue_write)
        t = self.empty(data.shape, dtype)
        self.flush()  # a pooled buffer may still be read by recorded, unsubmitted commands
        self.queue_write(t.buffer, data)
        return t

    def queue_write(self, buffer, data: np.ndarray):
        write_array(self.device, buffer, data)

    # How upload_weights (and a plan executor) copies a network's weights to the GPU: "ring",
    # through StagingRing's few mapped staging buffers reused in turn, or "write", one
    # queue.write_buffer per weight (wgpu-native allocates a staging buffer for each). SD 1.4's
    # UNet (686 weights, 1.72 GB f16) on an H100: ring 212 ms, write 487 ms, and 823 ms with the
    # host copy the engine made before (benchmarks/weight_upload.py, docs/benchmarks.md).
    upload_way = "ring"

    def upload_weights(self, arrays: dict[str, np.ndarray], dtype: str) -> dict[str, Tensor]:
        if self.upload_way != "ring":
            return super().upload_weights(arrays, dtype)
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        ring = StagingRing.sized(self.device, sum(np.size(a) * itemsize + 8 for a in arrays.values()))
        try:
            out = {name: self._weight(np.ascontiguousarray(a, dtype=DTYPES[dtype]), dtype, ring.write)
                   for name, a in arrays.items()}
            ring.flush()
        finally:
            ring.destroy()
        return out

    def _weight(self, data: np.ndarray, dtype: str, write) -> Tensor:
        """A static tensor (a weight, outside the pool) holding `data`, written by `write(buffer, data)`."""
        self._check_binding(data.nbytes, data.shape, "a weight")
        nbytes = _align(max(data.nbytes, 4))
        buf = self._create_buffer(nbytes, "a weight")
        write(buf, data)
        return self._static(buf, nbytes, data.shape, dtype)

    def read(self, t: Tensor) -> np.ndarray:
        """Copy a tensor back to the host (waits for the GPU)."""
        self.flush()
        return read_array(self.device, t.buffer, t.dtype, t.shape)

    # ---- dispatch -----------------------------------------------------------------------

    def params_buffer(self, values: tuple) -> object:
        """A uniform buffer holding `values` (int -> u32, float -> f32), cached by content."""
        raw = pack_params(values)
        buf = self._params.get(raw)
        if buf is None:
            buf = self.device.create_buffer_with_data(data=raw, usage=self._uniform_usage)
            self._params[raw] = buf
        return buf

    def dispatch(self, pipeline, label: str, params: tuple, tensors: list[Tensor | None], groups):
        """Record one dispatch: binding 0 is the params uniform, 1.. the tensors in order
        (None skips a binding number the entry point does not use)."""
        uniform = self.params_buffer(params)
        key = (pipeline, uniform, *((t.buffer, t.binding_bytes) if t is not None else None for t in tensors))
        bind_group = self._bind_groups.get(key)
        if bind_group is None:
            entries = [{"binding": 0, "resource": {"buffer": uniform}}]
            entries += [
                {"binding": i + 1, "resource": {"buffer": t.buffer, "offset": 0, "size": t.binding_bytes}}
                for i, t in enumerate(tensors)
                if t is not None
            ]
            bind_group = gpu_call(
                f"binding the buffers of {label}",
                self.device.create_bind_group,
                layout=pipeline.get_bind_group_layout(0),
                entries=entries,
            )
            self._bind_groups[key] = bind_group
        gx, gy, gz = groups
        if max(gx, gy, gz) > self.caps.max_workgroups:
            raise GPUError(f"{label}: grid {groups} exceeds max-compute-workgroups-per-dimension")
        if gx == 0 or gy == 0 or gz == 0:
            return
        cpass = self._begin_pass(label)
        cpass.set_pipeline(pipeline)
        cpass.set_bind_group(0, bind_group)
        cpass.dispatch_workgroups(gx, gy, gz)
        if self.profiling:
            cpass.end()
            self._pass = None
        self.dispatches += 1
        self._recorded += 1
        # Submit in batches so the GPU runs the first kernels while the rest are recorded:
        # with one submit per UNet step, recording (~1k dispatches through Python) and GPU time
        # added up. Profiling keeps its own batches (each flush then waits for its timestamps).
        if self._recorded >= SUBMIT_EVERY and not self.profiling:
            self.flush()

    def _begin_pass(self, label: str):
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        if not self.profiling:
            if self._pass is None:
                self._pass = self._encoder.begin_compute_pass()
            return self._pass
        index = len(self._query_labels)
        if 2 * (index + 1) > self._query_capacity:
            self.flush()
            self._encoder = self.device.create_command_encoder()
            index = 0
        self._query_labels.append((label, self.op_family or label))
        return self._encoder.begin_compute_pass(
            timestamp_writes={
                "query_set": self._query_set,
                "beginning_of_pass_write_index": 2 * index,
                "end_of_pass_write_index": 2 * index + 1,
            }
        )

    def flush(self):
        """Submit everything recorded so far."""
        if self._encoder is None:
            return
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        n = len(self._query_labels)
        resolve = None
        if self.profiling and n:
            resolve = self.device.create_buffer(
                size=16 * n, usage=self._usage_resolve()
            )
            self._encoder.resolve_query_set(self._query_set, 0, 2 * n, resolve, 0)
        gpu_call("submitting GPU work", self.device.queue.submit, [self._encoder.finish()])
        self._encoder = None
        self._recorded = 0
        if resolve is not None:
            ticks = np.frombuffer(self.device.queue.read_buffer(resolve), dtype=np.uint64).reshape(n, 2)
            period = self.caps.timestamp_period_ns
            for (label, family), (t0, t1) in zip(self._query_labels, ticks, strict=True):
                ms = max(int(t1) - int(t0), 0) * period / 1e6
                for kt in (self.kernel_times[label], self.family_times[family]):
                    kt.calls += 1
                    kt.total_ms += ms
            resolve.destroy()
            self._query_labels.clear()

    def _usage_resolve(self):
        import wgpu

        return wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC

    def sync(self):
        """Submit and wait until the GPU has finished everything submitted so far."""
        self.flush()
        self._fence.wait()

    def set_profiling(self, on: bool, capacity: int = 2048):
        """Time every dispatch with timestamp queries (needs the timestamp-query feature).
        A query set holds at most 4096 queries, two per dispatch; more dispatches flush early."""
        self.flush()
        if on and not self.caps.has_timestamps:
            raise GPUError("per-kernel timing needs the adapter's timestamp-query feature")
        if on and self._query_set is None:
            self._query_set = self.device.create_query_set(type="timestamp", count=2 * capacity)
            self._query_capacity = 2 * capacity
        self.profiling = on

    def take_kernel_times(self) -> dict[str, KernelTime]:
        """GPU time per dispatch label since the last take (resets take_times's views too)."""
        return self.take_times()[0]

    def take_times(self) -> tuple[dict[str, KernelTime], dict[str, KernelTime]]:
        """GPU time since the last take per dispatch label, and per variant op that dispatched
        (kernels of other ops under their label)."""
        self.flush()
        times = dict(self.kernel_times), dict(self.family_times)
        self.kernel_times.clear()
        self.family_times.clear()
        return times

    def note_work(self, op: str, flops: float, nbytes: float) -> None:
        """Count one call of `op` and its work while profiling (engine.roofline)."""
        w = self.work.setdefault(op, [0, 0.0, 0.0])
        w[0] += 1
        w[1] += flops
        w[2] += nbytes

    def take_work(self) -> dict[str, list]:
        work, self.work = self.work, {}
        return work


class StageTimer:
    """Wall-clock time of pipeline stages, measured to GPU completion."""

    def __init__(self, rt: GpuContext):
        self.rt = rt
        self.ms: dict[str, float] = defaultdict(float)

    def __call__(self, name: str):
        timer = self

        class _Stage:
            def __enter__(self):
                timer.rt.sync()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                if exc[0] is None:
                    timer.rt.sync()
                timer.ms[name] += (time.perf_counter() - self.t0) * 1e3

        return _Stage()


def time_gpu_work(rt: GpuContext, fn, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of GPU work per call of `fn`, `repeats` samples after `warmup` calls."""
    for _ in range(warmup):
        fn()
    rt.sync()
    samples = []
    # lavapipe's timestamps disagree with wall clock (3.5x on its flash attention), so CPU
    # adapters are timed by wall clock to GPU completion.
    use_gpu_clock = rt.caps.has_timestamps and rt.caps.adapter_type.lower() != "cpu"
    if use_gpu_clock:
        rt.set_profiling(True)
    try:
        for _ in range(repeats):
            if use_gpu_clock:
                rt.take_kernel_times()
                fn()
                samples.append(sum(k.total_ms for k in rt.take_kernel_times().values()))
            else:
                t0 = time.perf_counter()
                fn()
                rt.sync()
                samples.append((time.perf_counter() - t0) * 1e3)
    finally:
        if use_gpu_clock:
            rt.set_profiling(False)
    return samples
