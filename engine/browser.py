"""The browser executor: engine plans run by the WebGPU page in engine/web/ (plan.js), in a
Chromium this module starts headless, in a browser reached over the DevTools protocol, or in any
browser a person points at the URL it prints. `load_pipeline(model, executor="browser")` returns
the Pipeline API over it; host arrays go in and come back as numpy arrays.

The host side is a page host (engine/pagehost.py) on 127.0.0.1 (WebGPU needs a secure context;
localhost is one) serving the page, the shaders, the plans and the model's files with byte
ranges, and the page's commands: GET /api/next gives the page its next command, POST /api/done
takes the answer. A page that stops answering (its heartbeats stop, its browser exits) ends
the call with a BrowserError; it never hangs.
The server counts the weight bytes it serves, so a test can see the page's cache at work.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from .device import JS_LIMIT_NAMES
from .errors import BrowserError, EngineError
from .gpu import DTYPES
from .httpserver import GuardedServer
from .kernels import SHADER_ROOT
from .pagehost import PageChannel, PageHostHandler, send_file

LIMIT_NAMES = {js: ours for ours, js in JS_LIMIT_NAMES.items()}  # the page reports JavaScript names
BROWSER_FEATURES = {"subgroups": "subgroup"}  # the browser's feature names that engine.device spells otherwise
# The engine's own browser runs on this host, often on a software GPU beside other work: its
# page gets longer before silence counts (its process exiting is noticed at once).
SESSION_PAGE_LOST_S = 30.0


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def launch_page(folder: str | os.PathLike, url: str) -> str:
    """A page in `folder` (a file readable by its owner alone) that sends the browser on to
    `url`, as a file:// URL: what a browser is started on when `url` holds a secret (an
    enrolment URL's token). A command line is there for every user of the machine to read
    (`ps`, /proc/PID/cmdline)."""
    path = Path(folder) / "open.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    page = ("<!doctype html><meta charset=utf-8><title>opening</title><script>location.replace("
            + json.dumps(url).replace("<", "\\u003c") + ")</script>\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(page)
    os.chmod(path, 0o600)  # an older one may have other bits
    return path.resolve().as_uri()


def private_log(path: str | os.PathLike):
    """`path` opened for appending, readable by its owner alone (a browser's log can hold the
    URLs it opened)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.chmod(path, 0o600)
    return os.fdopen(fd, "ab")


# SwiftShader lacks VK_KHR_zero_initialize_workgroup_memory, so Dawn has Tint prepend a loop and
# a barrier zeroing every workgroup variable to each kernel that has one, which a phone's driver
# with the extension does itself. The engine's kernels write each workgroup tile before they
# read it (tests/engine/test_browser.py runs every one of them, against numpy, with this
# toggle): the loop is only cost, and in SwiftShader it was most of a tiled kernel's one-op
# plan, compiled and run (28 GEMM and im2col ones: 89.6 s -> 32.2 s on the fast machine).
SWIFTSHADER_DAWN_TOGGLES = ("disable_workgroup_init",)


def chromium_command(chromium: str, profile_dir: str | os.PathLike, url: str, webgpu_adapter: str | None) -> list[str]:
    """The command line that opens `url` in a headless `chromium` with WebGPU on, its profile in
    `profile_dir` (one per run here; one per virtual phone in agent/simulator/apps.py) and, when
    given, `webgpu_adapter` ("swiftshader": the built-in software adapter) as its adapter."""
    args = [chromium, "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--no-first-run",
            "--no-default-browser-check", "--disable-dev-shm-usage", f"--user-data-dir={profile_dir}",
            "--enable-features=Vulkan"]
    if webgpu_adapter:
        args.append(f"--use-webgpu-adapter={webgpu_adapter}")
    if webgpu_adapter == "swiftshader":
        args.append(f"--enable-dawn-features={','.join(SWIFTSHADER_DAWN_TOGGLES)}")
    return [*args, url]


# ---- the host server --------------------------------------------------------------------------


