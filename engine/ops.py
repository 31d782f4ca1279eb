"""The ops the models are written in, each dispatching the variant the `Selection` picks.

Shapes follow PyTorch: images NCHW, tokens (B, T, C), linear weights (out, in). Every op
allocates its output from the GPU context's pool and leaves its inputs untouched, so a model
reads like the diffusers module it mirrors.

Ops with several variants (linear, conv2d, group_norm, activation, geglu, attention) describe
the call by a `shape` dict, the key profiles match on, and call the chosen variant's launcher.
The reference launchers are in this file; the optimized ones in engine/variants/, one module
per op.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import contextmanager

from .gpu import WG_1D, GpuContext, Tensor
from .kernels import PipelineCache, Selection, Variant, conv_out_size, register

register("add", "reference", doc="element-wise or per-channel broadcast add")(None)
register("softmax", "reference", doc="row softmax in f32, optional causal mask")(None)
register("upsample", "reference", doc="nearest-neighbour resize")(None)
register("concat", "reference", doc="channel concatenation")(None)
register("transpose", "reference", doc="swap the last two axes")(None)
register("embedding", "reference", doc="token + position embedding gather")(None)
register("step", "reference", entry="combine", doc="the denoising loop: combine, guide, prepare")(None)

ACT = {"silu": 0, "gelu": 1, "quick_gelu": 2}
# The score matrices of the attention variants that store them (reference, partial_softmax) are
# computed in chunks of (batch, head) pairs of at most this many bytes: a phone's page cannot
# hold SD's 1 GiB of 512x512 scores beside the UNet's weights.
SCORE_SCRATCH_BYTES = 64 << 20


class Prepared(dict):
    """Tensors derived from weights once and reused by every call after (Winograd's transformed
    filters, conv2d winograd_2x2 with PRETRANSFORM): (tag, weight) -> (weight, derived). A
    generation holds one (ContextKV.prepared), so a derived tensor costs its work once a
    generation instead of once a step, and its memory for the generation.

    `sink`: a command list of a recording context (engine.plan) that the work of filling goes
    to instead of the list being recorded: a plan records it into the stage that runs once a
    generation (unet_context), not into the step it replays 20 times."""

    sink: list | None = None


class Ops:
    """Op functions bound to one GPU context, pipeline cache, selection and element type."""

    def __init__(
        self, rt: GpuContext, pipelines: PipelineCache | None, selection: Selection, dtype: str,
        scratch_scale: float = 1
    ):
        self.rt = rt
        # Multiplier of the scratch bounds of chunked kernels (Winograd through the GEMM core):
        # 1 keeps the UNet stage within its memory budget; a network whose stage peaks lower (the
        # VAE decoder, VAE_SCRATCH_SCALE) takes larger chunks: fewer, larger products; a plan made
        # for a tight memory budget smaller ones (a fraction).
        self.scratch_scale = scratch_scale
        # (op, shape, args, epilogue) of every variant-op call, when recording; epilogue: what the
        # caller asked to be done after the product ({"geglu": True}, {"residual": tensor}, {}),
        # in its epilogue or by a kernel after it, so a tuner times each candidate doing it too
        self.calls: list | None = None
        self.pipelines = pipelines
        self.selection = selection
        self.dtype = dtype
        self._twins: dict[str, Ops] = {}  # twin(): this Ops in other element types
        self.prepared: Prepared | None = None  # where prepare() keeps derived weights (None: nowhere)
        self.dummy = rt.upload(__import__("numpy").zeros(4, dtype="float32"), dtype, static=True)
        # an unused f32 input of a step kernel
        self.dummy_f32 = self.dummy if dtype == "f32" else rt.upload(__import__("numpy").zeros(4, dtype="float32"),
                                                                      "f32", static=True)
        # a writable f32 placeholder, never the same buffer as a read-only one of one dispatch
        self.dummy_rw = rt.upload(__import__("numpy").zeros(4, dtype="float32"), "f32", static=True)

    # ---- helpers ----------------------------------------------------------------------

    def _pipeline(self, op: str, entry: str | None = None, **constants):
        """The pipeline of an op without variants (its reference)."""
        v = self.selection.variant(op)
        return self.pipeline(v, entry, **constants)

    def pipeline(self, variant: Variant, entry: str | None = None, **constants):
        if self.pipelines is None:  # tracing shapes: nothing is compiled
            return None
        return self.pipelines.get(variant, self.dtype, constants or None, entry)

    def _launch(self, op: str, shape: dict, *args, epilogue: dict | None = None, **fused):
        """Launch the chosen variant of `op`. `fused` are extra inputs only some variants take
        (the caller has checked that this one does); `epilogue` is recorded with the call."""
        variant, constants = self.selection.choose(op, shape, self.dtype)
        if self.calls is not None:
            self.calls.append((op, shape, args, epilogue or {}))
        rt = self.rt
        # (a variant composed of other ops leaves the work to theirs: counted once)
        if getattr(rt, "profiling", False) and not getattr(variant.launch, "composed", False):
            from .roofline import op_work

            rt.note_work(op, *op_work(op, shape, self.dtype))
        outer, rt.op_family = getattr(rt, "op_family", None), op
        try:
            return variant.launch(self, variant, constants, *args, **fused)
        finally:
            rt.op_family = outer

    @contextmanager
    def preparing(self, prepared: Prepared | None):
        """Calls inside the block keep what prepare() derives in `prepared`."""
        outer, self.prepared = self.prepared, prepared
        try:
            yield prepared
        finally:
            self.prepared = outer

    def prepare(self, tag: tuple, w: Tensor, make: Callable[[], Tensor]) -> Tensor:
        """make(), a tensor derived from the weight `w` alone, once per `self.prepared` (made
        again on every call where there is none)."""
        cache = self.prepared
        if cache is None:
            return make()
        key = (*tag, id(w.storage))
        if key in cache:
            return cache[key][1]
        if cache.sink is not None:
            with self.rt.commands_into(cache.sink):
                t = make()
        else:
            t = make()
        cache[key] = (w, t)  # the weight held beside it: its id is not reused while the entry lives
        return t

    def score_chunks(self, pairs: int, tq: int, tk: int):
        """(first, count) ranges of (batch, head) pairs whose f32 score matrices fit one storage
        binding and SCORE_SCRATCH_BYTES (times scratch_scale), at least one pair a chunk: SD at
        64x64 latents has 4096 x 4096 x 4 B, 64 MiB, per pair, and 16 pairs."""
        per_pair = tq * tk * 4
        bound = min(self.rt.caps.max_binding_bytes, int(SCORE_SCRATCH_BYTES * self.scratch_scale))
        chunk = max(1, min(pairs, bound // per_pair))
        for first in range(0, pairs, chunk):
            yield first, min(chunk, pairs - first)

    def grid_1d(self, n: int, per_invocation: int = 1) -> tuple[int, int, int]:
        return self._grid_1d(n, per_invocation)

    def _grid_1d(self, n: int, per_invocation: int = 1) -> tuple[int, int, int]:
        """The folded 1-D grid for `n` elements, `per_invocation` of them an invocation (pairs: 2)."""
        groups = max(1, math.ceil(n / (WG_1D * per_invocation)))
        gx = min(groups, self.rt.caps.max_workgroups)
        return gx, math.ceil(groups / gx), 1

    def _check(self, t: Tensor, what: str):
        if t.dtype != self.dtype:
            raise TypeError(f"{what} is {t.dtype}, the pipeline runs in {self.dtype}")

    # ---- dense ------------------------------------------------------------------------

    @staticmethod
    def _linear_shape(x: Tensor, w: Tensor) -> dict:
        """The linear op's shape key for x (..., K) and w (N, K...); refuses a mismatch."""
        n_out, k = w.shape[0], math.prod(w.shape[1:])
        if x.shape[-1] != k:
            raise ValueError(f"linear: input {x.shape} does not match weight {w.shape}")
        return {"m": x.numel // k, "n": n_out, "k": k}

    def linear(self, x: Tensor, w: Tensor, b: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        """x (..., K) @ w (N, K)^T + b (N) [+ residual (..., N)] -> (..., N). The residual is added
        in the product's epilogue where the chosen variant has one (`fuses_residual`), else by
        `add` after it."""
        shape = self._linear_shape(x, w)
        n_out = shape["n"]
        if residual is None:
            return self._launch("linear", shape, x, w, b)
        if residual.shape != (*x.shape[:-1], n_out):
            raise ValueError(f"linear: residual {residual.shape} does not match the output {(*x.shape[:-1], n_out)}")
        epilogue = {"residual": residual}
        if getattr(self.selection.variant("linear", shape, self.dtype).launch, "fuses_residual", False):
            return self._launch("linear", shape, x, w, b, epilogue=epilogue, residual=residual)
        return self.add(self._launch("linear", shape, x, w, b, epilogue=epilogue), residual)

    def linear_to_channels(self, x: Tensor, w: Tensor, b: Tensor | None, residual: Tensor) -> Tensor:
        """A transformer's output projection back to the image layout: tokens x (B, T, K) @
        w (N, K)^T + b, written channel-major and added to residual (B, N, H, W), H * W = T. The
        chosen variant of op linear_nchw runs it as one product that writes the layout and adds
        the residual in its epilogue ("gemm") or as a linear, a transpose and an add."""
        bsz, t, k = x.shape
        n_out = w.shape[0]
        if residual.shape[:2] != (bsz, n_out) or math.prod(residual.shape[2:]) != t or math.prod(w.shape[1:]) != k:
            raise ValueError(f"linear_to_channels: x {x.shape}, w {w.shape} and residual {residual.shape} disagree")
        return self._launch("linear_nchw", {"b": bsz, "t": t, "n": n_out, "k": k}, x, w, b, residual)

    def linear_geglu(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        """GEGLU of the projection: x (..., K) @ w (2F, K)^T + b (2F) -> (..., F), the first F
        outputs times GELU of the last F. In the product's epilogue where the chosen variant and
        setting can take it (`fuses_geglu`), else by `geglu` after it."""
        shape = self._linear_shape(x, w)
        variant, consts = self.selection.choose("linear", shape, self.dtype)
        fuses = getattr(variant.launch, "fuses_geglu", None)
        if fuses is not None and fuses(consts, shape["n"], shape["k"]):
            return self._launch("linear", shape, x, w, b, epilogue={"geglu": True}, geglu=True)
        return self.geglu(self._launch("linear", shape, x, w, b, epilogue={"geglu": True}))

    def conv2d(
        self,
        x: Tensor,
        w: Tensor,
        b: Tensor | None,
        stride: int = 1,
        padding: int | tuple[int, int, int, int] = 0,
        residual: Tensor | None = None,
        last_use: bool = False,
    ) -> Tensor:
        """x (B, Cin, H, W) * w (Cout, Cin, KH, KW) [+ residual (B, Cout, OH, OW)]. padding: p, or
        (top, bottom, left, right). The residual (a ResNet block's shortcut) is added in the
        convolution's epilogue where the chosen variant has one (`fuses_residual`), else by `add`
        after it. `last_use`: the caller never reads x again, so before that add x's view lets its
        buffer go back to the pool, as the caller's own reference would have between a convolution
        and an add of its own (x must not be used afterwards)."""
        bsz, cin, h, wd = x.shape
        cout, cin_w, kh, kw = w.shape
        if cin != cin_w:
            raise ValueError(f"conv2d: input {x.shape} does not match weight {w.shape}")
        pads = (padding,) * 4 if isinstance(padding, int) else tuple(padding)
        oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
        tiles = math.ceil(oh / 4) * math.ceil(ow / 4)  # 4x4 output tiles of one image (Winograd's rule)
        shape = {"cin": cin, "cout": cout, "h": h, "w": wd, "k": kh, "stride": stride, "b": bsz, "tiles": tiles}
        if residual is None:
            return self._launch("conv2d", shape, x, w, b, stride, pads)
        if residual.shape != (bsz, cout, oh, ow):
            raise ValueError(f"conv2d: residual {residual.shape} does not match the output {(bsz, cout, oh, ow)}")
        epilogue = {"residual": residual}
        if getattr(self.selection.variant("conv2d", shape, self.dtype).launch, "fuses_residual", False):
            return self._launch("conv2d", shape, x, w, b, stride, pads, epilogue=epilogue, residual=residual)
        y = self._launch("conv2d", shape, x, w, b, stride, pads, epilogue=epilogue)
        if last_use:
            x.storage = None  # this view's hold on the buffer; other views keep theirs
        return self.add(y, residual)

    # ---- normalisation ----------------------------------------------------------------

    def group_norm(
        self, x: Tensor, gamma: Tensor, beta: Tensor, groups: int, eps: float, silu: bool = False
    ) -> Tensor:
        bsz, c = x.shape[:2]
        if c % groups:
            raise ValueError(f"group_norm: {c} channels do not split into {groups} groups")
        shape = {"c": c, "s": x.numel // (bsz * c), "groups": groups, "b": bsz}
        return self._launch("group_norm", shape, x, gamma, beta, groups, eps, silu)

    def layer_norm(self, x: Tensor, gamma: Tensor, beta: Tensor, eps: float) -> Tensor:
        d = x.shape[-1]
        return self._launch("layer_norm", {"rows": x.numel // d, "d": d}, x, gamma, beta, eps)

    # ---- element-wise -----------------------------------------------------------------

    def activation(self, x: Tensor, kind: str) -> Tensor:
        return self._launch("activation", {"kind": kind, "n": x.numel}, x, kind)

    def silu(self, x: Tensor) -> Tensor:
        return self.activation(x, "silu")

    def geglu(self, x: Tensor) -> Tensor:
        """(..., 2F) -> (..., F): first half times GELU of the second half."""
        f2 = x.shape[-1]
        return self._launch("geglu", {"m": x.numel // f2, "f": f2 // 2}, x)

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        """a + b for equal shapes, or a (B, C, ...) + b (B, C) broadcast over the rest."""
        if a.shape == b.shape:
            s, bcast = 1, 0
        elif a.shape[:2] == b.shape and len(b.shape) == 2:
            s, bcast = a.numel // b.numel, 1
        else:
            raise ValueError(f"add: shapes {a.shape} and {b.shape} do not broadcast")
        y = self.rt.empty(a.shape, self.dtype)
        self.rt.dispatch(self._pipeline("add"), "add", (a.numel, s, bcast), [a, b, y], self._grid_1d(a.numel, 2))
        return y

    # ---- layout -----------------------------------------------------------------------

    def upsample_nearest(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        bsz, c, h, w = x.shape
        oh, ow = size
        y = self.rt.empty((bsz, c, oh, ow), self.dtype)
        self.rt.dispatch(
            self._pipeline("upsample"), "upsample", (bsz * c, h, w, oh, ow), [x, y],
            self._grid_1d(y.numel, 2),
        )
        return y

    def concat_channels(self, a: Tensor, b: Tensor) -> Tensor:
        bsz, ca = a.shape[:2]
        cb = b.shape[1]
        if a.shape[2:] != b.shape[2:] or b.shape[0] != bsz:
            raise ValueError(f"concat: {a.shape} and {b.shape} differ outside the channel axis")
        s = a.numel // (bsz * ca)
        y = self.rt.empty((bsz, ca + cb, *a.shape[2:]), self.dtype)
        self.rt.dispatch(self._pipeline("concat"), "concat", (bsz, ca, cb, s), [a, b, y],
                         self._grid_1d(y.numel, 2))
        return y

    def transpose(self, x: Tensor) -> Tensor:
        """(B, R, C) -> (B, C, R)."""
        bsz, r, c = x.shape
        y = self.rt.empty((bsz, c, r), self.dtype)
        self.rt.dispatch(self._pipeline("transpose"), "transpose", (bsz, r, c), [x, y],
                         self._grid_1d(x.numel, 2))
        return y

    def embedding(self, ids: Tensor, tok: Tensor, pos: Tensor) -> Tensor:
        bsz, t = ids.shape
        v, d = tok.shape
        y = self.rt.empty((bsz, t, d), self.dtype)
        self.rt.dispatch(
            self._pipeline("embedding"), "embedding", (bsz, t, d, v), [ids, tok, pos, y], self._grid_1d(y.numel)
        )
        return y

    # ---- the denoising loop (shaders/step; engine/schedulers/program.py) ------------------

    MAX_TERMS = 6  # inputs of one combine dispatch

    def _step(self, entry: str, n: int, *, count: int = 0, clamp=None, batch: int = 1, g: float = 0.0,
              terms=(), inputs=(), eps: Tensor | None = None, dst: Tensor | None = None, y: Tensor | None = None):
        coefs = [float(c) for c in terms] + [0.0] * (8 - len(terms))
        lo, hi = clamp if clamp is not None else (0.0, 0.0)
        params = (n, count, int(clamp is not None), batch, float(lo), float(hi), 0, float(g), *coefs, *([0] * 8))
        slots = list(inputs) + [self.dummy_f32] * (self.MAX_TERMS - len(inputs))
        bindings = {"combine": [*slots, dst], "guide": [None] * 6 + [dst, eps],
                    "prepare": [slots[0], *[None] * 7, y], "posterior": [slots[0], *[None] * 5, dst, eps]}[entry]
        self.rt.dispatch(self._pipeline("step", entry), f"step.{entry}", params, bindings, self._grid_1d(n))

    def step_combine(self, terms: list[tuple[float, Tensor]], clamp: tuple[float, float] | None = None,
                     out: Tensor | None = None) -> Tensor:
        """sum(c * t) over f32 tensors of one shape, clamped to `clamp` when given (one
        combination of a loop program, engine.schedulers.program.Combine)."""
        if not 1 <= len(terms) <= self.MAX_TERMS:
            raise ValueError(f"step_combine: {len(terms)} terms; 1 to {self.MAX_TERMS} are supported")
        shape = terms[0][1].shape
        for _, t in terms:
            if t.shape != shape or t.dtype != "f32":
                raise ValueError(f"step_combine: terms must be f32 tensors of one shape, got {t}")
        out = self.rt.empty(shape, "f32") if out is None else out
        n = math.prod(shape)
        self._step("combine", n, count=len(terms), clamp=clamp, terms=[c for c, _ in terms],
                   inputs=[t for _, t in terms], dst=out)
        return out

    def step_guide(self, eps: Tensor, guidance_scale: float | None, out: Tensor | None = None) -> Tensor:
        """The noise prediction the scheduler steps with, f32 (1, ...): u + g (c - u) of a
        batch-2 prediction (unconditional, text), or the batch-1 prediction as it is."""
        self._check(eps, "the noise prediction")
        batch = eps.shape[0]
        if batch != (2 if guidance_scale is not None else 1):
            raise ValueError(f"step_guide: batch {batch} with guidance_scale {guidance_scale}")
        out = self.rt.empty((1, *eps.shape[1:]), "f32") if out is None else out
        self._step("guide", out.numel, batch=batch, g=guidance_scale or 0.0, eps=eps, dst=out)
        return out

    def step_prepare(self, x: Tensor, scale: float, repeat: int = 1, out: Tensor | None = None) -> Tensor:
        """A network's input from f32 latents x (B, ...): scale * x in this element type,
        the whole batch `repeat` times along the batch axis (the UNet's input with guidance)."""
        if x.dtype != "f32":
            raise ValueError(f"step_prepare: latents must be f32, got {x}")
        y = self.rt.empty((repeat * x.shape[0], *x.shape[1:]), self.dtype) if out is None else out
        self._step("prepare", x.numel, batch=repeat, g=scale, inputs=[x], y=y)
        return y

    def to_f32(self, x: Tensor) -> Tensor:
        """A copy of x (this element type) in f32, for a part of a model of halves that must not
        round or overflow in them (the VAE's one-head attention scores)."""
        self._check(x, "to_f32's input")
        if self.dtype == "f32":
            return x
        y = self.rt.empty(x.shape, "f32")
        self._step("guide", x.numel, batch=1, eps=x, dst=y)
        return y

    def from_f32(self, x: Tensor) -> Tensor:
        """A copy of the f32 tensor x in this element type (to_f32's way back)."""
        if x.dtype != "f32":
            raise TypeError(f"from_f32's input is {x.dtype}, not f32")
        if self.dtype == "f32":
            return x
        return self.step_prepare(x, 1.0)

    def twin(self, dtype: str) -> Ops:
        """Ops of the same context, pipelines, selection and scratch bounds in element type `dtype`
        (made once)."""
        if dtype == self.dtype:
            return self
        if dtype not in self._twins:
            self._twins[dtype] = Ops(self.rt, self.pipelines, self.selection, dtype, self.scratch_scale)
        return self._twins[dtype]

    def step_posterior(self, moments: Tensor, noise: Tensor, scaling: float, out: Tensor | None = None) -> Tensor:
        """img2img's encoded image: (mean + exp(logvar / 2) * noise) * scaling, f32 (1, C, h, w),
        from the VAE encoder's moments (1, 2C, h, w) in this element type (logvar clamped to
        [-30, 20] as diffusers does) and f32 noise."""
        self._check(moments, "the VAE moments")
        if moments.shape[0] != 1 or noise.dtype != "f32" or noise.numel * 2 != moments.numel:
            raise ValueError(f"step_posterior: moments {moments} and noise {noise} do not match")
        out = self.rt.empty(noise.shape, "f32") if out is None else out
        self._step("posterior", noise.numel, clamp=(-30.0, 20.0), g=scaling, inputs=[noise], eps=moments, dst=out)
        return out

    # ---- attention --------------------------------------------------------------------

    def softmax_(self, s: Tensor, tq: int = 1, causal: bool = False) -> Tensor:
        """In-place softmax over the last axis of an f32 tensor."""
        n = s.shape[-1]
        rows = s.numel // n
        gx = min(rows, self.rt.caps.max_workgroups)
        self.rt.dispatch(
            self._pipeline("softmax"),
            "softmax",
            (rows, n, tq, int(causal)),
            [s],
            (gx, math.ceil(rows / gx), 1),
        )
        return s

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        heads: int,
        causal: bool = False,
        scale: float | None = None,
    ) -> Tensor:
        """softmax(Q K^T * scale) V per head. q (B, Tq, H*dh); k, v (B, Tk, H*dh) -> (B, Tq, H*dh)."""
        bsz, tq, width = q.shape
        dh = width // heads
        scale = float(scale if scale is not None else dh**-0.5)
        shape = {"tq": tq, "tk": k.shape[1], "dh": dh, "heads": heads, "b": bsz, "causal": int(causal)}
        return self._launch("attention", shape, q, k, v, heads, causal, scale)


# ---- reference launchers -------------------------------------------------------------------
# Each takes (ops, variant, constants, *the op's arguments) and returns the output tensor.


@register("linear", "reference", doc="one invocation per output, f32 accumulation")
def linear_reference(ops: Ops, v: Variant, consts: dict, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    n_out, k = w.shape[0], math.prod(w.shape[1:])
    m = x.numel // k
    y = ops.rt.empty((*x.shape[:-1], n_out), ops.dtype)
    ops.rt.dispatch(
        ops.pipeline(v), "linear", (m, n_out, k, int(b is not None)),
        [x, w, b if b is not None else ops.dummy, y], (math.ceil(n_out / 16), math.ceil(m / 16), 1),
    )
    return y


@register("conv2d", "reference", doc="direct convolution, one invocation per output")
def conv2d_reference(ops: Ops, v: Variant, consts: dict, x, w, b, stride: int, pads) -> Tensor:
    bsz, cin, h, wd = x.shape
    cout, _, kh, kw = w.shape
    oh, ow = conv_out_size(h, wd, kh, kw, stride, pads)
    y = ops.rt.empty((bsz, cout, oh, ow), ops.dtype)
    params = (bsz, cin, h, wd, cout, oh, ow, kh, kw, stride, pads[0], pads[2], int(b is not None))
    ops.rt.dispatch(
        ops.pipeline(v), "conv2d", params, [x, w, b if b is not None else ops.dummy, y],
        (math.ceil(oh * ow / 64), cout, bsz),
    )
    return y


@register("group_norm", "reference", entry="stats_main", doc="statistics pass, then apply pass")
def group_norm_reference(ops: Ops, v: Variant, consts: dict, x, gamma, beta, groups, eps, silu) -> Tensor:
    bsz, c = x.shape[:2]
    s = x.numel // (bsz * c)
    stats = ops.rt.empty((bsz * groups, 2), "f32")
    params = (bsz, c, s, groups, float(eps), int(silu))
    ops.rt.dispatch(ops.pipeline(v, "stats_main"), "group_norm", params, [x, stats], (bsz * groups, 1, 1))
    y = ops.rt.empty(x.shape, ops.dtype)
    ops.rt.dispatch(
        ops.pipeline(v, "apply_main"), "group_norm", params, [x, stats, gamma, beta, y], ops.grid_1d(x.numel, 2)
    )
    return y


@register("layer_norm", "reference", doc="one workgroup per row, two-pass statistics")
def layer_norm_reference(ops: Ops, v: Variant, consts: dict, x: Tensor, gamma: Tensor, beta: Tensor,
                         eps: float) -> Tensor:
    d = x.shape[-1]
    rows = x.numel // d
    y = ops.rt.empty(x.shape, ops.dtype)
    gx = min(rows, ops.rt.caps.max_workgroups)
    ops.rt.dispatch(ops.pipeline(v), "layer_norm", (rows, d, float(eps)), [x, gamma, beta, y],
                    (gx, math.ceil(rows / gx), 1))
    return y


@register("activation", "reference", doc="SiLU / GELU (erf) / QuickGELU by override ACT")
def activation_reference(ops: Ops, v: Variant, consts: dict, x: Tensor, kind: str) -> Tensor:
    y = ops.rt.empty(x.shape, ops.dtype)
    ops.rt.dispatch(ops.pipeline(v, ACT=ACT[kind]), kind, (x.numel,), [x, y], ops.grid_1d(x.numel))
    return y


@register("geglu", "reference", doc="value * GELU(gate) over the split projection")
def geglu_reference(ops: Ops, v: Variant, consts: dict, x: Tensor) -> Tensor:
    f2 = x.shape[-1]
    m, f = x.numel // f2, f2 // 2
    y = ops.rt.empty((*x.shape[:-1], f), ops.dtype)
    ops.rt.dispatch(ops.pipeline(v), "geglu", (m, f), [x, y], ops.grid_1d(m * f, 2))
    return y


@register("attention", "reference", entry="scores", doc="scores, softmax, weighted sum; materialised")
def attention_reference(ops: Ops, v: Variant, consts: dict, q, k, vv, heads, causal, scale) -> Tensor:
    bsz, tq, width = q.shape
    tk = k.shape[1]
    dh = width // heads
    o = ops.rt.empty((bsz, tq, width), ops.dtype)
    scores_p = ops.pipeline(v, "scores")
    sum_p = ops.pipeline(v, "weighted_sum")
    for bh0, nbh in ops.score_chunks(bsz * heads, tq, tk):
        s = ops.rt.empty((nbh, tq, tk), "f32")
        params = (heads, tq, tk, dh, width, width, bh0, scale)
        ops.rt.dispatch(scores_p, "attention", params, [q, k, s], (math.ceil(tk / 16), math.ceil(tq / 16), nbh))
        ops.softmax_(s, tq, causal)
        ops.rt.dispatch(
            sum_p, "attention", params, [None, None, s, vv, o], (math.ceil(dh / 16), math.ceil(tq / 16), nbh)
        )
        del s  # back to the pool before the next chunk takes one
    return o


def _load_variants() -> None:
    """Import every module of engine/variants/ so its launchers register themselves."""
    import importlib
    import pkgutil

    from . import variants as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{info.name}")


_load_variants()
