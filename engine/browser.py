"""The browser runtime: engine plans run by the WebGPU page in agent/web/ (plan.js), in a
Chromium this module starts headless, in a browser reached over the DevTools protocol, or in any
browser a person points at the URL it prints. `load_pipeline(model, runtime="browser")` returns
the Pipeline API over it; host arrays go in and come back as numpy arrays.

The host side is a small HTTP server on 127.0.0.1 (WebGPU needs a secure context; localhost is
one) serving the page, the shaders, the plans and the model's files with byte ranges, and a
command queue the page polls: GET /api/next gives the page its next command, POST /api/done
takes the answer. A page that stops answering ends the call with a BrowserError; it never hangs.
The server counts the weight bytes it serves, so a test can see the page's cache at work.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from .errors import EngineError, GPUError
from .kernels import SHADER_ROOT
from .runtime import DTYPES

WEB_ROOT = Path(__file__).resolve().parent.parent / "agent" / "web"
POLL_S = 20.0  # how long the page's GET /api/next waits for a command
# JavaScript limit names -> engine.device's (wgpu-py) names
LIMIT_NAMES = {"maxStorageBufferBindingSize": "max-storage-buffer-binding-size", "maxBufferSize": "max-buffer-size",
               "maxComputeWorkgroupsPerDimension": "max-compute-workgroups-per-dimension",
               "maxStorageBuffersPerShaderStage": "max-storage-buffers-per-shader-stage",
               "maxComputeWorkgroupStorageSize": "max-compute-workgroup-storage-size",
               "maxComputeInvocationsPerWorkgroup": "max-compute-invocations-per-workgroup",
               "maxComputeWorkgroupSizeX": "max-compute-workgroup-size-x",
               "maxComputeWorkgroupSizeY": "max-compute-workgroup-size-y"}
BROWSER_FEATURES = {"subgroups": "subgroup"}  # the browser's feature names that engine.device spells otherwise
CONTENT_TYPES = {".js": "text/javascript", ".html": "text/html; charset=utf-8", ".wgsl": "text/plain; charset=utf-8",
                 ".json": "application/json"}


class BrowserError(GPUError):
    """What the page reported (`kind`: no-webgpu, missing-feature, limit, schema, plan-hash,
    shader-compile, pipeline, weight-fetch, hash-mismatch, out-of-memory, validation,
    device-lost, input, internal), or that it stopped answering (`kind` "timeout")."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"browser: {kind}: {message}")
        self.kind = kind


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


