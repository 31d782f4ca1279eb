"""The child side of a job: the process `agent.jobs.run_job` starts (`python -m agent.child
TASK.json`, a ChildTask) to do the GPU work under a time limit. It loads the engine on the job's executor,
runs the kind (generate, latency, tune), and writes progress events and finally its JobResult as
JSON lines on its stdout; everything else it prints goes to stderr, the job's log. A failure part
of the way still hands back what was measured up to then."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from agent.bundle import sha256_file
from agent.jobs import RESULT_EVENT, ChildTask, ProgressFn, artifact
from agent.protocol import (
    JobResult,
    KernelTiming,
    Sample,
    ThermalReading,
    from_dict,
    to_dict,
)


class ChildJob:
    """The job inside the child process; fills `result` as it goes, so a failure part-way
    still reports what was measured up to then. On the plan and browser executors the pipeline
    is a PlanPipeline (engine/plan_exec.py): its executors time the UNet step, and what the
    native executor reads from the pipeline's selection comes from its plans."""

    def __init__(self, task: ChildTask, emit: ProgressFn):
        self.task = task
        self.spec = task.spec
        self.executor = task.spec.executor
        self.out_dir = Path(task.out_dir)
        self.emit = emit
        self.result = JobResult(job_id=self.spec.job_id, kind=self.spec.kind, status="failed")
        self.caps = None
        self.pipe = None

    # -- helpers

    def phase(self, name: str, **extra) -> None:
        print(f"[job] {name} {json.dumps(extra) if extra else ''}".rstrip(), file=sys.stderr, flush=True)
        self.emit({"event": "phase", "phase": name, **extra})

    def steps(self, phase: str, repetition: int | None = None):
        def report(done: int, total: int) -> None:
            self.emit({"event": "step", "phase": phase, "done": done, "total": total, "repetition": repetition})
        return report

    def sample(self, metric: str, value: float, unit: str, repetition: int = 0) -> None:
        self.result.samples.append(Sample(metric, float(value), unit, repetition))

    def generation_samples(self, g, repetition: int) -> None:
        """e2e_ms, every stage's ms, peak_gpu_bytes and each stage's peak, of one generation.
        The generation's unet_step_ms is left out: it is a median over steps (aggregated), and
        unet_step_ms means one timed CFG step (latency jobs); unet_total_ms stays."""
        for key, ms in g.timings.items():
            if key == "unet_step_ms":
                continue
            self.sample("e2e_ms" if key == "total_ms" else key, ms, "ms", repetition)
        self.sample("peak_gpu_bytes", g.peak_gpu_bytes, "bytes", repetition)
        for stage, nbytes in g.stage_peak_gpu_bytes.items():
            self.sample(f"{stage}_peak_gpu_bytes", nbytes, "bytes", repetition)

    def thermal(self, phase: str):
        """Best effort: a device without readable zones just has none. Returns the DeviceInfo
        read (its clocks serve the run's environment), or None. None on the browser executor:
        the page's device need not be this host, whose zones must not pass for the device's."""
        if self.executor == "browser":
            return None
        try:
            from agent.deviceinfo import collect_local

            info = collect_local(adapter=self.caps.as_dict() if self.caps else {"device": "not queried"})
        except Exception as exc:
            print(f"[job] thermal readings unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
        for zone in info.thermal:
            self.result.thermal.append(ThermalReading(phase, zone.name, float(zone.celsius)))
        if info.battery is not None and info.battery.celsius is not None:
            self.result.thermal.append(ThermalReading(phase, "battery", float(info.battery.celsius)))
        return info

    def environment(self, clocks_mhz: dict[str, float] | None) -> None:
        """Best effort too: the OS, kernel, driver, adapter and WebGPU runtime this run starts in."""
        try:
            from agent.deviceinfo import browser_environment, read_environment

            if self.executor == "browser":
                adapter = self.pipe.session.hello["adapter"]
                self.result.environment = browser_environment(self.caps.as_dict(), adapter.get("user_agent", ""))
            elif self.executor == "plan":
                self.result.environment = read_environment(self.caps.as_dict(), clocks_mhz, webgpu_kind="plan")
            else:
                self.result.environment = read_environment(self.caps.as_dict(), clocks_mhz)
        except Exception as exc:
            print(f"[job] environment unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)

    def engine_info(self, pipe=None, **extra) -> None:
        caps = self.caps
        info = {"model": self.task.model, "build": self.task.build, "executor": self.executor,
                "requested_profile": self.spec.profile, "requested_precision": self.spec.precision}
        if caps is not None:  # None until the browser's page is up
            info["adapter"] = caps.as_dict()
        if pipe is not None:
            info |= self.selection_info(pipe) if self.executor == "native" else self.plans_info(pipe)
            if self.result.environment is not None:
                self.result.environment.profile = profile_identity(self.profile, info["profile"], caps)
        self.result.engine = info | extra

    @staticmethod
    def selection_info(pipe) -> dict:
        decisions = Counter(f"{d.op}/{d.variant}" for d in pipe.selection.decisions.values())
        return {"profile": pipe.selection.profile_name, "precision": pipe.precision,
                "residency": pipe.residency, "selection": dict(sorted(decisions.items())),
                "warnings": list(dict.fromkeys(pipe.notes + pipe.selection.warnings))}

    def plans_info(self, pipe) -> dict:
        """selection_info from the plans the job ran (one decision per op and shape, as a
        pipeline's selection keeps them; load made at least one plan), and their sha256s."""
        plans = list(pipe.plans.values())
        decisions = {(d["op"], json.dumps(d["shape"])): f"{d['op']}/{d['variant']}"
                     for plan in plans for d in plan["profile"]["decisions"]}
        from engine.kernels import precision_notes, precision_of

        precision = precision_of(pipe.dtype)
        notes = precision_notes(self.caps.device, pipe.precision, pipe.dtype)
        return {"profile": plans[0]["profile"]["name"], "precision": precision,
                "residency": pipe.residency, "selection": dict(sorted(Counter(decisions.values()).items())),
                "warnings": list(dict.fromkeys(notes + [w for plan in plans for w in plan["warnings"]])),
                "plans": [plan["sha256"] for plan in plans]}

    def profile(self):
        """What the pipeline loads with: the plan's profile, or for "auto" with a build's tuned
        profiles, the Profile chosen among them and the shipped ones for this GPU."""
        if self.task.profile != "auto" or not self.task.tuned_profiles:
            return self.task.profile
        from engine.profiles import auto_profile, load_profile_file

        return auto_profile(self.caps, extra=[load_profile_file(Path(p)) for p in self.task.tuned_profiles])

    def size(self, pipe) -> tuple[int, int]:
        return self.spec.height or pipe.native_size[0], self.spec.width or pipe.native_size[1]

    def load(self):
        """The pipeline, loaded once: load_ms times putting the weights on the GPU, so on the plan
        and browser executors, whose plans load their weights, it also makes the job's plans."""
        if self.pipe is not None:
            return self.pipe
        from engine import load_pipeline

        from .hubpage import HubPage

        if self.executor == "native":
            self.phase("load", model=self.task.model, profile=self.task.profile)
            t0 = time.perf_counter()
            if self.spec.gpu_budget_bytes is not None:
                from engine.errors import InputError

                raise InputError("a GPU memory budget (--gpu-budget-mb) is kept by the plan and browser executors; "
                                 "this job runs on the native one")
            self.pipe = load_pipeline(self.task.model, precision=self.spec.precision, profile=self.profile())
        else:
            self.phase("load", model=self.task.model, profile=self.task.profile, executor=self.executor)
            page = self.task.browser_page
            t0 = time.perf_counter()
            self.pipe = load_pipeline(self.task.model, precision=self.spec.precision, profile=self.task.profile,
                                      executor=self.executor, budget_bytes=self.spec.gpu_budget_bytes,
                                      **({"session": HubPage(page)} if page else {}))
            self.caps = self.pipe.caps
            if self.task.profile == "auto" and self.task.tuned_profiles:
                self.pipe.set_profile(self.profile())  # chosen for the page's adapter, known now
            (self.step_executor if self.spec.kind == "latency" else self.generation_executor)(self.pipe)
        self.sample("load_ms", (time.perf_counter() - t0) * 1e3, "ms")
        return self.pipe

    def generation_executor(self, pipe):
        """The executor of the job's generation (made as PlanPipeline.generate makes it)."""
        s = self.spec
        height, width = self.size(pipe)
        return pipe.plan_executor(height, width, s.steps, s.scheduler, s.guidance_scale,
                             None if s.init_image is None else float(s.strength))

    def step_executor(self, pipe):
        """The executor whose plan's UNet step is timed and profiled: a batch-2 plan at the
        job's size, the generation's own when it guides (its unet_step stage is the same; a
        browser page holds the weights of every plan it loads, so another plan would double
        them on the phone), else pipe.plan_executor(height, width, guidance_scale=7.5)."""
        ex = self.generation_executor(pipe)
        if ex.plan["batch"] == 2:
            return ex
        height, width = self.size(pipe)
        return pipe.plan_executor(height, width, guidance_scale=7.5)

    def close(self) -> None:
        """Give back what the pipeline started (the browser executor's Chromium)."""
        close = getattr(self.pipe, "close", None)
        if close is not None:
            close()

    def generate_once(self, pipe, height: int, width: int, phase: str, repetition: int | None = None):
        s = self.spec
        return pipe.generate(s.prompt, negative_prompt=s.negative_prompt, steps=s.steps,
                             guidance_scale=s.guidance_scale, seed=s.seed, height=height, width=width,
                             scheduler=s.scheduler, progress=self.steps(phase, repetition),
                             init_image=s.init_image, strength=s.strength)

    # -- the kinds

    def run(self) -> JobResult:
        try:
            if self.executor == "native":
                from engine.device import get_gpu

                self.caps = get_gpu().caps
            else:
                self.engine_info()
                self.load()  # the browser's adapter is known once its page is up
            self.result.device = self.caps.device
            self.engine_info()
            before = self.thermal("before")
            self.environment(before.clocks_mhz if before is not None else None)
            getattr(self, f"run_{self.spec.kind}")()
        finally:
            self.close()
        self.thermal("after")
        self.result.status = "succeeded"
        return self.result

    def run_generate(self) -> None:
        from PIL import Image
        from PIL.PngImagePlugin import PngInfo

        pipe = self.load()
        height, width = self.size(pipe)
        self.phase("generate", height=height, width=width, steps=self.spec.steps)
        g = self.generate_once(pipe, height, width, "generate")
        self.generation_samples(g, 0)
        meta = PngInfo()
        for key in ("job_id", "prompt", "negative_prompt", "seed", "steps", "scheduler", "guidance_scale"):
            meta.add_text(key, str(getattr(self.spec, key)))
        if self.spec.init_image is not None:
            meta.add_text("strength", str(self.spec.strength))
            meta.add_text("init_image_sha256", sha256_file(Path(self.spec.init_image)))
        path = self.out_dir / "image.png"
        Image.fromarray(g.image).save(path, pnginfo=meta)
        self.result.artifacts.append(artifact(self.out_dir, path, "image"))
        clock = self.kernel_timings_after(pipe, height, width)
        self.engine_info(pipe, height=height, width=width, generation_warnings=g.warnings, kernel_timing=clock)

    def run_latency(self) -> None:
        """Warm-ups, then spec.unet_repetitions timed UNet CFG steps (batch 2, reading the result
        back, so each is timed to GPU completion), then spec.kernel_repetitions profiled steps
        (as many by default) for per-kernel GPU times (profiling splits passes, so they are kept
        apart from the timed ones), then
        spec.repetitions timed end-to-end generations."""
        if self.executor != "native":
            return self.run_latency_on_plans()
        s = self.spec
        pipe = self.load()
        rt = pipe.rt
        height, width = self.size(pipe)
        sample, t, ctx_np = self.unet_inputs(pipe, height, width)
        timed_kernels = s.kernel_timings and self.caps.has_timestamps
        with pipe.weights_on_gpu("unet", "unet_context"):
            # projected once, as a generation does: a timed step is one of its loop's steps
            ctx = pipe.context_kv(rt.upload(ctx_np, pipe.dtype))
            self.phase("unet_warmup", repetitions=s.warmup)
            for _ in range(s.warmup):
                pipe._unet(sample, t, ctx)
            rt.sync()
            self.phase("unet_step", repetitions=s.unet_repetitions)
            with rt.watch_peak() as watch:
                for r in range(s.unet_repetitions):
                    t0 = time.perf_counter()
                    pipe._unet(sample, t, ctx)  # reads eps back: waits for the GPU
                    self.sample("unet_step_ms", (time.perf_counter() - t0) * 1e3, "ms", r)
                    self.emit({"event": "step", "phase": "unet_step", "done": r + 1, "total": s.unet_repetitions})
            self.sample("unet_step_peak_gpu_bytes", watch.peak_bytes, "bytes")
            if timed_kernels:
                self.time_kernels(pipe, sample, t, ctx, self.kernel_repetitions)
            del ctx
        self.e2e_generations(pipe, height, width)
        clock = ("off" if not s.kernel_timings else "unavailable (no timestamp-query)" if not timed_kernels
                 else "gpu timestamp queries" + (" (CPU adapter: not wall-clock comparable)"
                                                 if self.caps.adapter_type.lower() == "cpu" else ""))
        self.engine_info(pipe, height=height, width=width, unet_batch=2, unet_timestep=t, kernel_timing=clock,
                         kernel_timing_repetitions=self.kernel_repetitions if timed_kernels else 0)

    def run_latency_on_plans(self) -> None:
        """run_latency on the plan and browser executors: the executor of a batch-2 plan at the
        job's size (step_executor) times spec.unet_repetitions replays of its UNet step to GPU
        completion (after spec.warmup untimed ones, its inputs random and written once, so
        unlike the native step no upload or readback is in the time); then kernel_repetitions
        profiled replays for per-kernel GPU times, where the executor has them; then the end-to-end
        generations."""
        s = self.spec
        pipe = self.load()
        height, width = self.size(pipe)
        ex = self.step_executor(pipe)
        self.phase("unet_step", repetitions=s.unet_repetitions, warmup=s.warmup)
        for r, ms in enumerate(ex.time_stage("unet_step", s.unet_repetitions, warmup=s.warmup, seed=s.seed)):
            self.sample("unet_step_ms", ms, "ms", r)
        self.emit({"event": "step", "phase": "unet_step", "done": s.unet_repetitions, "total": s.unet_repetitions})
        from engine.plan_exec import plan_gpu_bytes

        self.sample("unet_step_peak_gpu_bytes", plan_gpu_bytes(ex), "bytes")
        clock = self.time_plan_kernels(ex, self.kernel_repetitions)
        self.e2e_generations(pipe, height, width)
        self.engine_info(pipe, height=height, width=width, unet_batch=ex.plan["batch"], unet_inputs="random",
                         kernel_timing=clock,
                         kernel_timing_repetitions=self.kernel_repetitions if clock.startswith("gpu") else 0)

    @property
    def kernel_repetitions(self) -> int:
        """Profiled UNet steps for per-kernel times: the spec's own count, else as many as the
        timed ones."""
        return self.spec.kernel_repetitions or self.spec.unet_repetitions

    def e2e_generations(self, pipe, height: int, width: int) -> None:
        s = self.spec
        for r in range(s.warmup):
            self.phase("e2e_warmup", repetition=r)
            self.generate_once(pipe, height, width, "e2e_warmup", r)
        for r in range(s.repetitions):
            self.phase("e2e", repetition=r, repetitions=s.repetitions)
            self.generation_samples(self.generate_once(pipe, height, width, "e2e", r), r)

    def time_plan_kernels(self, ex, repetitions: int) -> str:
        """Per-kernel GPU times of `repetitions` profiled replays of a plan's UNet step, one call
        each so that each repetition keeps its own; returns what the result's engine info says
        about the kernel clock."""
        if not self.spec.kernel_timings:
            return "off"
        if not self.caps.has_timestamps:
            return "unavailable (no timestamp-query)"
        if not hasattr(ex, "kernel_times"):
            return f"unavailable on the {self.executor} executor"
        self.phase("kernel_timings", repetitions=repetitions)
        for r in range(repetitions):
            times = ex.kernel_times("unet_step", 1)
            if times is None:  # the page's device did not get timestamp-query
                return "unavailable (no timestamp-query)"
            for label, kt in sorted(times.items()):
                self.result.kernel_timings.append(KernelTiming(label, int(kt["calls"]), float(kt["total_ms"]), r))
        return "gpu timestamp queries" + (" (CPU adapter: not wall-clock comparable)"
                                          if self.caps.adapter_type.lower() == "cpu" else "")

    def unet_inputs(self, pipe, height: int, width: int):
        """A UNet CFG step's inputs: seeded latents (batch 2), a timestep, the prompt's context."""
        import numpy as np

        f = pipe.vae_scale_factor
        rng = np.random.default_rng(self.spec.seed)
        sample = rng.standard_normal((2, pipe.latent_channels, height // f, width // f), dtype=np.float32)
        t = 981  # the first timestep of a 1000-step schedule; step cost does not depend on it
        return sample, t, pipe.encode_text(pipe.tokenize([self.spec.negative_prompt, self.spec.prompt]))

    def time_kernels(self, pipe, sample, t, ctx, repetitions: int) -> None:
        """Per-kernel GPU times of `repetitions` profiled UNet steps (profiling splits passes, so
        these steps are never the timed ones)."""
        rt = pipe.rt
        self.phase("kernel_timings", repetitions=repetitions)
        rt.set_profiling(True)
        try:
            rt.take_kernel_times()
            for r in range(repetitions):
                pipe._unet(sample, t, ctx)
                for label, kt in sorted(rt.take_kernel_times().items()):
                    self.result.kernel_timings.append(KernelTiming(label, kt.calls, kt.total_ms, r))
        finally:
            rt.set_profiling(False)

    def kernel_timings_after(self, pipe, height: int, width: int) -> str:
        """Generate and tune: one profiled UNet step after the work (the work itself stays
        unprofiled); returns what the result's engine info says about the kernel clock."""
        if not self.spec.kernel_timings:
            return "off"
        if not self.caps.has_timestamps:
            return "unavailable (no timestamp-query)"
        if self.executor != "native":
            ex = self.step_executor(pipe)
            ex.time_stage("unet_step", 0, warmup=1, seed=self.spec.seed)  # random inputs, one warm-up
            clock = self.time_plan_kernels(ex, 1)
            return clock + f", one UNet step after the {self.spec.kind}" if clock.startswith("gpu") else clock
        sample, t, ctx_np = self.unet_inputs(pipe, height, width)
        with pipe.weights_on_gpu("unet", "unet_context"):
            ctx = pipe.context_kv(pipe.rt.upload(ctx_np, pipe.dtype))  # once, as a generation does
            self.time_kernels(pipe, sample, t, ctx, 1)
            del ctx
        return "gpu timestamp queries, one UNet step after the " + str(self.spec.kind)

    def run_tune(self) -> None:
        from engine.device import get_gpu
        from engine.kernels import precision_of, storage_dtype
        from engine.models.config import load_model_config
        from engine.tune import tune

        s = self.spec
        config = load_model_config(self.task.model)
        gpu = get_gpu()
        height, width = s.height or config.native_size[0], s.width or config.native_size[1]
        dtype = storage_dtype(s.precision, gpu.caps.has_f16)
        path = self.out_dir / "profile.json"
        self.phase("tune", height=height, width=width, dtype=dtype)
        t0 = time.perf_counter()
        doc = tune(config, gpu, dtype, height, width, path, warmup=s.warmup, repeats=s.tune_repeats,
                   time_budget_s=s.tune_time_budget_s,
                   progress=lambda i, n, what: self.emit({"event": "step", "phase": "tune", "done": i, "total": n,
                                                          "what": what}))
        self.sample("tune_ms", (time.perf_counter() - t0) * 1e3, "ms")
        self.result.artifacts.append(artifact(self.out_dir, path, "profile"))
        precision = precision_of(dtype)
        clock = "off"
        if s.kernel_timings:  # the UNet's kernels under the profile just tuned
            from engine import load_pipeline

            pipe = load_pipeline(self.task.model, precision=precision, profile=str(path))
            clock = self.kernel_timings_after(pipe, height, width)
        from engine.profiles import auto_profile
        from engine.tune import estimated_gain

        family = auto_profile(gpu.caps, tuned=False)
        self.engine_info(None, profile=doc["name"], precision=precision,
                         height=height, width=width, tuned_pairs=len(doc["measurements"]),
                         optimized_pairs=sum(1 for m in doc["measurements"] if m["chosen"] != "reference"),
                         rules=len(doc["rules"]), kernel_timing=clock, family_profile=family.name,
                         estimated_gain=estimated_gain(doc, family, gpu.caps))


def profile_identity(spec: Callable[[], object], name: str, caps) -> dict[str, str]:
    """{"name", "sha256"} of the profile a pipeline runs with (`spec()` gives what the pipeline
    was loaded with, `name` is what its selection reports): engine.profiles.profile_sha256 of
    the document, the file's as a tune wrote it and the farm registered it, or a built-in
    profile's own; only the name when that no longer resolves to the same profile."""
    import warnings

    from engine.profiles import profile_sha256, resolve_profile

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the load already warned about a foreign profile
            profile = resolve_profile(spec(), caps)
        if profile.name != name:
            return {"name": name}
        source = Path(profile.source)
        doc = json.loads(source.read_text()) if source.is_file() else profile.to_json()
    except Exception:  # unreadable now: the name is still known
        return {"name": name}
    return {"name": name, "sha256": profile_sha256(doc)}


def error_text(exc: BaseException) -> str:
    from engine.errors import EngineError

    return str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"


def child_main(task_path: str) -> int:
    """The child's entry point. Its stdout carries only JSON event lines; anything else the
    process prints (Python or native) goes to stderr, which is the job's log."""
    events = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def emit(event: dict) -> None:
        with lock:
            events.write(json.dumps(event, default=str) + "\n")

    job = ChildJob(from_dict(ChildTask, json.loads(Path(task_path).read_text())), emit)
    try:
        result = job.run()
    except BaseException as exc:  # noqa: B036  (KeyboardInterrupt too: always hand back a result)
        traceback.print_exc()
        result = job.result
        result.status = "failed"
        result.error = error_text(exc)
    emit({"event": RESULT_EVENT, "result": to_dict(result)})
    events.close()
    return 0

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m agent.child TASK.json (started by agent.jobs.run_job)")
    sys.exit(child_main(sys.argv[1]))
