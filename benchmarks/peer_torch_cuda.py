"""Time the CUDA peer, PyTorch running diffusers' own modules, on the work the engine's
benchmark times: one classifier-free-guidance UNet step (batch 2) and the VAE decode of one
latent, of the same model folder, in fp32 (TF32 off: no tensor cores, the SIMT arithmetic the
engine is limited to) and in fp16 (tensor cores).

Inputs are random and already on the GPU; each timed run ends with torch.cuda.synchronize().
Medians of --reps after --warmup; the spread is (min, max). Prints a table, writes JSON.

    python benchmarks/peer_torch_cuda.py --model /tmp/sd14 --reps 10 --json torch.json

torch and CUDA are the GPU machine's; diffusers is not a project dependency (carry its wheel:
../shared/tools/prepare-gpu-carry.sh diffusers==0.42.1).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path


def _median(samples: list[float]) -> dict:
    return {"median": round(statistics.median(samples), 3), "min": round(min(samples), 3),
            "max": round(max(samples), 3), "n": len(samples)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a diffusers model folder (engine.make_model writes one)")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        import torch
        from diffusers import AutoencoderKL, UNet2DConditionModel
    except ImportError as exc:
        print(f"needs torch with CUDA and diffusers: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    lat = args.resolution // 8

    def timed(fn) -> dict:
        with torch.inference_mode():
            for _ in range(args.warmup):
                fn()
            torch.cuda.synchronize()
            samples = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                samples.append((time.perf_counter() - t0) * 1e3)
        return _median(samples)

    rows = []
    for precision, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        unet = UNet2DConditionModel.from_pretrained(args.model / "unet", torch_dtype=dtype).to(dev).eval()
        cross = unet.config.cross_attention_dim
        sample = torch.randn(2, unet.config.in_channels, lat, lat, device=dev, dtype=dtype)
        ctx = torch.randn(2, 77, cross, device=dev, dtype=dtype)
        t = torch.tensor([981, 981], device=dev)
        unet_ms = timed(lambda u=unet, s=sample, c=ctx, tt=t: u(s, tt, encoder_hidden_states=c).sample)
        del unet
        vae = AutoencoderKL.from_pretrained(args.model / "vae", torch_dtype=dtype).to(dev).eval()
        z = torch.randn(1, vae.config.latent_channels, lat, lat, device=dev, dtype=dtype)
        vae_ms = timed(lambda v=vae, zz=z: v.decode(zz).sample)
        del vae
        torch.cuda.empty_cache()
        rows.append({"system": f"PyTorch {torch.__version__} CUDA {precision}" +
                     (" (TF32 off)" if precision == "fp32" else " (tensor cores)"),
                     "precision": precision, "unet_step_ms": unet_ms, "vae_decode_ms": vae_ms})
        print(f"{rows[-1]['system']:45s} UNet CFG step {unet_ms['median']:7.1f} ms ({unet_ms['min']:.1f}-"
              f"{unet_ms['max']:.1f})   VAE decode {vae_ms['median']:7.1f} ms")
    if args.json:
        args.json.write_text(json.dumps({"date": dt.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
                                         "resolution": args.resolution, "reps": args.reps, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
