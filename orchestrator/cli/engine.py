"""`farm engine ...`: the engine on this machine's own GPU: adapter facts, test models, and
image generation."""

from __future__ import annotations

import json
import warnings
from enum import StrEnum
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import common, validate
from .output import console, escape

app = typer.Typer(help="Run the Stable Diffusion engine on this machine's GPU.", no_args_is_help=True)


class Preset(StrEnum):
    tiny = "tiny"
    sd14 = "sd14"


class Precision(StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"
    f16_storage = "f16-storage"


class VaeDtype(StrEnum):  # an element type the VAE decoder may be tuned in
    f32 = "f32"
    f16 = "f16"


class Executor(StrEnum):
    native = "native"
    plan = "plan"
    browser = "browser"


EXECUTOR_HELP = ("native: this process runs the engine eagerly; plan: this process replays engine plans; "
                "browser: a WebGPU page in Chromium runs the plans (see --browser).")
BROWSER_HELP = ("With --executor browser: headless (start Debian's Chromium here), manual (print a URL to open "
                "in any browser with WebGPU on this machine), or a DevTools endpoint http://HOST:PORT of a "
                "running Chrome (a tab is opened there).")


def _browser_options(executor: Executor, browser: str) -> dict:
    from engine.errors import InputError

    if executor != Executor.browser:
        if browser != "headless":
            raise InputError("--browser is for --executor browser")
        return {}
    if browser == "headless":
        return {}
    if browser == "manual":
        return {"manual": True}
    if browser.startswith(("http://", "https://")):
        return {"cdp": browser}
    raise InputError(f"--browser {browser!r}: use headless, manual or a DevTools endpoint http://HOST:PORT")


class Residency(StrEnum):
    resident = "resident"
    staged = "staged"


RESIDENCY_HELP = ("resident: all weights stay on the GPU; staged: each network's weights go up for its "
                  "stage only (lower peak GPU memory, one upload per network per generation). Default: "
                  "resident natively; on the plan and browser executors staged only when --budget-mb needs it.")

# Options the generating and planning commands share.
PRECISION_HELP = "fp16: shader-f16 where the adapter has it, else f16-storage (packed halves, f32 arithmetic)."
# A generation or benchmark on this machine is the reference the devices' runs are checked
# against, so it runs in fp32 unless told otherwise; what is planned or sent to devices is fp16.
LOCAL_PRECISION_HELP = PRECISION_HELP + " Default fp32 here: a local run is the full-precision reference."
STEPS_OPTION = typer.Option(20, help="Denoising steps.")
SCHEDULER_OPTION = typer.Option("pndm", help="pndm, ddim, euler, euler_ancestral or dpmpp_2m.")
PROFILE_OPTION = typer.Option("auto", help="Kernel profile: auto, reference, a shipped profile's name, or a JSON file.")
RESOLUTION_OPTION = validate.resolution_option()
# The old names of --resolution's two halves, kept working for scripts that pass them.
HEIGHT_OPTION = typer.Option(None, hidden=True, help="Deprecated: --resolution HxW.")
WIDTH_OPTION = typer.Option(None, hidden=True, help="Deprecated: --resolution HxW.")


def _size(resolution: tuple[int, int] | None, height: int | None, width: int | None) -> tuple[int | None, int | None]:
    """--resolution, or the deprecated --height and --width (None: the model's native size)."""
    return resolution or (height, width)


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON.")):
    """Show the WebGPU adapter, its features and limits."""
    from engine.device import get_gpu

    caps = get_gpu().caps
    if as_json:
        typer.echo(json.dumps(caps.as_dict(), indent=2))
        return
    from .output import Table

    console.print(f"[bold]{escape(caps.device)}[/] ({escape(caps.vendor or 'unknown vendor')}, {caps.adapter_type}, "
                  f"{caps.backend})")
    console.print(f"driver: {caps.description}", markup=False)
    console.print(f"features: {', '.join(sorted(caps.features)) or 'none'}")
    table = Table("limit", "value")
    for k, v in sorted(caps.limits.items()):
        table.add_row(k, f"{v:,}")
    console.print(table)


@app.command("make-model")
def make_model_cmd(
    preset: Preset = typer.Option(Preset.tiny, help="tiny: for tests; sd14: SD 1.4's real sizes."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    out: Path = typer.Option(..., help="Folder to write the diffusers-layout model to.",
                             callback=validate.output_dir),
    dtype: Precision = typer.Option(Precision.fp32, help="Storage type of the weights."),
):
    """Write a Stable Diffusion model with random weights in the diffusers layout."""
    from engine.make_model import make_model

    with console.status(f"writing {preset.value} model to {out}"):
        make_model(preset.value, seed, out, dtype=dtype.value)
    console.print(f"wrote {preset.value} model (seed {seed}, {dtype.value}) to {out}")


@app.command()
def generate(
    model: Path = typer.Option(..., help="diffusers model folder or SD 1.x .safetensors file."),
    prompt: str = typer.Option(..., help="What to draw."),
    out: Path = typer.Option(Path("out.png"), help="PNG file to write.", callback=validate.output_file),
    negative_prompt: str = typer.Option("", help="What to steer away from."),
    steps: int = STEPS_OPTION,
    guidance: float = typer.Option(7.5, help="Classifier-free guidance scale (<= 1 turns it off)."),
    seed: int = typer.Option(0, help="Seed of the numpy noise generator."),
    resolution: str = RESOLUTION_OPTION, height: int = HEIGHT_OPTION, width: int = WIDTH_OPTION,
    scheduler: str = SCHEDULER_OPTION,
    precision: Precision = typer.Option(Precision.fp32, help=LOCAL_PRECISION_HELP),
    init_image: Path = typer.Option(None, help="Start from this image (img2img)."),
    strength: float = typer.Option(0.8, help="img2img: how much of the init image to repaint."),
    tokenizer: Path = typer.Option(None, help="CLIP tokenizer folder, for single-file checkpoints."),
    profile: str = PROFILE_OPTION,
    residency: Residency = typer.Option(None, help=RESIDENCY_HELP),
    executor: Executor = typer.Option(Executor.native, help=EXECUTOR_HELP),
    browser: str = typer.Option("headless", help=BROWSER_HELP),
    budget_mb: float = typer.Option(None, "--budget-mb", min=1, help="plan and browser executors: GPU memory "
                                    "the generation may hold, in MB (10^6 bytes); a plan that cannot fit is "
                                    "refused before anything is allocated."),
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
):
    """Generate an image from a prompt (or from an image and a prompt)."""
    from engine import load_pipeline
    from engine.errors import InputError

    if init_image is not None and not init_image.is_file():
        raise InputError(f"init image {init_image} does not exist")
    options = _browser_options(executor, browser)
    if options.get("manual"):
        options["announce"] = lambda text: console.print(f"[bold]{text}[/]", highlight=False)
    with console.status(f"loading {model}" + (" (waiting for the browser page)" if executor == Executor.browser
                                             else "")):
        pipe = load_pipeline(model, precision=precision.value, tokenizer_dir=tokenizer, profile=profile,
                             residency=residency and residency.value, executor=executor.value,
                             budget_bytes=None if budget_mb is None else int(budget_mb * 1e6), **options)
    try:
        _generate(pipe, out, prompt, negative_prompt, steps, guidance, seed, *_size(resolution, height, width),
                  scheduler, init_image, strength, as_json)
    finally:
        if hasattr(pipe, "close"):
            pipe.close()


def _generate(pipe, out, prompt, negative_prompt, steps, guidance, seed, height, width, scheduler, init_image,
              strength, as_json):
    from PIL import Image

    height, width = height or pipe.native_size[0], width or pipe.native_size[1]
    columns = (TextColumn("denoising"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("denoise", total=None)
        result = pipe.generate(
            prompt, negative_prompt=negative_prompt, steps=steps, guidance_scale=guidance,
            seed=seed, height=height, width=width, scheduler=scheduler,
            init_image=init_image, strength=strength,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(result.image).save(out)
    summary = {
        "image": str(out),
        "adapter": pipe.caps.device,
        "executor": pipe.executor,
        "precision": pipe.precision,
        "height": height,
        "width": width,
        "steps": steps,
        "scheduler": scheduler,
        "timings_ms": {k.removesuffix("_ms"): round(v, 2) for k, v in result.timings.items()},
        "residency": pipe.residency,
        "peak_gpu_bytes": result.peak_gpu_bytes,
        "stage_peak_gpu_bytes": result.stage_peak_gpu_bytes,
        "warnings": result.warnings,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    t = result.timings
    console.print(
        f"{out}  {width}x{height}, {steps} steps {scheduler}, {pipe.precision} on {pipe.caps.device} ({pipe.executor}): "
        f"total {t['total_ms']:.0f} ms, text {t['text_encoder_ms']:.0f} ms, "
        f"UNet {t['unet_step_ms']:.0f} ms/step, VAE {t['vae_decode_ms']:.0f} ms, "
        f"peak GPU {result.peak_gpu_bytes / 2**20:.1f} MiB ({pipe.residency}: "
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in result.stage_peak_gpu_bytes.items()) + ")"
    )


def _bench_plan(model, preset, precision, resolution, reps, warmup, e2e_steps, executor, browser, json_out):
    """UNet CFG step and (with e2e_steps) a whole generation, replayed from the plan by this
    process or run by a browser page; per-kernel GPU times from the page where it has
    timestamp queries."""
    import statistics
    import tempfile

    from engine import load_pipeline
    from engine.errors import InputError

    from .output import Table

    if (model is None) == (preset is None):
        raise InputError("give exactly one of --model DIR or --preset tiny|sd14")
    options = _browser_options(executor, browser)
    with tempfile.TemporaryDirectory() as tmp:
        if preset is not None:
            from engine.make_model import make_model

            with console.status(f"making a random-weight {preset.value} model"):
                model = make_model(preset.value, 0, Path(tmp) / preset.value, dtype=precision.value)
        with console.status(f"loading {model} ({executor.value})"):
            pipe = load_pipeline(model, precision=precision.value, executor=executor.value, **options)
        try:
            res = resolution or pipe.native_size[0]
            with console.status("timing the UNet step"):
                ex = pipe.plan_executor(res, res)
                unet = ex.time_stage("unet_step", reps, warmup)
            e2e = []
            if e2e_steps:
                with console.status(f"timing a {e2e_steps}-step generation"):
                    for _ in range(warmup + 1):
                        r = pipe.generate("a red bicycle leaning on a wall", steps=e2e_steps, height=res, width=res)
                    e2e = [r.timings["total_ms"]]
            kernels = ex.kernel_times("unet_step") if hasattr(ex, "kernel_times") else None
        finally:
            if hasattr(pipe, "close"):
                pipe.close()
    caps, plan = pipe.caps, ex.plan
    table = Table("what", "ms (median)", "min-max", title=f"{caps.device} ({executor.value}), {plan['dtype']}, "
                  f"{res}x{res}, profile {plan['profile']['name']}")
    table.add_row("UNet CFG step", f"{statistics.median(unet):.1f}", f"{min(unet):.1f}-{max(unet):.1f}")
    if e2e:
        table.add_row(f"{e2e_steps}-step generation", f"{e2e[0]:.0f}", "-")
    console.print(table)
    if kernels:
        k = Table("kernel", "calls", "ms", title="per-kernel GPU time, one UNet step (timestamp queries)")
        for name, t in sorted(kernels.items(), key=lambda kv: -kv[1]["total_ms"])[:12]:
            k.add_row(name, str(t["calls"]), f"{t['total_ms']:.2f}")
        console.print(k)
    if json_out:
        json_out.write_text(json.dumps({"date": __import__("datetime").date.today().isoformat(), "adapter": caps.device,
                                        "executor": executor.value, "dtype": plan["dtype"], "size": res,
                                        "profile": plan["profile"]["name"], "unet_step_ms": unet,
                                        "e2e_ms": e2e, "kernels": kernels}, indent=1) + "\n")


def _config_for(model: Path | None, preset: Preset | None):
    """A model's configs from its folder, or a preset's without writing any weights."""
    from engine.errors import InputError
    from engine.make_model import preset_model_config
    from engine.models.config import load_model_config

    if (model is None) == (preset is None):
        raise InputError("give exactly one of --model DIR or --preset tiny|sd14")
    if model is not None:
        return load_model_config(model)
    return preset_model_config(preset.value)


def _native(config, height, width):
    return height or config.native_size[0], width or config.native_size[1]


@app.command()
def explain(
    model: Path = typer.Option(None, help="diffusers model folder."),
    preset: Preset = typer.Option(None, help="Or a preset's architecture (no weights needed)."),
    profile: str = PROFILE_OPTION,
    precision: Precision = typer.Option(Precision.fp16, help="Element type the kernels would run in."),
    resolution: str = RESOLUTION_OPTION, height: int = HEIGHT_OPTION, width: int = WIDTH_OPTION,
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON."),
):
    """Show which kernel variant each op of the model uses on this adapter, and why."""
    from engine.device import get_gpu
    from engine.explain import explain as run_explain
    from engine.kernels import storage_dtype
    from engine.profiles import resolve_profile

    from .output import Table

    config = _config_for(model, preset)
    caps = get_gpu().caps
    prof = resolve_profile(profile, caps)
    height, width = _native(config, *_size(resolution, height, width))
    dtype = storage_dtype(precision.value, caps.has_f16)  # fp16 without shader-f16: f16-storage, as a pipeline
    rows = run_explain(config, prof.selection(caps), caps, dtype, height, width)
    if as_json:
        typer.echo(json.dumps({"profile": prof.name, "adapter": caps.device, "dtype": dtype,
                               "rows": [r.__dict__ for r in rows]}, indent=2))
        return
    console.print(f"profile [bold]{escape(prof.name)}[/] ({escape(str(prof.source))}) on {escape(caps.device)}, {dtype}, "
                  f"{width}x{height}")
    table = Table("network", "op", "shape", "variant", "calls", "why")
    for r in rows:
        shape = " ".join(f"{k}={v}" for k, v in r.shape.items())
        table.add_row(r.network, r.op, shape, r.variant, str(r.calls), r.why)
    console.print(table)


@app.command("serve-plan")
def serve_plan(
    model: Path = typer.Option(..., help="diffusers model folder."),
    prompt: str = typer.Option("a lighthouse on a cliff at dusk", help="What to draw."),
    out: Path = typer.Option(Path("browser.png"), help="PNG file to write.", callback=validate.output_file),
    steps: int = STEPS_OPTION,
    scheduler: str = SCHEDULER_OPTION,
    seed: int = typer.Option(0, help="Seed of the numpy noise generator."),
    precision: Precision = typer.Option(Precision.fp32, help=LOCAL_PRECISION_HELP),
    browser: str = typer.Option("manual", help=BROWSER_HELP),
):
    """Run a generation's engine plan in a browser on this machine: prints the page's URL (open it
    in Chrome, Edge or Safari with WebGPU), serves it the plan, shaders and weights, and writes
    the image the page makes."""
    generate(model=model, prompt=prompt, out=out, negative_prompt="", steps=steps, guidance=7.5, seed=seed,
             height=None, width=None, scheduler=scheduler, precision=precision, init_image=None, strength=0.8,
             tokenizer=None, profile="auto", residency=None, executor=Executor.browser,
             browser=browser, budget_mb=None, as_json=False)


@app.command()
def plan(
    out: Path = typer.Option(..., help="Plan JSON to write.", callback=validate.output_file),
    model: Path = typer.Option(None, help="diffusers model folder (the plan then says where each weight is)."),
    preset: Preset = typer.Option(None, help="Or a preset's architecture: tensors and shapes only, no weights read."),
    precision: Precision = typer.Option(Precision.fp16, help=PRECISION_HELP),
    resolution: str = RESOLUTION_OPTION, height: int = HEIGHT_OPTION, width: int = WIDTH_OPTION,
    steps: int = STEPS_OPTION,
    scheduler: str = SCHEDULER_OPTION,
    guidance: float = typer.Option(7.5, help="Classifier-free guidance scale (<= 1 turns it off)."),
    strength: float = typer.Option(None, help="Image-to-image: encode an input image and denoise the last "
                                              "int(steps * strength) steps from it."),
    profile: str = PROFILE_OPTION,
    adapter: Path = typer.Option(None, help="The target adapter's capabilities as JSON (`farm engine info "
                                           "--json` on it, or a browser's report); default: this machine's."),
):
    """Write the engine plan of one generation configuration: buffers, pipelines and dispatches
    as data, for any WebGPU runtime (docs/engine-plans.md)."""
    from engine.fit import fit_plan
    from engine.plan import write_plan

    caps, prof, height, width, record = _planning(model, preset, adapter, profile, *_size(resolution, height, width))
    doc = record(precision=precision.value, steps=steps, scheduler=scheduler, guidance_scale=guidance,
                 strength=strength)
    write_plan(doc, out)
    for reason in fit_plan(doc, caps).reasons:  # the page would refuse it at load
        console.print(f"[yellow]warning:[/] the plan does not fit this adapter: {escape(reason)}", highlight=False)
    if precision == Precision.fp16 and doc["dtype"] != "f16":
        console.print(f"[yellow]warning:[/] {escape(caps.device)} has no shader-f16: the plan runs in f32; give the "
                      "target's capabilities with --adapter to plan for it", highlight=False)
    dispatches = {name: sum(c["op"] == "dispatch" for c in st["commands"]) for name, st in doc["stages"].items()}
    weights = [b for b in doc["buffers"] if b["kind"] == "weight"]
    console.print(f"{out}: plan {doc['sha256'][:12]} for {doc['dtype']} {width}x{height}, {steps} steps "
                  f"{scheduler}, profile {prof.name}; {len(doc['pipelines'])} pipelines, "
                  + ", ".join(f"{k} {v} dispatches" for k, v in dispatches.items())
                  + f"; {len(weights)} weights ({sum(b['size'] for b in weights) / 2**20:.1f} MiB"
                  + (", named only: no model folder given" if model is None else "") + ")", highlight=False)


@app.command()
def fit(
    adapter: Path = typer.Option(..., help="The target adapter's capabilities as JSON (engine/adapters/ has phones' "
                                           "browsers; `farm engine info --json` prints this machine's)."),
    model: Path = typer.Option(None, help="diffusers model folder."),
    preset: Preset = typer.Option(None, help="Or a preset's architecture (sd14: the real model's sizes)."),
    precision: Precision = typer.Option(Precision.fp16, help=PRECISION_HELP),
    resolution: str = RESOLUTION_OPTION, height: int = HEIGHT_OPTION, width: int = WIDTH_OPTION,
    steps: int = STEPS_OPTION,
    scheduler: str = SCHEDULER_OPTION,
    profile: str = PROFILE_OPTION,
    budget_mb: float = typer.Option(None, "--budget-mb", min=1, help="GPU memory the page may use, in MB "
                                    "(10^6 bytes; the paper ran SD 1.4 in 2,093 MB on a Galaxy S23 Ultra)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
):
    """Whether one generation fits an adapter, from its engine plan alone: the GPU memory its
    executors allocate, the largest buffer and binding, the workgroup storage and invocations
    its kernels need, against the adapter's limits and a budget. Exit 1 when it does not fit,
    with the reasons."""
    from engine.errors import EngineError, InputError, ModelError
    from engine.fit import Fit, fit_plan

    from .output import Table

    caps, prof, height, width, record = _planning(model, preset, adapter, profile, *_size(resolution, height, width))
    budget = None if budget_mb is None else int(budget_mb * 1e6)
    try:
        doc = record(budget, precision=precision.value, steps=steps, scheduler=scheduler, guidance_scale=7.5)
    except (InputError, ModelError):
        raise
    except EngineError as exc:  # a kernel no setting of which this adapter can run
        result = Fit(fits=False, profile=prof.name, precision="", peak_gpu_bytes=0, max_binding_bytes=0,
                     max_buffer_bytes=0, max_workgroup_storage_bytes=0, max_invocations_per_workgroup=0,
                     budget_bytes=budget, reasons=[f"no plan can be made: {exc}"])
    else:
        result = fit_plan(doc, caps, budget)
    if as_json:
        typer.echo(json.dumps(result.as_dict(), indent=2))
    else:
        table = Table("what", "value", title=f"{width}x{height}, {steps} steps {scheduler} on {escape(caps.description or caps.device)}")
        table.add_row("fits", "yes" if result.fits else "no")
        table.add_row("profile", result.profile)
        table.add_row("precision", result.precision)
        table.add_row("residency", result.residency)
        table.add_row("scratch_divisor", str(result.scratch_divisor))
        for name in ("peak_gpu_bytes", "resident_gpu_bytes", "staged_gpu_bytes", "max_binding_bytes", "max_buffer_bytes", "max_workgroup_storage_bytes",
                     "max_invocations_per_workgroup", "budget_bytes"):
            value = getattr(result, name)
            table.add_row(name, "-" if not value else f"{value:,}")
        console.print(table)
        for reason in result.reasons:
            console.print(f"[red]does not fit:[/] {escape(reason)}", highlight=False)
    if not result.fits:
        raise typer.Exit(1)


def _planning(model: Path | None, preset: Preset | None, adapter: Path | None, profile: str, height, width):
    """What `plan` and `fit` record a generation's plan for: the adapter's caps, the profile
    chosen for it, the image size, and `record(**generation)`, which records the plan."""
    from engine.plan import record_plan_within
    from engine.profiles import resolve_profile

    config = _config_for(model, preset)
    caps = _caps(adapter)
    height, width = _native(config, height, width)
    prof = resolve_profile(profile, caps)

    def record(budget_bytes: int | None = None, **generation):
        with console.status("recording the plan"):
            return record_plan_within(config, caps, budget_bytes, model_dir=model, height=height, width=width,
                                      profile=prof.to_json(), model_name=(model.name if model else preset.value),
                                      **generation)

    return caps, prof, height, width, record


def _caps(adapter: Path | None):
    """DeviceCaps from a JSON file (as `farm engine info --json` prints them), or this machine's."""
    from engine.device import caps_from_dict, get_gpu
    from engine.errors import InputError

    if adapter is None:
        return get_gpu().caps
    try:
        return caps_from_dict(json.loads(adapter.read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise InputError(f"--adapter {adapter}: not an adapter description ({exc})") from exc


@app.command()
def tune(
    out: Path = typer.Option(..., help="Profile JSON to write (atomically, at the end).",
                             callback=validate.output_file),
    model: Path = typer.Option(None, help="diffusers model folder."),
    preset: Preset = typer.Option(None, help="Or a preset's architecture."),
    precision: Precision = typer.Option(Precision.fp16),
    resolution: str = RESOLUTION_OPTION, height: int = HEIGHT_OPTION, width: int = WIDTH_OPTION,
    repeats: int = typer.Option(5, min=1), warmup: int = typer.Option(1, min=0),
    time_budget: float = typer.Option(600.0, help="Seconds; past it only reference variants are timed."),
    ops: str = typer.Option(None, help="Only these ops, comma-separated (e.g. linear,conv2d)."),
    networks: str = typer.Option(None, help="Only these networks' calls: text_encoder, unet, vae_decoder."),
    where: str = typer.Option(None, help='Only the shapes this rule condition holds for, e.g. \'{"cout": {"max": 4}}\'.'),
    vae_dtype: VaeDtype = typer.Option(None, help="Time the VAE decoder in this element type; its rules name it."),
    merge_into: Path = typer.Option(None, exists=True, dir_okay=False,
                                    help="Keep this profile's rules and measurements for what is not tuned."),
):
    """Time every applicable variant of every (op, shape) of the model on this GPU; write a profile.
    --ops, --networks and --where tune part of it; --merge-into completes that part from a profile."""
    from engine.device import get_gpu
    from engine.kernels import storage_dtype
    from engine.tune import TimerQuantizedWarning
    from engine.tune import tune as run_tune

    config = _config_for(model, preset)
    gpu = get_gpu()
    height, width = _native(config, *_size(resolution, height, width))
    dtype = storage_dtype(precision.value, gpu.caps.has_f16)  # fp16 without shader-f16: f16-storage, as a pipeline
    try:
        condition = None if where is None else json.loads(where)
        base = None if merge_into is None else json.loads(merge_into.read_text())
    except ValueError as exc:
        common.fail(f"--where or --merge-into: not JSON ({exc})")
    op_set = set(ops.split(",")) if ops else None
    with Progress(TextColumn("tuning"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console) as bar, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", TimerQuantizedWarning)
        task = bar.add_task("", total=None)
        doc = run_tune(config, gpu, dtype, height, width, out, warmup=warmup, repeats=repeats,
                       time_budget_s=time_budget, ops=op_set, networks=set(networks.split(",")) if networks else None,
                       vae_dtype=vae_dtype and vae_dtype.value, where=condition, base=base,
                       progress=lambda i, n, what: bar.update(task, completed=i, total=n, description=what[:60]))
    for w in said:  # the tuner's own warning said plainly; any other as Python shows it
        if issubclass(w.category, TimerQuantizedWarning):
            console.print(f"[yellow]warning:[/yellow] {w.message}")
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    changed = sum(1 for m in doc["measurements"] if m["chosen"] != "reference")
    console.print(f"wrote {out}: {len(doc['measurements'])} (op, shape) pairs measured, {changed} use an optimized variant")


@app.command()
def bench(
    model: Path = typer.Option(None, help="diffusers model folder."),
    preset: Preset = typer.Option(None, help="Or make a random-weight model of this preset first."),
    precision: Precision = typer.Option(Precision.fp32, help=LOCAL_PRECISION_HELP),
    resolution: str = validate.resolution_option("Image size, one number (512) or a square HEIGHTxWIDTH "
                                                 "(default: the model's native size)."),
    ablation: bool = typer.Option(True, help="Run the ablation rows (reference -> optimized -> tuned)."),
    tuned: Path = typer.Option(None, help="A tuned profile for the last row."),
    reps: int = typer.Option(5, min=1), warmup: int = typer.Option(1, min=0),
    e2e_steps: int = typer.Option(0, help="Also time a whole generation of this many steps (20: the paper)."),
    vae: bool = typer.Option(True, help="Also time the VAE decode of one latent in every row."),
    residency: Residency = typer.Option(Residency.resident, help=RESIDENCY_HELP),
    executor: Executor = typer.Option(Executor.native, help=EXECUTOR_HELP + " plan and browser time the UNet step "
                                    "and a generation of the auto profile's plan (no ablation rows)."),
    browser: str = typer.Option("headless", help=BROWSER_HELP),
    json_out: Path = typer.Option(None, "--json", help="Write the results as JSON here.",
                                  callback=validate.output_file),
):
    """The paper's ablation table on this adapter: UNet step latency and peak memory per row, the
    VAE decode, and the roofline of the last row (per op family against this adapter's measured
    SIMT and bandwidth peaks)."""
    import tempfile

    if resolution is not None and resolution[0] != resolution[1]:
        common.fail(f"--resolution {resolution[0]}x{resolution[1]}: the ablation times square images; give one size")
    resolution = resolution and resolution[0]
    if executor != Executor.native:
        return _bench_plan(model, preset, precision, resolution, reps, warmup, e2e_steps, executor, browser, json_out)

    from engine import load_pipeline
    from engine.bench import rows_as_json, run_ablation
    from engine.errors import InputError

    from .output import Table

    if (model is None) == (preset is None):
        raise InputError("give exactly one of --model DIR or --preset tiny|sd14")
    with tempfile.TemporaryDirectory() as tmp:
        if preset is not None:
            from engine.make_model import make_model

            with console.status(f"making a random-weight {preset.value} model"):
                model = make_model(preset.value, 0, Path(tmp) / preset.value, dtype=precision.value)
        with console.status(f"loading {model}"):
            pipe = load_pipeline(model, precision=precision.value, profile="reference", residency=residency.value)
    res = resolution or pipe.native_size[0]
    with Progress(TextColumn("ablation"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=None)
        rows = run_ablation(pipe, res, res, reps=reps, warmup=warmup, e2e_steps=e2e_steps, tuned=tuned, vae=vae,
                            progress=lambda i, n, what: bar.update(task, completed=i, total=n, description=what))
    caps = pipe.gpu.caps
    base = rows[0].unet_step_ms["median"]
    table = Table("configuration", "UNet step ms (median)", "min-max", "vs reference", "peak GPU MiB",
                  *(["VAE decode ms"] if vae else []), *(["end-to-end ms"] if e2e_steps else []),
                  title=f"{caps.device} ({caps.backend}), {pipe.precision}, {pipe.residency} weights, {res}x{res}, "
                        f"UNet batch 2")
    for r in rows:
        u = r.unet_step_ms
        table.add_row(r.name, f"{u['median']:.1f}", f"{u['min']:.1f}-{u['max']:.1f}",
                      f"{(u['median'] / base - 1) * 100:+.1f}%", f"{r.peak_gpu_bytes / 2**20:.0f}",
                      *([f"{r.vae_decode_ms['median']:.1f}"] if vae else []),
                      *([f"{r.end_to_end_ms:.0f}"] if e2e_steps else []))
    console.print(table)
    if rows[-1].stage_peak_gpu_bytes:
        console.print("peak GPU MiB by stage, last row's generation: " + ", ".join(
            f"{k} {v / 2**20:.0f}" for k, v in rows[-1].stage_peak_gpu_bytes.items()))
    if rows[-1].kernel_ms:
        k = Table("kernel", "ms", title=f"per-kernel GPU time, one UNet step, {rows[-1].name}")
        for name, ms in list(rows[-1].kernel_ms.items())[:12]:
            k.add_row(name, f"{ms:.2f}")
        console.print(k)
    if rows[-1].roofline:
        from engine import roofline

        t = Table(*roofline.COLUMNS, title=f"{roofline.title(rows[-1].roofline)}, one UNet step, {rows[-1].name}")
        for r in rows[-1].roofline["rows"]:
            t.add_row(*roofline.cells(r))
        console.print(t)
    if json_out:
        json_out.write_text(json.dumps({"date": __import__("datetime").date.today().isoformat(),
                                        "adapter": caps.device, "backend": caps.backend, "driver": caps.description,
                                        "precision": pipe.precision, "residency": pipe.residency, "resolution": res,
                                        "rows": rows_as_json(rows)}, indent=2))