class _Server(GuardedServer):
    """The session's host: its page, the shaders, the plans and the model files it is given."""

    def __init__(self, page_lost_s: float = SESSION_PAGE_LOST_S):
        super().__init__(("127.0.0.1", 0), _Handler, quiet=True)
        self.channel = PageChannel("the page", lost_s=page_lost_s)
        self.plans: dict[str, bytes] = {}  # served plan file name -> bytes
        self.models: dict[str, Path] = {}  # token -> model folder
        self.weight_bytes_served = 0
        self.requests: list[str] = []
        self.session = base64.urlsafe_b64encode(os.urandom(12)).decode()
        self.closed = False
        self.lock = threading.Lock()


class _Handler(PageHostHandler):
    server: _Server

    def page_channel(self, query: dict[str, list[str]]) -> PageChannel | None:
        """The session's page: a page of another session, or of a closed one, is sent away."""
        if query.get("session", [""])[0] != self.server.session:
            self.refuse(410, "not this session")
            return None
        if self.server.closed:
            self.refuse(410, "the session is closed")
            return None
        return self.server.channel

    def do_GET(self):  # noqa: N802  (http.server's name)
        url = urllib.parse.urlsplit(self.path)
        path, query = url.path, urllib.parse.parse_qs(url.query)
        self.server.requests.append(path)
        if self.send_web_file(path):
            return None
        if path.startswith("/shaders/"):
            return send_file(self, SHADER_ROOT, path[len("/shaders/"):])
        if path.startswith("/plans/"):
            body = self.server.plans.get(path[len("/plans/"):])
            return self.send(200, body) if body is not None else self.error(404, "no such plan")
        if path.startswith("/model/"):
            token, _, rel = path[len("/model/"):].partition("/")
            root = self.server.models.get(token)
            if root is None:
                return self.error(404, "no such model")
            served = send_file(self, root, rel)
            with self.server.lock:
                self.server.weight_bytes_served += served
            return None
        if path == "/api/next":
            channel = self.page_channel(query)
            return self.serve_next(channel, query) if channel else None
        return self.error(404, "not found")

    def do_HEAD(self):  # noqa: N802
        return self.do_GET()

    def do_POST(self):  # noqa: N802
        url = urllib.parse.urlsplit(self.path)
        channel = self.page_channel(urllib.parse.parse_qs(url.query))
        if channel is not None and not self.serve_page_post(url.path, channel):
            self.refuse(404, "not found")


# ---- a browser session ------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _reap_browser(process: subprocess.Popen, log, profile_dir: str) -> None:
    """Stop a Chromium this process started, then its helper processes (GPU, renderer, which
    may outlive it by a moment and write into the profile), then its profile."""
    helpers = _descendants(process.pid) if process.poll() is None else []
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pid in helpers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone with it
            pass
    log.close()
    for _ in range(50):  # a helper killed a moment ago may still be closing files in it
        shutil.rmtree(profile_dir, ignore_errors=True)
        if not os.path.exists(profile_dir):
            break
        time.sleep(0.1)


def chromium_memory(pid: int, field: str = "VmHWM") -> dict[str, int]:
    """The largest `field` (VmHWM: peak resident memory; VmRSS: resident now), in bytes, of
    each kind of process (browser, renderer, gpu-process, utility...) of the Chromium whose
    browser process is `pid`; empty where there is no /proc."""
    out: dict[str, int] = {}
    for child in [pid, *_descendants(pid)]:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode("utf-8", "replace")
            status = Path(f"/proc/{child}/status").read_text()
        except OSError:
            continue
        # Chromium rewrites its helpers' argv into one string: "... --type=renderer ..."
        kind = m.group(1) if (m := re.search(r"--type=([\w-]+)", cmdline)) else "browser"
        value = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith(field + ":")), 0)
        out[kind] = max(out.get(kind, 0), value)
    return out


def reset_memory_peaks(pid: int) -> None:
    """Start the peak resident memory (VmHWM) of Chromium `pid` and its helpers afresh (Linux)."""
    for child in [pid, *_descendants(pid)]:
        with contextlib.suppress(OSError):
            Path(f"/proc/{child}/clear_refs").write_text("5")