# ---- the host server --------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.commands: queue.Queue = queue.Queue()
        self.replies: dict[int, queue.Queue] = {}
        self.plans: dict[str, bytes] = {}  # served plan file name -> bytes
        self.models: dict[str, Path] = {}  # token -> model folder
        self.weight_bytes_served = 0
        self.requests: list[str] = []
        self.console: list[dict[str, Any]] = []
        self.session = base64.urlsafe_b64encode(os.urandom(12)).decode()
        self.polled = threading.Event()  # the page asked for a command at least once
        self.closed = False
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # the test and CLI output stay clean
        pass

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/octet-stream", headers=None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _file(self, root: Path, rel: str, count_bytes: bool = False):
        root = root.resolve()
        path = (root / urllib.parse.unquote(rel)).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            return self._send(404, b"not found", "text/plain")
        size = path.stat().st_size
        start, end = 0, size - 1
        rng = self.headers.get("Range")
        status, headers = 200, {"Accept-Ranges": "bytes"}
        if rng:
            try:
                unit, spec = rng.split("=", 1)
                a, b = spec.split("-", 1)
                start, end = int(a), min(int(b) if b else size - 1, size - 1)
                if unit.strip() != "bytes" or start > end or start >= size:
                    raise ValueError
            except ValueError:
                return self._send(416, b"bad range", "text/plain", {"Content-Range": f"bytes */{size}"})
            status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        if count_bytes:
            with self.server.lock:
                self.server.weight_bytes_served += len(body)
        self._send(status, body, CONTENT_TYPES.get(path.suffix, "application/octet-stream"), headers)

    def do_GET(self):  # noqa: N802  (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        path = url.path
        self.server.requests.append(path)
        if path in ("/", "/index.html"):
            return self._file(WEB_ROOT, "index.html")
        if path.startswith("/web/"):
            return self._file(WEB_ROOT, path[len("/web/"):])
        if path.startswith("/shaders/"):
            return self._file(SHADER_ROOT, path[len("/shaders/"):])
        if path.startswith("/plans/"):
            body = self.server.plans.get(path[len("/plans/"):])
            return self._send(200, body, "application/json") if body is not None else self._send(404)
        if path.startswith("/model/"):
            token, _, rel = path[len("/model/"):].partition("/")
            root = self.server.models.get(token)
            return self._file(root, rel, count_bytes=True) if root else self._send(404)
        if path == "/api/next":
            if urllib.parse.parse_qs(url.query).get("session", [""])[0] != self.server.session:
                return self._send(410, b"not this session", "text/plain")
            self.server.polled.set()
            if self.server.closed:
                return self._send(410, b"closed", "text/plain")
            try:
                command = self.server.commands.get(timeout=POLL_S)
            except queue.Empty:
                return self._send(204)
            return self._send(200, json.dumps(command).encode(), "application/json")
        return self._send(404, b"not found", "text/plain")

    def do_HEAD(self):  # noqa: N802
        return self.do_GET()

    def do_POST(self):  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if url.path == "/api/done":
            reply = json.loads(body)
            box = self.server.replies.get(reply.get("id"))
            if box is not None:
                box.put(reply)
            return self._send(204)
        if url.path == "/api/log":
            try:
                self.server.console.append(json.loads(body))
            except ValueError:
                self.server.console.append({"level": "error", "message": body[:500].decode("utf-8", "replace")})
            return self._send(204)
        return self._send(404)


# ---- a browser session ------------------------------------------------------------------------


