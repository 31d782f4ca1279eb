"""Time the peer, ONNX Runtime's WebGPU execution provider, on one classifier-free-guidance
UNet step (batch 2) of a model, and optionally our engine on the same model and inputs.

The UNet is loaded with diffusers (UNet2DConditionModel.from_pretrained(model/unet)), exported
to ONNX once per (precision, resolution, opset, exporter) into --work (external data: SD 1.4's
fp32 UNet is 3.4 GB), and run by an InferenceSession on WebGpuExecutionProvider. Inputs are
fresh random numpy arrays for every run: sample (2, 4, h, w), timestep (2,) and
encoder_hidden_states (2, 77, cross); outputs come back to the host, as in our engine's
`pipe.unet`. Medians of the measured repetitions after warm-up; the spread is (min, max).

With --check, the ONNX model's output is compared with the diffusers UNet run by torch in fp32
on the CPU (is the export right?), and with --ours also with our engine's output.

    python benchmarks/peer_ort_webgpu.py --preset tiny --check --ours
    python benchmarks/peer_ort_webgpu.py --model /tmp/sd14 --precision fp16 --work /tmp/onnx \\
        --reps 10 --ours --json ort_fp16.json

diffusers and onnxruntime-webgpu are not project dependencies: install them into a folder of
their own and put it first on PYTHONPATH (or pass --site DIR), because an `onnxruntime` (CPU)
installed in site-packages has the same module name and has no WebGPU provider.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model_args import add_model_arguments, model_folder  # noqa: E402

CARRY_HINT = "carry diffusers==0.42.1 onnxruntime-webgpu==1.27.0 wheels, see docs/benchmarks.md"
PROVIDERS = {"webgpu": "WebGpuExecutionProvider", "cpu": "CPUExecutionProvider"}
TIMESTEP = 981.0  # the first PNDM timestep of a 50-step SD run; what engine_unet_step.py uses
TEXT_TOKENS = 77


class PeerError(SystemExit):
    """A missing package or a wrong setting: the message names the value and the fix."""

    def __init__(self, msg: str):
        super().__init__(f"peer_ort_webgpu: {msg}")


# ---------------------------------------------------------------------------------------------
# the imports that must come from the carried wheels


def import_onnxruntime(provider: str, site: Path | None):
    """onnxruntime with `provider` available; the carried onnxruntime-webgpu must shadow the
    CPU-only onnxruntime that shares its module name, so it is imported before anything else
    can import the other one."""
    if site is not None:
        sys.path.insert(0, str(site))
    if "onnxruntime" in sys.modules and site is not None:
        raise PeerError("onnxruntime was imported before --site could take effect")
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise PeerError(f"cannot import onnxruntime ({e}); {CARRY_HINT}") from None
    available = ort.get_available_providers()
    if PROVIDERS[provider] not in available:
        raise PeerError(
            f"onnxruntime {ort.__version__} imported from {Path(ort.__file__).parent} offers "
            f"{available}, not {PROVIDERS[provider]}: that is the CPU build. Install "
            f"onnxruntime-webgpu into a --target folder and put it first on PYTHONPATH "
            f"(or pass --site DIR); {CARRY_HINT}"
        )
    return ort


def import_diffusers():
    try:
        import diffusers
        from diffusers import UNet2DConditionModel
    except ImportError as e:
        raise PeerError(f"cannot import diffusers ({e}); {CARRY_HINT}") from None
    return diffusers, UNet2DConditionModel


# ---------------------------------------------------------------------------------------------
# export


def make_step_module(unet):
    """The UNet as a module of three tensors in, the noise prediction out (what ONNX needs)."""
    import torch

    class UNetStep(torch.nn.Module):
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, sample, timestep, encoder_hidden_states):
            return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

    return UNetStep(unet).eval()


def export_onnx(step, inputs: dict[str, np.ndarray], path: Path, opset: int, exporter: str,
                device: str, dtype) -> float:
    """Export `step` with fixed shapes to `path` (weights as external data beside it);
    returns the seconds it took."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    step = step.to(device=device) if dtype == torch.float32 else step.to(device=device, dtype=dtype)
    # the timestep stays f32 (diffusers computes its embedding in f32 and casts after)
    args = tuple(
        torch.from_numpy(a).to(device=device, dtype=None if k == "timestep" else dtype)
        for k, a in inputs.items()
    )
    names = dict(input_names=list(inputs), output_names=["noise_pred"], opset_version=opset)
    t0 = time.perf_counter()
    with torch.no_grad():
        if exporter == "dynamo":
            torch.onnx.export(step, args, str(path), dynamo=True, external_data=True, **names)
        else:
            # The TorchScript exporter writes tensors as external files by itself past 2 GB.
            torch.onnx.export(step, args, str(path), dynamo=False, do_constant_folding=True, **names)
    return time.perf_counter() - t0