class BrowserSession:
    """The server, the page and (unless `browser_url`/`cdp` say otherwise) the Chromium it
    runs in. `call(op, ...)` sends the page one command and returns its answer."""

    def __init__(self, *, chromium: str | None = None, cdp: str | None = None, manual: bool = False,
                 webgpu_adapter: str | None = "auto", start_timeout_s: float = 60.0, announce=None,
                 page_lost_s: float = SESSION_PAGE_LOST_S, emulate: dict[str, Any] | None = None):
        """`emulate`: an adapter description (engine/adapters/*.json, DeviceCaps.as_dict()) the
        page behaves as: it requests that adapter's limits (where its own adapter offers as
        much) and none of the features it lacks, reports it, and holds plans to its
        memory_budget_bytes: a phone's browser, tested on this machine's."""
        self.server = _Server(page_lost_s)
        self._thread = threading.Thread(target=self.server.serve_forever, name="browser-executor", daemon=True)
        self._thread.start()
        self.process: subprocess.Popen | None = None
        self._profile_dir: str | None = None
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/web/index.html?session={self.server.session}"
        if emulate is not None:
            doc = {k: v for k, v in emulate.items() if k != "source"}
            self.url += "&emulate=" + base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")
        try:
            if cdp:
                _open_tab(cdp, self.url)
            elif manual:
                (announce or print)(f"open {self.url} in a browser with WebGPU on this machine")
            else:
                self._launch(chromium, webgpu_adapter)
            if not self.server.channel.polled.wait(start_timeout_s):
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
        self._profile_dir = tempfile.mkdtemp(prefix="engine-chromium-")
        self._log = open(Path(self._profile_dir) / "chromium.log", "wb")  # noqa: SIM115  (closed in close())
        self.process = subprocess.Popen(chromium_command(chromium, self._profile_dir, self.url, webgpu_adapter),
                                        stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # A session never closed (a script that generates and exits, a pipeline dropped) still
        # takes its Chromium down: when it is garbage-collected, or at the latest when the
        # interpreter exits (weakref.finalize runs then). close() runs it at once.
        self._reaper = weakref.finalize(self, _reap_browser, self.process, self._log, self._profile_dir)

    def _exit_note(self) -> str:
        if self.process is not None and self.process.poll() is not None:
            tail = (Path(self._profile_dir) / "chromium.log").read_bytes()[-1500:].decode("utf-8", "replace")
            return f"; Chromium exited with {self.process.returncode}: {tail}"
        return ""

    @property
    def adapter(self) -> dict[str, Any]:
        return self.hello["adapter"]

    def process_memory(self) -> dict[str, int]:
        """The peak resident memory (VmHWM, bytes) of each kind of process of the Chromium this
        session started (browser, renderer, gpu-process, utility...), the largest of each kind;
        empty where it started none or there is no /proc."""
        if self.process is None or self.process.poll() is not None:
            return {}
        return chromium_memory(self.process.pid)

    @property
    def weight_bytes_served(self) -> int:
        return self.server.weight_bytes_served

    @property
    def console(self) -> list[dict[str, Any]]:
        """The page's uncaught errors, as it reported them."""
        return self.server.channel.console

    def call(self, op: str, *, timeout_s: float = 600.0, **fields) -> dict[str, Any]:
        return self.server.channel.call(op, timeout_s=timeout_s, gone=self._gone, **fields)

    def _gone(self) -> str | None:
        if self.process is not None and self.process.poll() is not None:
            return "the browser exited" + self._exit_note()
        return None

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
        if self.process is not None:
            self._reaper()
        elif self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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
                              if k in LIMIT_NAMES and v is not None},
                      memory_budget_bytes=adapter.get("memory_budget_bytes"))


# ---- the executor and the pipeline ------------------------------------------------------------


