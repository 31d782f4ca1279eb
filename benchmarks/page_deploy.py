"""How long the farm's page (agent/web/farm.js) takes to deploy a build, in Debian's headless
Chromium on SwiftShader through the real hub: a first deploy (every chunk fetched, checked and
stored), an unchanged re-deploy (each held chunk trusted by its size and the digest it was
stored with) and a re-deploy with `verify` (each held chunk read and hashed again, as every
re-deploy did before). The model is SD 1.4's layer sizes with random fp16 weights (2.1 GB) unless
--model names another folder.

    .venv/bin/python benchmarks/page_deploy.py [--model DIR] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.bundle import generate_keypair, load_public_key, provision_public_key  # noqa: E402
from agent.hubpage import HubPage  # noqa: E402
from agent.packing import build_bundle
from engine.browser import chromium_command, find_chromium  # noqa: E402
from engine.kernels import SHADER_ROOT  # noqa: E402
from orchestrator.transports.hub import BrowserHub  # noqa: E402
from orchestrator.transports.local import LocalTransport  # noqa: E402

TOKEN = "t0k3n-of-the-deploy-benchmark"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a model folder (default: make SD 1.4's shapes, fp16)")
    parser.add_argument("--repeats", type=int, default=3, help="re-deploys of each kind (medians are quoted)")
    parser.add_argument("--json", type=Path, help="write the timings here")
    args = parser.parse_args()
    chromium = find_chromium()
    if not chromium:
        print("no chromium: bash scripts/ensure-chromium.sh installs it", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="page-deploy-"))
    try:
        model = args.model
        if model is None:
            from engine.make_model import make_model

            model = make_model("sd14", 0, tmp / "sd14", dtype="fp16")
        generate_keypair(tmp / "farm.key", tmp / "farm.pub")
        manifest = build_bundle({"models/m": model, "shaders": SHADER_ROOT}, tmp / "bundle", "b1", "0.1.0",
                                tmp / "farm.key")
        root = tmp / "root"
        provision_public_key(root, tmp / "farm.pub")
        LocalTransport(root).send_bundle(tmp / "bundle")
        files = [f.path for f in manifest.files if f.path.startswith("shaders/") or f.path.endswith(".safetensors")]
        deploy = {"build": "b1", "files": files,
                  "manifest_b64": base64.b64encode(manifest.canonical_bytes()).decode(),
                  "signature_b64": base64.b64encode((tmp / "bundle" / "manifest.sig").read_bytes()).decode()}
        shutil.rmtree(tmp / "bundle")
        hub = BrowserHub()
        hub.register("d1", TOKEN, root / "store")
        raw = load_public_key(tmp / "farm.pub").public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw)
        key = base64.urlsafe_b64encode(raw).decode().rstrip("=")
        url = f"{hub.local_url}/web/index.html#device=d1&token={TOKEN}&key={key}"
        with open(tmp / "chromium.log", "wb") as log:
            proc = subprocess.Popen(chromium_command(chromium, tmp / "profile", url, "swiftshader"), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            hub.wait_online("d1", 60.0)
            page = HubPage(hub.control_url("d1"))
            rows = []

            def timed(kind: str, **extra) -> None:
                start = time.perf_counter()
                report = page.call("deploy", timeout_s=3600, **deploy, **extra)
                rows.append({"kind": kind, "seconds": time.perf_counter() - start,
                             "fetched_bytes": report["fetched_bytes"], "fetched_chunks": report["fetched_chunks"]})
                print(f"  {kind}: {rows[-1]['seconds']:.1f} s, fetched {report['fetched_bytes']:,} bytes",
                      file=sys.stderr)

            timed("first deploy")
            for _ in range(args.repeats):
                timed("re-deploy")
            for _ in range(args.repeats):
                timed("re-deploy, verify")
        finally:
            proc.kill()
            proc.wait()
            hub.close()
        size = sum({f.sha256: f.size for f in manifest.files if f.path in files}.values())
        print(f"\nfarm page deploy of {size:,} bytes in {manifest.chunk_size >> 20} MiB chunks "
              f"(Chromium on SwiftShader)\n")
        print(f"| {'deploy':<18} | {'median s':>9} | {'runs':>4} | {'fetched bytes':>15} |")
        print(f"|{'-' * 20}|{'-' * 11}|{'-' * 6}|{'-' * 17}|")
        summary = {}
        for kind in ("first deploy", "re-deploy", "re-deploy, verify"):
            runs = [r for r in rows if r["kind"] == kind]
            median = statistics.median(r["seconds"] for r in runs)
            summary[kind] = {"median_s": median, "runs_s": [r["seconds"] for r in runs],
                             "fetched_bytes": runs[-1]["fetched_bytes"]}
            print(f"| {kind:<18} | {median:>9.2f} | {len(runs):>4} | {runs[-1]['fetched_bytes']:>15,} |")
        ratio = summary["re-deploy, verify"]["median_s"] / summary["re-deploy"]["median_s"]
        print(f"\nre-deploy with verify / without: {ratio:.1f}x")
        if args.json:
            args.json.write_text(json.dumps({"bytes": size, "chunk_size": manifest.chunk_size, "chromium": chromium,
                                             "deploys": summary}, indent=2))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