def fuse_onnx(src: Path, dst: Path, fp16: bool, off: list[str]) -> dict[str, int]:
    """Apply ONNX Runtime's own Stable Diffusion UNet fusions (onnxruntime.transformers:
    MultiHeadAttention, GroupNorm, BiasSplitGelu, ...) to an fp32 export, then convert to fp16
    if asked, the way its optimize_pipeline prepares a UNet (the fusions match fp32 graphs
    only); returns the op counts of the result. Needs the `onnx` package."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    opts = FusionOptions("unet")
    opts.enable_nhwc_conv = False  # NhwcConv is a CUDA-only contrib op
    opts.enable_packed_qkv = opts.enable_packed_kv = fp16 and opts.enable_packed_qkv
    for name in off:
        if not hasattr(opts, f"enable_{name}"):
            choices = sorted(k[7:] for k in vars(opts) if k.startswith("enable_"))
            raise PeerError(f"--fuse-off {name!r} is not a fusion; choose from {', '.join(choices)}")
        setattr(opts, f"enable_{name}", False)
    model = optimize_model(str(src), model_type="unet", optimization_options=opts, opt_level=0)
    if fp16:
        model.convert_float_to_float16(keep_io_types=False)
    dst.parent.mkdir(parents=True, exist_ok=True)
    model.save_model_to_file(str(dst), use_external_data_format=True, all_tensors_to_one_file=True)
    counts: dict[str, int] = {}
    for node in model.model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def default_exporter() -> str:
    try:
        import onnxscript  # noqa: F401  (the dynamo exporter's dependency)

        return "dynamo"
    except ImportError:
        return "legacy"


# ---------------------------------------------------------------------------------------------
# the ONNX Runtime session


def open_session(ort, path: Path, provider: str, ep_options: dict[str, str], log_level: int,
                 profile_prefix: Path):
    so = ort.SessionOptions()
    so.log_severity_level = log_level
    so.enable_profiling = True  # for the first run only: which provider ran each node
    so.profile_file_prefix = str(profile_prefix)
    name = PROVIDERS[provider]
    t0 = time.perf_counter()
    try:
        sess = ort.InferenceSession(str(path), sess_options=so, providers=[(name, ep_options)])
    except Exception as e:
        raise PeerError(f"{name} could not open {path}: {e}") from None
    session_s = time.perf_counter() - t0
    if sess.get_providers()[0] != name:
        raise PeerError(f"session runs on {sess.get_providers()}, not {name}")
    return sess, session_s


def nodes_by_provider(profile_file: str) -> dict[str, int]:
    """Count the kernels of one profiled run by the execution provider that ran them."""
    events = json.loads(Path(profile_file).read_text())
    counts: dict[str, int] = {}
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            p = ev.get("args", {}).get("provider", "?")
            counts[p] = counts.get(p, 0) + 1
    Path(profile_file).unlink(missing_ok=True)
    return counts


def feeds_for(sess, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Cast each input to the type the exported graph declares (fp16 models take fp16)."""
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
             "tensor(int64)": np.int64, "tensor(double)": np.float64}
    return {i.name: inputs[i.name].astype(types[i.type]) for i in sess.get_inputs()}


