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
import sys
import tempfile
import threading
import time
import urllib.error
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
HUB_KEY_HEADER = "X-Farm-Hub-Key"  # the farm side of a hub (orchestrator/browser_hub.py) asks for its key
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


def reply_result(reply: dict[str, Any]) -> dict[str, Any]:
    """A page's answer ({id, ok, result | error}): its result, or the BrowserError it reports."""
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise BrowserError(err.get("kind", "internal"), err.get("message", "no message"))
    return reply["result"]


def hub_request(url: str, key: str, method: str, body: bytes, timeout_s: float) -> dict[str, Any]:
    """One request to the farm side of a hub (orchestrator/browser_hub.py), its JSON answer;
    BrowserError "hub" for an HTTP error or a hub that cannot be reached."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={HUB_KEY_HEADER: key, "Content-Type": "application/json"})
    where = urllib.parse.urlsplit(url)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise BrowserError("hub", f"{method} {where.path}: HTTP {exc.code}: "
                           f"{exc.read()[:300].decode('utf-8', 'replace')}") from None
    except OSError as exc:
        raise BrowserError("hub", f"the farm's hub at {where.netloc} is unreachable ({exc}): is `farm hub` "
                           "running?") from None


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_command(chromium: str, profile_dir: str | os.PathLike, url: str, webgpu_adapter: str | None) -> list[str]:
    """The command line that opens `url` in a headless `chromium` with WebGPU on, its profile in
    `profile_dir` (one per run here; one per virtual phone in agent/simulator/apps.py) and, when
    given, `webgpu_adapter` ("swiftshader": the built-in software adapter) as its adapter."""
    args = [chromium, "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--no-first-run",
            "--no-default-browser-check", "--disable-dev-shm-usage", f"--user-data-dir={profile_dir}",
            "--enable-features=Vulkan"]
    if webgpu_adapter:
        args.append(f"--use-webgpu-adapter={webgpu_adapter}")
    return [*args, url]


# ---- the host server --------------------------------------------------------------------------


def send_file(handler: BaseHTTPRequestHandler, root: Path, rel: str | None = None) -> int:
    """Answer `handler`'s GET with the file `rel` under `root` (or the file `root`), honouring a
    single byte range; 404 for anything outside `root` or missing. Returns the body bytes sent."""
    root = Path(root).resolve()
    path = (root / urllib.parse.unquote(rel)).resolve() if rel is not None else root
    if (rel is not None and not path.is_relative_to(root)) or not path.is_file():
        _answer(handler, 404, b"not found", "text/plain")
        return 0
    size = path.stat().st_size
    start, end = 0, size - 1
    rng = handler.headers.get("Range")
    status, headers = 200, {"Accept-Ranges": "bytes"}
    if rng:
        try:
            unit, spec = rng.split("=", 1)
            a, b = spec.split("-", 1)
            start, end = int(a), min(int(b) if b else size - 1, size - 1)
            if unit.strip() != "bytes" or start > end or start >= size:
                raise ValueError
        except ValueError:
            _answer(handler, 416, b"bad range", "text/plain", {"Content-Range": f"bytes */{size}"})
            return 0
        status, headers["Content-Range"] = 206, f"bytes {start}-{end}/{size}"
    with open(path, "rb") as f:
        f.seek(start)
        body = f.read(end - start + 1)
    _answer(handler, status, body, CONTENT_TYPES.get(path.suffix, "application/octet-stream"), headers)
    return len(body) if handler.command != "HEAD" else 0


def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str, headers=None) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    handler.send_header("Cache-Control", "no-store")
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)



class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """A page that went away mid-answer (its long poll timed out, the tab closed) is no
        error of the engine's: socketserver would print its traceback into the caller's output."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

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
        _answer(self, status, body, ctype, headers)

    def _file(self, root: Path, rel: str, count_bytes: bool = False):
        served = send_file(self, root, rel)
        if count_bytes:
            with self.server.lock:
                self.server.weight_bytes_served += served

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
        if url.path == "/api/beat":
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
            webgpu_adapter = default_webgpu_adapter()
        self._profile_dir = tempfile.mkdtemp(prefix="farm-chromium-")
        self._log = open(Path(self._profile_dir) / "chromium.log", "wb")  # noqa: SIM115  (closed in close())
        self.process = subprocess.Popen(chromium_command(chromium, self._profile_dir, self.url, webgpu_adapter),
                                        stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

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
        return reply_result(reply)

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

    def load_fields(self, plan: dict[str, Any], model_dir: Path | None) -> dict[str, Any]:
        """The `load` command's fields: the plan, the shaders and the model, from this server."""
        url, digest = self.serve_plan(plan)
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        return {"plan_url": base + url, "plan_file_sha256": digest, "shader_base": base + "/",
                "model_base": base + (self.serve_model(model_dir) if model_dir is not None else "/model/none/")}

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


class RemotePage:
    """A page a farm's hub holds (orchestrator/browser_hub.py), reached from here through the
    hub's farm side at `url` (http://127.0.0.1:PORT/ctl/DEVICE?key=KEY): the session interface
    BrowserExecutor uses, where the page runs plans from the build deployed to it. The model
    folder must lie in an installed build (<agent root>/builds/<build>/...): the page takes
    shaders and weights from its verified copy of that build, never from here."""

    def __init__(self, url: str, timeout_s: float = 60.0):
        parts = urllib.parse.urlsplit(url)
        self._key = urllib.parse.parse_qs(parts.query).get("key", [""])[0]
        self._base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self.hello = self.call("hello", timeout_s=timeout_s)

    @property
    def adapter(self) -> dict[str, Any]:
        return self.hello["adapter"]

    def _request(self, method: str, path: str, body: bytes, timeout_s: float) -> dict[str, Any]:
        return hub_request(self._base + path, self._key, method, body, timeout_s)

    def call(self, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        body = json.dumps({"op": op, "timeout_s": timeout_s, **fields}).encode()
        return reply_result(self._request("POST", "/call", body, timeout_s + 30.0))

    def load_fields(self, plan: dict[str, Any], model_dir: Path | None) -> dict[str, Any]:
        body = json.dumps(plan, separators=(",", ":")).encode()
        name = f"{plan['sha256']}.json"
        url = self._request("PUT", f"/plans/{name}", body, 60.0)["url"]
        build_dir, prefix = _build_of(model_dir)
        return {"plan_url": url, "plan_file_sha256": hashlib.sha256(body).hexdigest(), "build": build_dir.name,
                "model_prefix": prefix}

    def close(self) -> None:  # the hub's page outlives this process
        pass


def _build_of(model_dir: Path | None) -> tuple[Path, str]:
    """(the installed build folder holding `model_dir`, the model's folder in it as "a/b/")."""
    if model_dir is None:
        raise BrowserError("input", "a page of a farm runs models of a deployed build; no model folder given")
    model_dir = Path(model_dir).resolve()
    for folder in (model_dir, *model_dir.parents):
        if (folder / "manifest.json").is_file() and (folder / "manifest.sig").is_file():
            rel = model_dir.relative_to(folder).as_posix()
            return folder, "" if rel == "." else rel + "/"
    raise BrowserError("input", f"{model_dir} is not in an installed build: the page runs only deployed builds")


def default_webgpu_adapter() -> str | None:
    """The WebGPU adapter a headless Chromium here is given: $FARM_BROWSER_WEBGPU_ADAPTER, else
    SwiftShader where this machine's own adapter is a CPU one (no GPU for Chromium either),
    else Chromium's own choice (None)."""
    if os.environ.get("FARM_BROWSER_WEBGPU_ADAPTER"):
        return os.environ["FARM_BROWSER_WEBGPU_ADAPTER"]
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
        self.load_report = session.call("load", timeout_s=timeout_s, **session.load_fields(plan, model_dir))
        self.bytes = self.load_report["buffer_bytes"]
        self.stage_ms: dict[str, float] = {}
        self.loop_steps = 0  # as PlanExecutor's: the page runs the denoising loop back to back

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
        self.loop_steps = int(reply["loop_steps"])
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
                     page: str | None = None, chromium: str | None = None, cdp: str | None = None,
                     manual: bool = False, webgpu_adapter: str | None = "auto", timeout_s: float = 600.0,
                     announce=None):
    """The Pipeline API (engine.plan_exec.PlanPipeline) with every plan run by a browser page:
    one given `session`; a farm device's page held by a hub (`page`: its control URL, see
    RemotePage); or a new session (a headless Chromium started here; `cdp`: a tab opened in the
    browser at that DevTools endpoint; `manual`: print the URL and wait for a browser).
    `close()` ends a session the pipeline started."""
    from .plan_exec import PlanPipeline

    if page is not None:
        session = RemotePage(page)
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