class BrowserSession:
    """The server, the page and (unless `browser_url`/`cdp` say otherwise) the Chromium it
    runs in. `call(op, ...)` sends the page one command and returns its answer."""

    def __init__(self, *, chromium: str | None = None, cdp: str | None = None, manual: bool = False,
                 webgpu_adapter: str | None = "auto", start_timeout_s: float = 60.0, announce=None):
        self.server = _Server()
        self._thread = threading.Thread(target=self.server.serve_forever, name="browser-runtime", daemon=True)
        self._thread.start()
        self._ids = itertools.count(1)
        self.process: subprocess.Popen | None = None
        self._profile_dir: str | None = None
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/web/index.html?session={self.server.session}"
        try:
            if cdp:
                _open_tab(cdp, self.url)
            elif manual:
                (announce or print)(f"open {self.url} in a browser with WebGPU on this machine")
            else:
                self._launch(chromium, webgpu_adapter)
            if not self.server.polled.wait(start_timeout_s):
                raise BrowserError("timeout", f"the page did not reach the host within {start_timeout_s:.0f} s"
                                   + self._exit_note())
            self.hello = self.call("hello", timeout_s=start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _launch(self, chromium: str | None, webgpu_adapter: str | None) -> None:
        chromium = chromium or os.environ.get("FARM_CHROMIUM") or find_chromium()
        if not chromium:
            raise BrowserError("no-browser", "no Chromium found (apt-get install chromium, or set FARM_CHROMIUM)")
        if webgpu_adapter == "auto":
            webgpu_adapter = os.environ.get("FARM_BROWSER_WEBGPU_ADAPTER") or _default_adapter()
        self._profile_dir = tempfile.mkdtemp(prefix="farm-chromium-")
        args = [chromium, "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--no-first-run",
                "--no-default-browser-check", "--disable-dev-shm-usage", f"--user-data-dir={self._profile_dir}",
                "--enable-features=Vulkan"]
        if webgpu_adapter:
            args.append(f"--use-webgpu-adapter={webgpu_adapter}")
        self._log = open(Path(self._profile_dir) / "chromium.log", "wb")  # noqa: SIM115  (closed in close())
        self.process = subprocess.Popen([*args, self.url], stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)

    def _exit_note(self) -> str:
        if self.process is not None and self.process.poll() is not None:
            tail = (Path(self._profile_dir) / "chromium.log").read_bytes()[-1500:].decode("utf-8", "replace")
            return f"; Chromium exited with {self.process.returncode}: {tail}"
        return ""

    @property
    def adapter(self) -> dict[str, Any]:
        return self.hello["adapter"]

    @property
    def weight_bytes_served(self) -> int:
        return self.server.weight_bytes_served

    def call(self, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        command_id = next(self._ids)
        box: queue.Queue = queue.Queue()
        self.server.replies[command_id] = box
        self.server.commands.put({"id": command_id, "op": op, **fields})
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    reply = box.get(timeout=0.5)
                    break
                except queue.Empty:
                    if self.process is not None and self.process.poll() is not None:
                        raise BrowserError("browser-exited", f"{op}: the browser exited" + self._exit_note()) from None
                    if time.monotonic() > deadline:
                        raise BrowserError("timeout", f"{op}: the page did not answer within {timeout_s:.0f} s") \
                            from None
        finally:
            self.server.replies.pop(command_id, None)
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise BrowserError(err.get("kind", "internal"), err.get("message", "no message"))
        return reply["result"]

    def serve_plan(self, plan: dict[str, Any]) -> tuple[str, str]:
        """Put a plan on the server: (its URL, the sha256 of the bytes served)."""
        body = json.dumps(plan, separators=(",", ":")).encode()
        name = f"{plan['sha256']}.json"
        self.server.plans[name] = body
        return f"/plans/{name}", hashlib.sha256(body).hexdigest()

    def serve_model(self, model_dir: Path) -> str:
        token = hashlib.sha256(str(Path(model_dir).resolve()).encode()).hexdigest()[:16]
        self.server.models[token] = Path(model_dir)
        return f"/model/{token}/"

    def close(self) -> None:
        self.server.closed = True
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None:
            self._log.close()
        self.server.shutdown()
        self.server.server_close()
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _default_adapter() -> str | None:
    """SwiftShader where this machine's own adapter is a CPU one (no GPU for Chromium either)."""
    try:
        from .device import get_gpu

        return "swiftshader" if get_gpu().caps.adapter_type.lower() == "cpu" else None
    except EngineError:
        return "swiftshader"


def _open_tab(cdp: str, url: str) -> None:
    """Open `url` in a new tab of the browser at DevTools endpoint `cdp` (http://host:port)."""
    endpoint = f"{cdp.rstrip('/')}/json/new?{urllib.parse.quote(url, safe='')}"
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="PUT"), timeout=10) as r:
            r.read()
    except OSError as exc:
        raise BrowserError("cdp", f"could not open a tab through {cdp}: {exc}") from exc


def caps_of(adapter: dict[str, Any]):
    """engine.device.DeviceCaps of the page's adapter report, for kernel selection and plans."""
    from .device import DeviceCaps

    return DeviceCaps(vendor=adapter.get("vendor", ""), architecture=adapter.get("architecture", ""),
                      device=adapter.get("device", "") or adapter.get("architecture", ""),
                      description=adapter.get("description", ""),
                      # WebGPU does not say an adapter's type; SwiftShader is Chromium's CPU one
                      adapter_type="CPU" if adapter.get("architecture") == "swiftshader" else "browser",
                      backend="WebGPU (browser)",
                      vendor_id=0, device_id=0,
                      features=frozenset(BROWSER_FEATURES.get(f, f) for f in adapter.get("features", [])),
                      limits={LIMIT_NAMES[k]: int(v) for k, v in adapter.get("limits", {}).items()
                              if k in LIMIT_NAMES and v is not None})


# ---- the executor and the pipeline ------------------------------------------------------------