# ---------------------------------------------------------------------------------------------
# measuring


def random_inputs(rng, n: int, latent_channels: int, h: int, w: int, cross: int) -> list[dict]:
    return [
        {
            "sample": rng.standard_normal((2, latent_channels, h, w), dtype=np.float32),  # (B, C, h, w)
            "timestep": np.full((2,), TIMESTEP, np.float32),  # (B,)
            "encoder_hidden_states": rng.standard_normal((2, TEXT_TOKENS, cross), dtype=np.float32),
        }
        for _ in range(n)
    ]


def timed(fn, sets: list, warmup: int) -> list[float]:
    """Run fn on sets[:warmup] untimed, then time one call per remaining set (fn returns host
    arrays, so each call ends when the GPU is done)."""
    for x in sets[:warmup]:
        fn(x)
    out = []
    for x in sets[warmup:]:
        t0 = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def rel_err(a: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    return {
        "rel_l2": float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30)),
        "max_abs": float(np.abs(a - ref).max()),
        "ref_rms": float(np.sqrt(np.mean(ref**2))),
        "finite": bool(np.isfinite(a).all()),
    }


def stats(ms: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(ms), 3), "min": round(min(ms), 3),
            "max": round(max(ms), 3), "n": len(ms)}


def wgpu_adapter() -> dict | None:
    """The GPU as wgpu-native sees it (ORT's Dawn does not report its adapter to Python)."""
    try:
        import wgpu

        info = wgpu.gpu.request_adapter_sync(power_preference="high-performance").info
        return {k: str(info.get(k, "")) for k in ("device", "description", "backend_type", "adapter_type")}
    except Exception as e:  # informational only
        return {"error": str(e)}


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--opset", type=int, default=18)
    ap.add_argument("--exporter", choices=["dynamo", "legacy"], default=None,
                    help="torch.onnx exporter (default: dynamo where onnxscript is installed)")
    ap.add_argument("--export-device", default=None,
                    help="torch device that traces the export (default: cuda if available; fp16 on CPU is slow)")
    ap.add_argument("--fuse", action="store_true",
                    help="apply ONNX Runtime's SD UNet fusions (onnxruntime.transformers) to the export")
    ap.add_argument("--fuse-off", default="", metavar="NAME,...",
                    help="with --fuse, fusions to leave out (FusionOptions enable_NAME), e.g. group_norm")
    ap.add_argument("--classic-attention", action="store_true",
                    help="export diffusers' AttnProcessor (bmm, softmax) instead of scaled_dot_product_attention")
    ap.add_argument("--work", type=Path, default=None,
                    help="where the ONNX export goes (default: a temporary folder); reused if it matches")
    ap.add_argument("--provider", choices=list(PROVIDERS), default="webgpu",
                    help="cpu: ONNX Runtime's CPU provider, for testing this script without a GPU")
    ap.add_argument("--ep-option", action="append", default=[], metavar="KEY=VALUE",
                    help="execution provider option, repeatable")
    ap.add_argument("--site", type=Path, default=None,
                    help="folder holding onnxruntime-webgpu and diffusers, put first on sys.path")
    ap.add_argument("--ort-log", type=int, default=3, help="ORT log severity (0 verbose .. 4 fatal)")
    ap.add_argument("--ours", action="store_true", help="also time our engine on the same inputs")
    ap.add_argument("--profile", default=None, help="our engine's kernel profile (default: auto)")
    ap.add_argument("--check", action="store_true",
                    help="compare ORT with torch fp32 on the CPU (and with ours, with --ours)")
    args = ap.parse_args(argv)
    ep_options = dict(kv.split("=", 1) for kv in args.ep_option)

    # 1. imports: onnxruntime first, so the carried WebGPU build is the one loaded
    ort = import_onnxruntime(args.provider, args.site)
    diffusers, UNet2DConditionModel = import_diffusers()
    import torch

    # 2. the model
    tmp = tempfile.TemporaryDirectory()
    model = model_folder(args, Path(tmp.name))
    if not (model / "unet" / "config.json").is_file():
        raise PeerError(f"{model}: no unet/config.json; expected a diffusers-layout model folder")
    t0 = time.perf_counter()
    unet = UNet2DConditionModel.from_pretrained(model / "unet", torch_dtype=torch.float32).eval()
    print(f"loaded the diffusers UNet in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.classic_attention:
        from diffusers.models.attention_processor import AttnProcessor

        unet.set_attn_processor(AttnProcessor())
    cfg = unet.config
    vae_scale = 2 ** (len(json.loads((model / "vae" / "config.json").read_text())["block_out_channels"]) - 1)
    res = args.resolution or cfg.sample_size * vae_scale
    if res % (vae_scale * 2 ** (len(cfg.block_out_channels) - 1)):
        raise PeerError(f"--resolution {res} must be a multiple of {vae_scale * 2 ** (len(cfg.block_out_channels) - 1)}")
    h = w = res // vae_scale
    rng = np.random.default_rng(0)
    n_sets = args.warmup + args.reps
    sets = random_inputs(rng, n_sets + 1, cfg.in_channels, h, w, cfg.cross_attention_dim)
    check_set, sets = sets[0], sets[1:]

    # 3. export (or reuse an export made with the same settings)
    exporter = args.exporter or default_exporter()
    export_device = args.export_device or ("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work or Path(tmp.name) / "onnx"
    # fused fp16 models are converted after fusing, from an fp32 export
    export_precision = "fp32" if args.fuse else args.precision
    key = {"model": str(model.resolve()), "precision": export_precision, "latent": [h, w],
           "opset": args.opset, "exporter": exporter, "torch": torch.__version__,
           "classic_attention": args.classic_attention}
    attn = "_classic" if args.classic_attention else ""
    onnx_dir = work / f"unet_{export_precision}_{h}x{w}_op{args.opset}_{exporter}{attn}"
    onnx_path = onnx_dir / "unet.onnx"
    stamp = onnx_dir / "export.json"
    export_s = None
    if onnx_path.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        print(f"reusing {onnx_path}", flush=True)
    else:
        dtype = torch.float16 if export_precision == "fp16" else torch.float32
        step = make_step_module(unet if export_precision == "fp32" or not args.check else _copy(unet))
        export_s = export_onnx(step, check_set, onnx_path, args.opset, exporter, export_device, dtype)
        stamp.write_text(json.dumps(key))
        if step.unet is unet and export_device != "cpu":  # the reference runs on the CPU
            unet.to(device="cpu")
        del step
        print(f"exported ({exporter}, opset {args.opset}, {export_device}) in {export_s:.1f} s", flush=True)
    fused_ops = None
    if args.fuse:
        off = [n for n in args.fuse_off.split(",") if n]
        fused_path = onnx_dir / f"fused_{args.precision}_{'-'.join(off) or 'all'}" / "unet.onnx"
        t0 = time.perf_counter()
        fused_ops = fuse_onnx(onnx_path, fused_path, args.precision == "fp16", off)
        print(f"fused in {time.perf_counter() - t0:.1f} s: {fused_ops}", flush=True)
        onnx_path = fused_path
    onnx_bytes = sum(f.stat().st_size for f in onnx_path.parent.iterdir() if f.is_file())

    # 4. the peer
    sess, session_s = open_session(ort, onnx_path, args.provider, ep_options, args.ort_log,
                                     Path(tmp.name) / "ort_profile")
    print(f"ORT {ort.__version__} session on {sess.get_providers()} in {session_s:.1f} s", flush=True)
    ort_check = sess.run(None, feeds_for(sess, check_set))[0].astype(np.float32)
    placement = nodes_by_provider(sess.end_profiling())
    print(f"kernels by provider (one run): {placement}", flush=True)
    feeds = [feeds_for(sess, x) for x in sets]  # cast outside the timed region
    rows = {"ort": timed(lambda f: sess.run(None, f), feeds, args.warmup)}
    print(f"ORT {args.provider} UNet step: {statistics.median(rows['ort']):.1f} ms", flush=True)
    ort_info = {
        "version": ort.__version__,
        "module": str(Path(ort.__file__).parent),
        "available_providers": ort.get_available_providers(),
        "session_providers": sess.get_providers(),
        "provider_options": sess.get_provider_options(),
        "kernels_by_provider": placement,
        "exporter": exporter,
        "export_device": export_device,
        "opset": args.opset,
        "classic_attention": args.classic_attention,
        "export_s": export_s and round(export_s, 2),
        "session_s": round(session_s, 2),
        "onnx_bytes": onnx_bytes,
        "fused_ops": fused_ops,
    }
    sess = None  # let ORT free its GPU memory before our engine loads

    # 5. the checks and our engine
    checks = {}
    if args.check:
        with torch.no_grad():
            ref = make_step_module(unet)(*(torch.from_numpy(a) for a in check_set.values())).numpy()
        checks["ort_vs_torch_cpu_fp32"] = rel_err(ort_check, ref)
    ours_info = None
    if args.ours:
        from engine import load_pipeline

        t0 = time.perf_counter()
        pipe = load_pipeline(model, precision=args.precision, profile=args.profile)
        caps = pipe.gpu.caps
        ours_info = {"profile": args.profile or "auto", "adapter": caps.device, "backend": caps.backend, "driver": caps.description,
                     "precision": pipe.precision, "load_s": round(time.perf_counter() - t0, 2)}
        run = lambda x: pipe.unet(x["sample"], TIMESTEP, x["encoder_hidden_states"])  # noqa: E731
        ours_check = run(check_set)
        rows["ours"] = timed(run, sets, args.warmup)
        print(f"our engine UNet step: {statistics.median(rows['ours']):.1f} ms", flush=True)
        checks["ort_vs_ours"] = rel_err(ort_check, ours_check)
        if args.check:
            checks["ours_vs_torch_cpu_fp32"] = rel_err(ours_check, ref)

    # 6. report
    peers = {"ort": f"ONNX Runtime {ort.__version__} {PROVIDERS[args.provider]}", "ours": "devicefarm engine (wgpu)"}
    result = {
        "date": dt.date.today().isoformat(),
        "model": args.preset or str(model),
        "precision": args.precision,
        "resolution": res,
        "latent": [h, w],
        "batch": 2,
        "timestep": TIMESTEP,
        "versions": {"onnxruntime": ort.__version__, "diffusers": diffusers.__version__,
                     "torch": torch.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "gpu_seen_by_wgpu": wgpu_adapter(),
        "ort": ort_info,
        "ours": ours_info,
        "metrics": {f"{p}_unet_step_ms": stats(v) for p, v in rows.items()},
        "checks": checks,
    }
    print(f"\n{result['model']}, {args.precision}, {res}x{res} (latents {h}x{w}), batch 2")
    print(f"{'peer':<52}{'precision':>10}{'median ms':>12}{'min-max':>18}{'n':>5}")
    for p, v in rows.items():
        m = stats(v)
        print(f"{peers[p]:<52}{args.precision:>10}{m['median']:>12.1f}{m['min']:>9.1f}-{m['max']:<8.1f}{m['n']:>5}")
    for name, c in checks.items():
        print(f"{name}: rel L2 {c['rel_l2']:.2e}, max abs {c['max_abs']:.2e} (ref rms {c['ref_rms']:.2f})"
              + ("" if c["finite"] else ", NOT FINITE"))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    tmp.cleanup()
    return 0


def _copy(unet):
    """A copy to cast to fp16, so the fp32 CPU reference stays as loaded."""
    import copy

    return copy.deepcopy(unet)


if __name__ == "__main__":
    raise SystemExit(main())
