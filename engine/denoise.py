"""The denoising loop, written once: classifier-free guidance and a scheduler's loop program
(engine/schedulers/program.py) run as GPU ops, from the first sample to the last. The eager
pipeline (engine/pipeline.py) runs it; the plan recorder (engine/plan.py) runs the same loop on
a recording GPU context and keeps what it dispatches, as tinygrad's export records a jitted run.
What differs between the two is the small set of hooks below: where each value of the loop
lives, what running the UNet is, where a noise draw comes from, and what happens around a step.

Notation (the program's source names):
    x{i}    the f32 latents step i starts from, (1, C, h, w)
    e{i}    step i's noise prediction after guidance, (1, C, h, w) f32
    n{k}    the k-th noise draw, (1, C, h, w) f32
    B       the UNet's batch: 2 with classifier-free guidance (unconditional, text), else 1
"""

from __future__ import annotations

from .gpu import Tensor
from .ops import Ops
from .schedulers.program import Combine, LoopProgram, Step


class DenoisingLoop:
    """One generation's denoising loop over `program`. `run(env)` takes the loop's first
    sources (x0; for image-to-image i0 and n1) and returns the last sample's tensor; the
    hooks say what the GPU context under it does."""

    def __init__(self, ops: Ops, program: LoopProgram, guidance_scale: float | None):
        self.ops, self.program = ops, program
        self.guidance_scale = guidance_scale  # None: no classifier-free guidance, B = 1
        self.batch = 1 if guidance_scale is None else 2
        self.step_index = 0  # the step being run; the prologue counts as step 0
        self.env: dict[str, Tensor] = {}  # source name -> its tensor, while it is live

    # ---- hooks ------------------------------------------------------------------------

    def out(self, name: str) -> Tensor | None:
        """Where the loop writes source `name` (or "sample", the UNet's input); None for a
        fresh tensor from the GPU context's pool."""
        return None

    def unet(self, sample: Tensor, timestep: float) -> Tensor:
        """The UNet's noise prediction (B, C, h, w) for `sample` (B, C, h, w) at `timestep`."""
        raise NotImplementedError

    def draw(self, name: str) -> Tensor:
        """Noise source `name`, (1, C, h, w) f32."""
        raise NotImplementedError

    def begin_step(self, step: Step) -> None:
        pass

    def end_step(self, step: Step) -> None:
        pass

    # ---- the loop ---------------------------------------------------------------------

    def combine(self, op: Combine) -> None:
        self.env[op.out] = self.ops.step_combine([(c, self.env[src]) for c, src in op.terms], op.clamp,
                                                 out=self.out(op.out))

    def run(self, env: dict[str, Tensor]) -> Tensor:
        # the caller's dict becomes the loop's environment: a source dropped from it (an eager
        # loop frees each after its last use) is dropped for the caller too
        self.env = env
        for op in self.program.prologue:  # image-to-image: x0 from the encoded image and n1
            self.combine(op)
        for step in self.program.steps:
            i = self.step_index = step.index
            self.begin_step(step)
            sample = self.ops.step_prepare(self.env[f"x{i}"], step.input_scale, self.batch,
                                           out=self.out("sample"))  # (B, C, h, w)
            eps = self.unet(sample, step.timestep)  # (B, C, h, w)
            self.env[f"e{i}"] = self.ops.step_guide(eps, self.guidance_scale, out=self.out(f"e{i}"))
            del sample, eps  # their buffers go back to the pool before the step's own
            for name in step.noise:
                self.env[name] = self.draw(name)
            for op in step.ops:
                self.combine(op)
            self.end_step(step)
        return self.env[f"x{len(self.program.steps)}"]