def _array_in(value: np.ndarray, dtype: str) -> dict[str, Any]:
    a = np.ascontiguousarray(value, dtype=DTYPES[dtype])
    return {"dtype": dtype, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def _array_out(doc: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(doc["b64"]), dtype=DTYPES[doc["dtype"]]).reshape(doc["shape"]).copy()


class BrowserExecutor:
    """PlanExecutor's interface, run by the page."""

    def __init__(self, plan: dict[str, Any], model_dir: Path | None, session: BrowserSession,
                 timeout_s: float = 600.0, *, budget_bytes: int | None = None, residency: str = "auto"):
        from .fit import plan_memory

        self.plan, self.session, self.timeout_s = plan, session, timeout_s
        self.memory = plan_memory(plan)
        self.load_report = session.call("load", timeout_s=timeout_s, budget_bytes=budget_bytes, residency=residency,
                                        **session.load_fields(plan, model_dir))
        self.bytes = self.load_report["buffer_bytes"]
        self.residency = self.load_report.get("residency", "resident")
        self.peak_bytes = int(self.load_report.get("peak_bytes", 0))
        self.upload_ms = 0.0
        self.stage_ms: dict[str, float] = {}
        self.loop_steps = 0  # as PlanExecutor's: the page runs the denoising loop back to back

    def run(self, stage: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from .plan import stage_inputs

        spec = self.plan["stages"][stage]
        sent = {name: _array_in(value, spec["inputs"][name]["dtype"])
                for name, value in stage_inputs(self.plan, stage, inputs).items()}
        reply = self.session.call("run", timeout_s=self.timeout_s, plan=self.plan["sha256"], stage=stage, inputs=sent)
        self.stage_ms = {k.removesuffix("_ms"): v for k, v in reply["timings"].items()}
        self.peak_bytes = max(self.peak_bytes, int(reply.get("peak_bytes", 0)))
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
        self.upload_ms = float(reply["timings"].get("weight_upload_ms", 0.0))
        self.stage_ms = {k.removesuffix("_ms"): v for k, v in reply["timings"].items()
                         if k not in ("total_ms", "weight_upload_ms")}
        self.peak_bytes = max(self.peak_bytes, int(reply.get("peak_bytes", 0)))
        return {k: _array_out(v) for k, v in reply["outputs"].items()}

    def time_stage(self, stage: str, repetitions: int, warmup: int = 1, seed: int = 0) -> list[float]:
        """As PlanExecutor.time_stage, timed by the page (performance.now, to GPU completion)."""
        reply = self.session.call("time", timeout_s=self.timeout_s, plan=self.plan["sha256"], stage=stage,
                                  repetitions=repetitions, warmup=warmup, seed=seed)
        self.peak_bytes = max(self.peak_bytes, int(reply.get("peak_bytes", 0)))
        return reply["ms"]

    def kernel_times(self, stage: str, repetitions: int = 1) -> dict[str, dict[str, float]] | None:
        reply = self.session.call("kernels", timeout_s=self.timeout_s, plan=self.plan["sha256"], stage=stage,
                                  repetitions=repetitions)
        self.peak_bytes = max(self.peak_bytes, int(reply.get("peak_bytes", 0)))
        return reply["kernels"]


def browser_pipeline(model_dir: Path, config, tokenizer, precision: str, profile=None, *, session=None,
                     chromium: str | None = None, cdp: str | None = None, manual: bool = False,
                     webgpu_adapter: str | None = "auto", timeout_s: float = 600.0, announce=None,
                     budget_bytes: int | None = None, residency: str = "auto"):
    """The Pipeline API (engine.plan_exec.PlanPipeline) with every plan run by a browser page:
    one given `session` (anything with BrowserSession's `adapter`, `call` and `load_fields`:
    a page another program hosts), or a new session (a headless Chromium started here; `cdp`:
    a tab opened in the browser at that DevTools endpoint; `manual`: print the URL and wait
    for a browser). The page keeps each plan within `budget_bytes` of GPU memory, its weights
    held as `residency` says (engine.fit). `close()` ends a session the pipeline started."""
    from .plan_exec import PlanPipeline

    own = session is None
    if own:
        session = BrowserSession(chromium=chromium, cdp=cdp, manual=manual, webgpu_adapter=webgpu_adapter,
                                 start_timeout_s=600.0 if manual else 60.0, announce=announce)
    try:
        pipe = PlanPipeline(model_dir, config, tokenizer, caps_of(session.adapter), precision, profile,
                            budget_bytes=budget_bytes, residency=residency,
                            make_executor=lambda plan: BrowserExecutor(plan, model_dir, session, timeout_s,
                                                                       budget_bytes=budget_bytes, residency=residency))
    except BaseException:
        if own:
            session.close()
        raise
    pipe.executor = "browser"
    pipe.session = session
    if own:
        pipe.on_close(session.close)
    return pipe
