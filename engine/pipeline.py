"""Text-to-image and image-to-image generation: the one place that knows the tokenizer, the
three networks, the scheduler and the GPU context together.

Randomness contract (so results can be reproduced and compared with diffusers): all noise
comes from one `numpy.random.default_rng(seed)` (PCG64), drawn as
`rng.standard_normal(shape, dtype=np.float32)` in this order: the initial latents (txt2img,
unless `latents=` is given) or, for img2img, the VAE posterior sample and then the forward
noise; then one draw per step for ancestral samplers.

Weight residency (`load_pipeline(residency=...)`): "resident" uploads all three networks'
weights at load and keeps them on the GPU, so peak GPU memory is every weight plus the
largest stage's activations. "staged" keeps the weights in host memory (already converted to
their GPU element type) and uploads each network's for its stage only: text encoder, the
UNet's projections of the text to cross-attention keys and values (once a generation), the rest
of the UNet for the whole denoising loop, then the VAE decoder; the peak is then the largest stage
alone, for one upload of each network per generation. Either way the free activation buffers
are destroyed between stages, and each stage's peak is reported in
`GenerationResult.stage_peak_gpu_bytes`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .denoise import DenoisingLoop
from .device import GPU, get_gpu
from .errors import InputError, ModelError
from .gpu import DTYPES, GpuContext, StageTimer, Tensor, TraceContext
from .kernels import Selection, precision_notes, precision_of, storage_dtype
from .models.clip import ACTIVATIONS, CLIPTextEncoder
from .models.common import GPUWeights
from .models.unet import ContextKV, UNet2DCondition, is_context_projection, timestep_embedding
from .models.vae import AutoencoderKL
from .ops import Ops
from .schedulers import SCHEDULERS
from .schedulers.program import loop_program

RESIDENCIES = ("resident", "staged")
ProgressFn = Callable[[int, int], None]  # (steps done, steps total)


@dataclass
class GenerationResult:
    image: np.ndarray  # (H, W, 3) uint8
    latents: np.ndarray  # (1, C, h, w) float32, the final (scaled) latents
    timings: dict[str, float]  # per stage, in ms; keys end in _ms
    peak_gpu_bytes: int  # of this generation: weights on the GPU plus every pool buffer
    warnings: list[str] = field(default_factory=list)
    # The peak of each stage (text_encoder, vae_encode for img2img, unet, vae_decode).
    stage_peak_gpu_bytes: dict[str, int] = field(default_factory=dict)


def _load_components(model_path: Path, tokenizer_dir: Path | None):
    """(ModelConfig, tokenizer, {component: state dict}) from a diffusers folder or single file."""
    from .models import params
    from .models.config import load_model_config
    from .tokenizer import CLIPTokenizer
    from .weights.loader import load_component

    if model_path.is_file():
        from .weights.single_file import load_single_file

        config, states = load_single_file(model_path)
        # A single-file checkpoint has no vocabulary: take the one given, or a tokenizer/
        # folder beside the file.
        tok = tokenizer_dir or config.tokenizer_dir or model_path.parent / "tokenizer"
        if not Path(tok).is_dir():
            raise ModelError(
                f"{model_path} is a single-file checkpoint and carries no tokenizer; pass "
                f"tokenizer_dir (CLI: --tokenizer) pointing at an SD 1.x CLIP tokenizer folder "
                f"(vocab.json + merges.txt), or put one at {model_path.parent / 'tokenizer'}"
            )
        return config, CLIPTokenizer(tok), states
    if not model_path.is_dir():
        raise ModelError(f"model path {model_path} does not exist; give a diffusers model folder or a .safetensors checkpoint")
    config = load_model_config(model_path)
    tokenizer = CLIPTokenizer(tokenizer_dir or config.tokenizer_dir)
    states = {
        "text_encoder": load_component(model_path, "text_encoder", params.clip_param_shapes(config.text_encoder)),
        "unet": load_component(model_path, "unet", params.unet_param_shapes(config.unet)),
        "vae": load_component(model_path, "vae", params.vae_param_shapes(config.vae)),
    }
    return config, tokenizer, states


def _selection(caps, profile) -> Selection:
    """A profile spec (None/"auto", "reference", a shipped name, a path, a profile document, or
    a plain {op: variant} mapping) -> the selection every dispatch consults."""
    from .profiles import resolve_profile

    if isinstance(profile, dict) and "schema" not in profile:
        return Selection.forcing(caps.features, dict(profile))
    return resolve_profile(profile, caps).selection(caps)


# The VAE decoder's Winograd scratch is 4x the UNet's (64 MiB per buffer): its stage peaks well
# below the UNet's, and at 512x512 its 3x3 convolutions otherwise run in 32-64 chunks of small
# products each.
VAE_SCRATCH_SCALE = 4


def scratch_scale(network: str, divisor: int = 1) -> float:
    """The Ops scratch_scale a pipeline runs `network` with (text_encoder, unet, vae_decoder,
    vae_encoder); a plan made for a memory budget it would not otherwise fit divides it
    (engine.plan.record_plan_within: smaller chunks, more dispatches)."""
    return (VAE_SCRATCH_SCALE if network.startswith("vae") else 1) / divisor


def _vae_dtype(config, dtype: str, decodes_again: bool = False) -> str:
    """The VAE's element type in a pipeline of `dtype`. A VAE the model marks force_upcast (SD
    1.x's, by AutoencoderKL's default) runs in f32 in a pipeline of halves wherever an overflow
    would go uncaught: a plan as a browser page runs it, whose result only says that its image
    went non-finite. An executor that decodes again in f32 when its image comes back with an inf
    or NaN (`decodes_again`: the native pipeline and the plan executor on this process's GPU)
    runs it in f16, as diffusers' StableDiffusionPipeline runs SD 1.x's decoder in an fp16
    pipeline (only its SDXL pipelines read force_upcast): 38-40 ms against 57-58 in f32 for
    SD 1.4 at 512x512 on the H100 (docs/benchmarks.md). f16-storage, the phone's form, keeps f32."""
    if dtype == "f16" and decodes_again:
        return dtype
    return "f32" if dtype in ("f16", "f16s") and config.vae.force_upcast else dtype


def check_residency(residency: str) -> None:
    if residency not in RESIDENCIES:
        raise InputError(f"residency {residency!r} is not one of {', '.join(RESIDENCIES)}")


def load_native_pipeline(model_dir, precision: str = "fp32", profile=None, tokenizer_dir=None,
                         residency: str = "resident") -> Pipeline:
    """The native executor of engine.load.load_pipeline: a model (diffusers folder or SD 1.x
    single-file checkpoint) run eagerly by this process, its weights on the GPU ("resident")
    or in host memory, to go up one network at a time ("staged"; see the module docstring)."""
    config, tokenizer, states = _load_components(Path(model_dir), tokenizer_dir and Path(tokenizer_dir))
    if config.text_encoder.hidden_act not in ACTIVATIONS:
        raise ModelError(
            f"text encoder activation {config.text_encoder.hidden_act!r} is not supported; "
            f"supported: {', '.join(ACTIVATIONS)}"
        )
    gpu = get_gpu()
    dtype = storage_dtype(precision, gpu.caps.has_f16)
    notes = precision_notes(gpu.caps.device, precision, dtype)
    if residency == "staged":  # convert once here, not on every upload
        dtypes = {"text_encoder": dtype, "unet": dtype, "vae": _vae_dtype(config, dtype, decodes_again=True)}
        states = {
            c: {k: np.ascontiguousarray(a, dtype=DTYPES[dtypes[c]]) for k, a in s.items()}
            for c, s in states.items()
        }
    return Pipeline(config, tokenizer, states, gpu, dtype, _selection(gpu.caps, profile), notes, residency)


def check_generate_args(vae_scale_factor: int, steps, height, width, scheduler, guidance_scale,
                        strength: float | None) -> None:
    """What a generation's arguments must be, whichever executor runs or records it (strength
    None: text-to-image)."""
    f = vae_scale_factor
    for name, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or v <= 0 or v % 8 or v % f:
            raise InputError(f"{name} must be a positive multiple of {max(8, f)}, got {v}")
    if not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be an integer >= 1, got {steps}")
    if scheduler not in SCHEDULERS:
        raise InputError(f"unknown scheduler {scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
    if not np.isfinite(guidance_scale):
        raise InputError(f"guidance_scale must be a finite number, got {guidance_scale}")
    if strength is not None and not 0.0 < strength <= 1.0:
        raise InputError(f"strength must be in (0, 1], got {strength}")


def first_sample(rng: np.random.Generator, latents: np.ndarray | None, shape: tuple, init_noise_sigma: float,
                 size: tuple[int, int]) -> np.ndarray:
    """A text-to-image loop's first sample: the given latents (or the generator's first draw)
    times the scheduler's init_noise_sigma, in float32."""
    if latents is None:
        latents = rng.standard_normal(shape, dtype=np.float32)
    latents = np.asarray(latents, dtype=np.float32)
    if latents.shape != shape:
        raise InputError(f"latents must have shape {shape} for {size[0]}x{size[1]}, got {latents.shape}")
    return latents * np.float32(init_noise_sigma)


def vae_input_scale(config) -> float:
    """What latents are multiplied by on their way into the VAE decoder: 1 / scaling_factor."""
    return 1.0 / float(np.float32(config.vae.scaling_factor))


def prepare_image(init_image, height: int, width: int) -> np.ndarray:
    """uint8 (H, W, 3), a PIL image or a path -> (1, 3, height, width) float32 in [-1, 1]."""
    from PIL import Image

    if isinstance(init_image, str | Path):
        try:
            init_image = Image.open(init_image).convert("RGB")
        except OSError as exc:
            raise InputError(f"cannot read init image {init_image}: {exc}") from exc
    if isinstance(init_image, np.ndarray):
        if init_image.ndim != 3 or init_image.shape[2] != 3 or init_image.dtype != np.uint8:
            raise InputError(f"init_image array must be uint8 (H, W, 3), got {init_image.dtype} {init_image.shape}")
        init_image = Image.fromarray(init_image)
    if init_image.size != (width, height):
        init_image = init_image.resize((width, height), Image.LANCZOS)
    arr = np.asarray(init_image.convert("RGB"), dtype=np.float32) / 255.0
    return (arr.transpose(2, 0, 1)[None] * 2.0 - 1.0).astype(np.float32)


def non_finite_warnings(latents: np.ndarray, decoded: np.ndarray, dtype: str, vae_dtype: str) -> list[str]:
    """What a generation says when its latents or image hold an inf or NaN (an activation beyond
    its element type's range: f16 holds at most 65,504): the 8-bit image of such values is not
    the model's."""
    out = []
    for what, values, net in (("latents", latents, f"the UNet ({dtype})"), ("image", decoded, f"the VAE decoder ({vae_dtype})")):
        bad = int(values.size - np.count_nonzero(np.isfinite(values)))
        if bad:
            out.append(f"the generated {what} hold {bad} inf or NaN values of {values.size}: an activation of "
                       f"{net} or before it went beyond its element type's range")
            break  # the image of non-finite latents is so too
    return out


def overflow_note(vae_dtype: str) -> str:
    """What a generation says when its decoder in halves overflowed and decoded again in f32."""
    return f"the VAE decoder overflowed {vae_dtype} (inf or NaN in its image): decoded again in f32"


def decode_in_f32(ops: Ops, config, weights: GPUWeights, latents: Tensor) -> np.ndarray:
    """The f32 latents on the GPU decoded by the VAE decoder in f32 (`ops` in f32, `weights` its
    f32 parameters): what a decoder in halves that overflowed falls back to, in every executor
    that runs on this process's GPU."""
    z = ops.step_prepare(latents, vae_input_scale(config), 1)
    return ops.rt.read(AutoencoderKL(config.vae, weights, ops).decode(z)).astype(np.float32)


def image_from_decoded(decoded: np.ndarray) -> np.ndarray:
    """The VAE's (1, 3, H, W) output in [-1, 1] -> (H, W, 3) uint8, scaled in f32 whatever the
    decoder's element type (f16's spacing near 255 is 0.125: scaled in halves, pixels move by one)."""
    image = np.clip(np.asarray(decoded[0], np.float32) / 2.0 + 0.5, 0.0, 1.0).transpose(1, 2, 0)
    return np.round(image * 255.0).astype(np.uint8)


class _PaddingTokenizer:
    """Stands in for the tokenizer of a shape-only pipeline: every text is 77 padding ids."""

    def __call__(self, texts: list[str]) -> np.ndarray:
        return np.zeros((len(texts), 77), np.int64)


def _prefixed(*prefixes: str) -> Callable[[str], bool]:
    return lambda name: name.startswith(prefixes)


# The weights each stage needs: (network, which of its parameters). The UNet's projections of the
# text context to cross-attention keys and values run once a generation, in their own stage
# (unet_context), so the denoising loop's stage does without them.
STAGE_WEIGHTS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "text_encoder": ("text_encoder", lambda name: True),
    "unet_context": ("unet", is_context_projection),
    "unet": ("unet", lambda name: not is_context_projection(name)),
    "vae_encoder": ("vae", _prefixed("encoder.", "quant_conv.")),
    "vae_decoder": ("vae", _prefixed("decoder.", "post_quant_conv.")),
}


class BasePipeline:
    """What every pipeline is, whichever executor runs it (this process eagerly, plans, a browser
    page): one model's config and tokenizer, and one `generate` with one signature, defaults
    and input check (as diffusers' DiffusionPipeline gives every pipeline). An executor
    implements `_generate`, which receives checked arguments."""

    executor: str

    def __init__(self, config, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.vae_scale_factor = config.vae.vae_scale_factor
        self.latent_channels = config.unet.in_channels
        self.native_size = config.native_size  # (height, width)

    def tokenize(self, texts: list[str] | str) -> np.ndarray:
        """Texts -> (B, 77) int64 token ids, padded and truncated like CLIPTokenizer."""
        return self.tokenizer([texts] if isinstance(texts, str) else list(texts))

    def _temb_array(self, timestep, batch: int) -> np.ndarray:
        """The UNet's sinusoidal timestep embedding (batch, C), computed on the host."""
        cfg = self.config.unet
        t = np.broadcast_to(np.asarray(timestep, dtype=np.float64).reshape(-1), (batch,))
        return timestep_embedding(t, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)

    def generate(
        self,
        prompt: str,
        negative_prompt: str = "",
        steps: int = 20,
        guidance_scale: float = 7.5,
        seed: int = 0,
        height: int = 512,
        width: int = 512,
        scheduler: str = "pndm",
        latents: np.ndarray | None = None,
        progress: ProgressFn | None = None,
        init_image=None,
        strength: float = 0.8,
    ) -> GenerationResult:
        """One image from a prompt (and, with `init_image`, from an image: the last
        int(steps * strength) steps); see the module docstring for where its noise comes from."""
        check_generate_args(self.vae_scale_factor, steps, height, width, scheduler, guidance_scale,
                            None if init_image is None else strength)
        return self._generate(prompt, negative_prompt, steps, guidance_scale, seed, height, width, scheduler,
                              latents, progress, init_image, strength)

    def _generate(self, prompt, negative_prompt, steps, guidance_scale, seed, height, width, scheduler,
                  latents, progress, init_image, strength) -> GenerationResult:
        raise NotImplementedError


class Pipeline(BasePipeline):
    """The native executor: the networks run eagerly, op by op, on this process's GPU."""

    def __init__(self, config, tokenizer, states: dict, gpu: GPU | None, dtype: str, selection: Selection,
                 notes, residency: str = "resident", rt: GpuContext | TraceContext | None = None,
                 scratch_divisor: int = 1, vae_dtype: str | None = None):
        check_residency(residency)
        super().__init__(config, tokenizer)
        self.gpu = gpu
        self.dtype = dtype
        self.precision = precision_of(dtype)
        self.residency = residency
        self.rt = GpuContext(gpu) if rt is None else rt
        self.selection = selection
        pipelines = self.rt.pipeline_cache(gpu)
        self.ops = Ops(self.rt, pipelines, selection, dtype, scratch_scale=scratch_scale("unet", scratch_divisor))
        self.notes = list(notes)
        self.vae_dtype = vae_dtype or _vae_dtype(config, dtype, decodes_again=True)  # _decode decodes again
        on_gpu = None if residency == "staged" else states  # staged: nothing goes up yet
        self.weights = {
            c: GPUWeights(self.rt, on_gpu and on_gpu[c], d)
            for c, d in (("text_encoder", dtype), ("unet", dtype), ("vae", self.vae_dtype))
        }
        # staged: the host parameters of each stage, and how many callers hold them on the GPU
        self._stage_states = {
            part: {k: a for k, a in states[c].items() if wanted(k)} for part, (c, wanted) in STAGE_WEIGHTS.items()
        } if residency == "staged" else {}
        self._holds: Counter = Counter()
        self.upload_ms = 0.0  # staged: time spent uploading weights, since the last generate
        self.decode_notes: list[str] = []  # what decoding did beyond the plain decode, since the last generate
        self.text_encoder = CLIPTextEncoder(config.text_encoder, self.weights["text_encoder"], self.ops)
        self.unet_model = UNet2DCondition(config.unet, self.weights["unet"], self.ops)
        vae_ops = Ops(self.rt, self.ops.pipelines, selection, self.vae_dtype,
                      scratch_scale=scratch_scale("vae_decoder", scratch_divisor))
        self.vae = AutoencoderKL(config.vae, self.weights["vae"], vae_ops)

    @property
    def caps(self):
        """The adapter's capabilities (engine.device.DeviceCaps)."""
        return self.rt.caps

    executor = "native"

    @classmethod
    def shape_only(cls, config, caps, precision: str = "fp16", residency: str = "resident",
                   profile=None) -> Pipeline:
        """This pipeline on a TraceContext, with weights that are shapes alone: `generate` makes
        every allocation a real run makes, in the same order, and no GPU work (readbacks are
        zeros), so its peak_gpu_bytes is what a real run on an adapter with `caps` reports.
        Prompts become padding ids (every prompt has the same shapes)."""
        from .models import params

        dtype = storage_dtype(precision, caps.has_f16)
        dtypes = {"text_encoder": dtype, "unet": dtype, "vae": _vae_dtype(config, dtype, decodes_again=True)}
        shapes = {
            "text_encoder": params.clip_param_shapes(config.text_encoder),
            "unet": params.unet_param_shapes(config.unet),
            "vae": params.vae_param_shapes(config.vae),
        }
        states = {  # zero-stride views: any shape, no host memory
            c: {k: np.broadcast_to(np.zeros((), DTYPES[dtypes[c]]), s) for k, s in shapes[c].items()}
            for c in shapes
        }
        selection = _selection(caps, profile)
        return cls(config, _PaddingTokenizer(), states, None, dtype, selection, [], residency, TraceContext(caps))

    def set_profile(self, profile) -> None:
        """Switch kernel selection (a profile spec, as load_pipeline takes) without reloading."""
        self.selection = _selection(self.rt.caps, profile)
        self.ops.selection = self.selection
        self.vae.ops.selection = self.selection

    # ---- weight residency ----------------------------------------------------------------

    @contextmanager
    def weights_on_gpu(self, *stages: str):
        """Hold the weights of these stages (keys of STAGE_WEIGHTS) on the GPU inside the
        block. Resident pipelines always have them; staged ones upload them on the first hold
        and free them when the last hold ends."""
        if self.residency == "resident":
            yield
            return
        for s in stages:
            if self._holds[s] == 0:
                t0 = time.perf_counter()
                self.weights[STAGE_WEIGHTS[s][0]].load(self.rt, self._stage_states[s])
                self.rt.flush()
                self.upload_ms += (time.perf_counter() - t0) * 1e3
            self._holds[s] += 1
        try:
            yield
        finally:
            for s in stages:
                self._holds[s] -= 1
                if self._holds[s] == 0:
                    self.weights[STAGE_WEIGHTS[s][0]].release(self.rt, self._stage_states[s])

    @contextmanager
    def _stage(self, name: str, peaks: dict[str, int], *weights: str):
        """One generation stage: free buffers of the stage before are destroyed, the stage's
        weights held on the GPU, and its memory high-water mark recorded in peaks[name]."""
        self.rt.trim()
        with self.rt.watch_peak() as watch, self.weights_on_gpu(*weights):
            yield
        peaks[name] = watch.peak_bytes

    # ---- the networks, host arrays in and out --------------------------------------------

    def _ids_tensor(self, input_ids: np.ndarray):
        ids = np.asarray(input_ids)
        vocab = self.config.text_encoder.vocab_size
        if ids.ndim != 2 or ids.shape[1] > self.config.text_encoder.max_position_embeddings:
            raise InputError(f"input_ids must be (B, <= {self.config.text_encoder.max_position_embeddings}), got {ids.shape}")
        if ids.min() < 0 or ids.max() >= vocab:
            raise InputError(f"token ids must be in [0, {vocab}), got range [{ids.min()}, {ids.max()}]")
        return self.rt.upload(ids.astype(np.uint32), "u32")

    def encode_text(self, input_ids: np.ndarray) -> np.ndarray:
        """(B, 77) ids -> (B, 77, hidden) float32 last hidden state."""
        with self.weights_on_gpu("text_encoder"):
            return self.rt.read(self.text_encoder(self._ids_tensor(input_ids))).astype(np.float32)

    def _temb(self, timestep, batch: int):
        return self.rt.upload(self._temb_array(timestep, batch), self.dtype)

    def context_kv(self, ctx: Tensor) -> ContextKV:
        """The cross-attentions' keys and values of the context ctx (on the GPU), for every step
        of a denoising loop (the UNet's and the unet_context stage's weights on the GPU). A staged
        pipeline, the one kept within a memory budget, keeps nothing else for the loop: a profile's
        kept Winograd filters (PRETRANSFORM) are made at every step there."""
        kv = self.unet_model.context_kv(ctx)
        if self.residency == "staged":
            kv.prepared = None
        return kv

    def _unet(self, sample: np.ndarray, timestep, ctx):
        """One UNet evaluation; ctx the context on the GPU or its keys and values (context_kv),
        as a denoising loop passes them: projected once for every step."""
        x = self.rt.upload(np.asarray(sample, dtype=np.float32), self.dtype)
        eps = self.unet_model(x, self._temb(timestep, sample.shape[0]), ctx)
        return self.rt.read(eps).astype(np.float32)

    def unet(self, sample: np.ndarray, timestep, encoder_hidden_states: np.ndarray) -> np.ndarray:
        """(B, 4, h, w), scalar or (B,), (B, 77, hidden) -> (B, 4, h, w) noise prediction."""
        ctx = self.rt.upload(np.asarray(encoder_hidden_states, dtype=np.float32), self.dtype)
        with self.weights_on_gpu("unet", "unet_context"):
            return self._unet(np.asarray(sample, dtype=np.float32), timestep, ctx)

    def decode(self, latents: np.ndarray) -> np.ndarray:
        """(B, 4, h, w) latents -> (B, 3, 8h, 8w) float32, vae.decode(latents / scaling).sample."""
        latents = np.asarray(latents, dtype=np.float32)
        with self.weights_on_gpu("vae_decoder"):
            return self._decode(self.rt.upload(latents, "f32"))

    def _decode(self, latents) -> np.ndarray:
        """f32 latents on the GPU -> the decoded image, float32 on the host: the VAE's input is
        latents / scaling_factor in its element type (shaders/step prepare). A decoder in halves
        whose image comes back with an inf or NaN (an activation beyond f16's 65,504) decodes
        again in f32, on f32 copies of its weights, and says so in the generation's warnings."""
        z = self.vae.ops.step_prepare(latents, vae_input_scale(self.config), 1)
        image = self.rt.read(self.vae.decode(z)).astype(np.float32)
        del z
        if self.vae_dtype == "f32" or np.isfinite(image).all():
            return image
        self.decode_notes.append(overflow_note(self.vae_dtype))
        ops = self.vae.ops
        wanted = STAGE_WEIGHTS["vae_decoder"][1]
        weights = GPUWeights.of_tensors(
            {n: ops.to_f32(t) for n, t in self.weights["vae"].tensors.items() if wanted(n)}, "f32")
        return decode_in_f32(ops.twin("f32"), self.config, weights, latents)

    def encode_image(self, image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, 3, H, W) in [-1, 1] -> (mean, logvar) of the latent distribution, unscaled."""
        with self.weights_on_gpu("vae_encoder"):
            moments = self.rt.read(self.vae.encode(self.rt.upload(np.asarray(image, np.float32), self.vae_dtype)))
        mean, logvar = np.split(moments.astype(np.float32), 2, axis=1)
        return mean, np.clip(logvar, -30.0, 20.0)

    # ---- generation ----------------------------------------------------------------------

    def _generate(self, prompt, negative_prompt, steps, guidance_scale, seed, height, width, scheduler,
                  latents, progress, init_image, strength) -> GenerationResult:
        t_start = time.perf_counter()
        self.rt.trim()  # what earlier calls left in the pool is not this generation's
        self.upload_ms = 0.0
        self.decode_notes = []
        with self.rt.watch_peak() as total:
            result = self._run_stages(prompt, negative_prompt, steps, guidance_scale, seed, height, width,
                                      scheduler, latents, progress, init_image, strength)
        self.rt.trim()  # an idle pipeline holds its resident weights only
        result.peak_gpu_bytes = total.peak_bytes
        if self.residency == "staged":
            result.timings["weights_upload_ms"] = self.upload_ms
        result.timings["total_ms"] = (time.perf_counter() - t_start) * 1e3
        return result

    def _run_stages(self, prompt, negative_prompt, steps, guidance_scale, seed, height, width, scheduler,
                    latents, progress, init_image, strength) -> GenerationResult:
        timer = StageTimer(self.rt)
        peaks: dict[str, int] = {}
        rng = np.random.default_rng(seed)
        cfg_on = guidance_scale > 1.0
        shape = (1, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        scaling = np.float32(self.config.vae.scaling_factor)

        # 1. text conditioning: (uncond, cond) stacked when guidance is on
        with timer("text_encoder_ms"), self._stage("text_encoder", peaks, "text_encoder"):
            texts = [negative_prompt, prompt] if cfg_on else [prompt]
            ctx = self.text_encoder(self._ids_tensor(self.tokenize(texts)))  # (B, 77, D) on GPU
        # the cross-attentions' keys and values of the context, once for every step
        with timer("unet_context_ms"), self._stage("unet_context", peaks, "unet_context"):
            kv = self.context_kv(ctx)
            del ctx

        # 2. the loop as data (one program per scheduler, steps and strength) and its first sample
        program = loop_program(scheduler, self.config.scheduler, steps, shape,
                               strength=None if init_image is None else strength)
        if init_image is None:
            first = {"x0": first_sample(rng, latents, shape, program.init_noise_sigma, (height, width))}
        else:
            # on the GPU, as a plan does it: the encoder's moments, the posterior sample (draw n0)
            # times the scaling factor (i0), then the program's prologue adds the forward noise n1
            with timer("vae_encode_ms"), self._stage("vae_encode", peaks, "vae_encoder"):
                image = self.rt.upload(prepare_image(init_image, height, width), self.vae_dtype)
                moments = self.vae.encode(image)
                n0 = self.rt.upload(rng.standard_normal(shape, dtype=np.float32), "f32")
                first = {"i0": self.vae.ops.step_posterior(moments, n0, float(scaling))}
                del image, moments, n0
            first["n1"] = rng.standard_normal(shape, dtype=np.float32)

        # 3. denoising loop with classifier-free guidance, on the GPU: the program's
        # combinations step the f32 latents, which come back to the host once, at the end
        loop = _EagerLoop(self, program, float(guidance_scale) if cfg_on else None, kv, shape, rng, progress)
        with self._stage("unet", peaks, "unet"):
            env = {k: v if not isinstance(v, np.ndarray) else self.rt.upload(v, "f32") for k, v in first.items()}
            del first
            final = loop.run(env)
            latents = self.rt.read(final)
        step_ms = loop.step_ms
        del kv, loop  # their buffers go back to the pool, and are trimmed with the UNet's

        # 4. decode to an 8-bit image
        with timer("vae_decode_ms"), self._stage("vae_decode", peaks, "vae_decoder"):
            decoded = self._decode(final)
        del final
        image_u8 = image_from_decoded(decoded)

        timings = dict(timer.ms)
        timings["unet_total_ms"] = float(sum(step_ms))
        timings["unet_step_ms"] = float(np.median(step_ms)) if step_ms else 0.0
        return GenerationResult(
            image=image_u8,
            latents=latents,
            timings=timings,
            peak_gpu_bytes=0,  # _generate() fills in the whole generation's
            warnings=self.notes + self.selection.warnings + self.decode_notes
            + non_finite_warnings(latents, decoded, self.dtype, self.vae_dtype),
            stage_peak_gpu_bytes=peaks,
        )


class _EagerLoop(DenoisingLoop):
    """The denoising loop run eagerly: every value a fresh pool tensor, freed after the last
    step that reads it; the UNet called on the GPU; noise drawn from the generation's
    generator; each step timed to GPU completion."""

    def __init__(self, pipe: Pipeline, program, guidance_scale: float | None, kv: ContextKV, shape: tuple,
                 rng: np.random.Generator, progress: ProgressFn | None):
        super().__init__(pipe.ops, program, guidance_scale)
        self.pipe, self.kv, self.shape, self.rng, self.progress = pipe, kv, shape, rng, progress
        self.last_use = program.last_use()
        self.step_ms: list[float] = []
        self._t0 = 0.0

    def unet(self, sample, timestep: float):
        return self.pipe.unet_model(sample, self.pipe._temb(timestep, sample.shape[0]), self.kv)

    def draw(self, name: str):
        return self.pipe.rt.upload(self.rng.standard_normal(self.shape, dtype=np.float32), "f32")

    def begin_step(self, step) -> None:
        self._t0 = time.perf_counter()

    def end_step(self, step) -> None:
        i = step.index
        for name in [n for n in self.env if self.last_use.get(n, -1) <= i and n != f"x{i + 1}"]:
            del self.env[name]  # its buffer goes back to the pool
        self.pipe.rt.sync()
        self.step_ms.append((time.perf_counter() - self._t0) * 1e3)
        if self.progress is not None:
            self.progress(i + 1, len(self.program.steps))
