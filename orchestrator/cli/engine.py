"""`farm engine ...`: the engine on this machine's own GPU: adapter facts, test models, and
image generation."""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

app = typer.Typer(help="Run the Stable Diffusion engine on this machine's GPU.", no_args_is_help=True)
console = Console()


class Preset(StrEnum):
    tiny = "tiny"
    sd14 = "sd14"


class Precision(StrEnum):
    fp32 = "fp32"
    fp16 = "fp16"


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print machine-readable JSON.")):
    """Show the WebGPU adapter, its features and limits."""
    from engine.device import get_gpu

    caps = get_gpu().caps
    if as_json:
        typer.echo(json.dumps(caps.as_dict(), indent=2))
        return
    from rich.table import Table

    console.print(f"[bold]{caps.device}[/] ({caps.vendor or 'unknown vendor'}, {caps.adapter_type}, {caps.backend})")
    console.print(f"driver: {caps.description}")
    console.print(f"features: {', '.join(sorted(caps.features)) or 'none'}")
    table = Table("limit", "value")
    for k, v in sorted(caps.limits.items()):
        table.add_row(k, f"{v:,}")
    console.print(table)


@app.command("make-model")
def make_model_cmd(
    preset: Preset = typer.Option(Preset.tiny, help="tiny: for tests; sd14: SD 1.4's real sizes."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    out: Path = typer.Option(..., help="Folder to write the diffusers-layout model to."),
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
    out: Path = typer.Option(Path("out.png"), help="PNG file to write."),
    negative_prompt: str = typer.Option("", help="What to steer away from."),
    steps: int = typer.Option(20, help="Denoising steps."),
    guidance: float = typer.Option(7.5, help="Classifier-free guidance scale (<= 1 turns it off)."),
    seed: int = typer.Option(0, help="Seed of the numpy noise generator."),
    height: int = typer.Option(None, help="Image height (default: the model's native size)."),
    width: int = typer.Option(None, help="Image width (default: the model's native size)."),
    scheduler: str = typer.Option("pndm", help="pndm, ddim, euler, euler_ancestral or dpmpp_2m."),
    precision: Precision = typer.Option(Precision.fp32, help="fp16 needs the shader-f16 feature."),
    init_image: Path = typer.Option(None, help="Start from this image (img2img)."),
    strength: float = typer.Option(0.8, help="img2img: how much of the init image to repaint."),
    tokenizer: Path = typer.Option(None, help="CLIP tokenizer folder, for single-file checkpoints."),
    as_json: bool = typer.Option(False, "--json", help="Print the result summary as JSON."),
):
    """Generate an image from a prompt (or from an image and a prompt)."""
    from PIL import Image

    from engine import load_pipeline
    from engine.errors import InputError

    if init_image is not None and not init_image.is_file():
        raise InputError(f"init image {init_image} does not exist")
    with console.status(f"loading {model}"):
        pipe = load_pipeline(model, precision=precision.value, tokenizer_dir=tokenizer)
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
        "adapter": pipe.gpu.caps.device,
        "precision": pipe.precision,
        "height": height,
        "width": width,
        "steps": steps,
        "scheduler": scheduler,
        "timings_ms": {k.removesuffix("_ms"): round(v, 2) for k, v in result.timings.items()},
        "peak_gpu_bytes": result.peak_gpu_bytes,
        "warnings": result.warnings,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")
    t = result.timings
    console.print(
        f"{out}  {width}x{height}, {steps} steps {scheduler}, {pipe.precision} on {pipe.gpu.caps.device}: "
        f"total {t['total_ms']:.0f} ms, text {t['text_encoder_ms']:.0f} ms, "
        f"UNet {t['unet_step_ms']:.0f} ms/step, VAE {t['vae_decode_ms']:.0f} ms, "
        f"peak GPU {result.peak_gpu_bytes / 2**20:.1f} MiB"
    )