def _array_in(value: np.ndarray, dtype: str) -> dict[str, Any]:
    a = np.ascontiguousarray(value, dtype=DTYPES[dtype])
    return {"dtype": dtype, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def _array_out(doc: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(doc["b64"]), dtype=DTYPES[doc["dtype"]]).reshape(doc["shape"]).copy()


class BrowserExecutor:
    """PlanExecutor's interface, run by the page."""

    def __init__(self, plan: dict[str, Any], model_dir: Path | None, session: BrowserSession,
                 timeout_s: float = 600.0):
        self.plan, self.session, self.timeout_s = plan, session, timeout_s
        url, digest = session.serve_plan(plan)
        base = f"http://127.0.0.1:{session.server.server_address[1]}"
        model_base = base + (session.serve_model(model_dir) if model_dir is not None else "/model/none/")
        self.load_report = session.call("load", timeout_s=timeout_s, plan_url=base + url, plan_file_sha256=digest,
                                        shader_base=base + "/", model_base=model_base)
        self.bytes = self.load_report["buffer_bytes"]
        self.step_ms: list[float] = []
        self.stage_ms: dict[str, float] = {}

    def run(self, stage: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from .plan import stage_inputs

        spec = self.plan["stages"][stage]
        sent = {name: _array_in(value, spec["inputs"][name]["dtype"])
                for name, value in stage_inputs(self.plan, stage, inputs).items()}
        reply = self.session.call("run", timeout_s=self.timeout_s, plan=self.plan["sha256"], stage=stage, inputs=sent)
        self.stage_ms = {k.removesuffix("_ms"): v for k, v in reply["timings"].items()}
        return {k: _array_out(v) for k, v in reply["outputs"].items()}

    def generate(self, input_ids: np.ndarray, latents: np.ndarray | None, noise: list[np.ndarray],
                 image: np.ndarray | None = None) -> dict[str, np.ndarray]:
        inputs = {"input_ids": _array_in(input_ids, "u32"), "noise": [_array_in(n, "f32") for n in noise]}
        if "image" in self.plan["inputs"]:
            inputs["image"] = _array_in(image, self.plan["inputs"]["image"]["dtype"])
        else:
            inputs["latents"] = _array_in(latents, "f32")
        reply = self.session.call("generate", timeout_s=self.timeout_s, plan=self.plan["sha256"], inputs=inputs)
        self.step_ms = list(reply["step_ms"])
        self.stage_ms = {k.removesuffix("_ms"): v for k, v in reply["timings"].items() if k != "total_ms"}
        return {k: _array_out(v) for k, v in reply["outputs"].items()}

    def time_stage(self, stage: str, repetitions: int, warmup: int = 1, seed: int = 0) -> list[float]:
        """As PlanExecutor.time_stage, timed by the page (performance.now, to GPU completion)."""
        return self.session.call("time", timeout_s=self.timeout_s, plan=self.plan["sha256"], stage=stage,
                                 repetitions=repetitions, warmup=warmup, seed=seed)["ms"]

    def kernel_times(self, stage: str, repetitions: int = 1) -> dict[str, dict[str, float]] | None:
        return self.session.call("kernels", timeout_s=self.timeout_s, plan=self.plan["sha256"], stage=stage,
                                 repetitions=repetitions)["kernels"]


def browser_pipeline(model_dir: Path, config, tokenizer, precision: str, profile=None, *, session=None,
                     chromium: str | None = None, cdp: str | None = None, manual: bool = False,
                     webgpu_adapter: str | None = "auto", timeout_s: float = 600.0, announce=None):
    """The Pipeline API (engine.plan_exec.PlanPipeline) with every plan run by a browser page:
    one given `session`, or a new one (a headless Chromium started here; `cdp`: a tab opened
    in the browser at that DevTools endpoint; `manual`: print the URL and wait for a browser).
    `close()` ends a session the pipeline started."""
    from .plan_exec import PlanPipeline

    own = session is None
    if own:
        session = BrowserSession(chromium=chromium, cdp=cdp, manual=manual, webgpu_adapter=webgpu_adapter,
                                 start_timeout_s=600.0 if manual else 60.0, announce=announce)
    try:
        pipe = PlanPipeline(model_dir, config, tokenizer, caps_of(session.adapter), precision, profile,
                            make_executor=lambda plan: BrowserExecutor(plan, model_dir, session, timeout_s))
    except BaseException:
        if own:
            session.close()
        raise
    pipe.runtime = "browser"
    pipe.session = session
    if own:
        pipe.on_close(session.close)
    return pipe
