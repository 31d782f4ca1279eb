"""`farm-agent serve`: the network agent, for devices reached over the network instead of ADB.
HTTP from the standard library, HTTPS when given a certificate and key, every route behind a
bearer token (compared in constant time; a request without the right token gets 401 and
changes nothing), JSON bodies in the agent/protocol formats. It listens on 127.0.0.1 unless
told otherwise, serves at most `max_connections` connections at once, and drops a connection
that stays silent for `idle_timeout_s`, so idle clients cannot hold every slot. A request or
document of another protocol version gets 409 with the ProtocolError message.

    GET  /v1/info                                DeviceInfo
    GET  /v1/builds                              installed builds and the current one
    POST /v1/store/missing                       body: Manifest -> {"missing": [ManifestFile]}
    PUT  /v1/bundles/<build>/manifest.json       the signed manifest   } staged under
    PUT  /v1/bundles/<build>/manifest.sig        its signature         } <root>/incoming/<build>,
    PUT  /v1/bundles/<build>/files/<path>        one file of the build } one request per file
         [?offset=N]                             the rest of it from byte N, kept chunk by chunk
    POST /v1/bundles/<build>/install             verify + install the staged bundle (bundle.py)
    POST /v1/jobs[?wait=1]                       body: JobSpec -> 202 (running) or, with wait,
                                                 the JobResult; 503 while another job runs
    POST /v1/jobs/<id>/stop                      body: {"reason": ...}; 404 when it is not running
    GET  /v1/jobs/<id>                           JobResult when done, 202 + progress while running
    GET  /v1/jobs/<id>/events?since=N            progress events from the N-th on
    GET  /v1/jobs/<id>/artifacts/<path>          a file of the job's output folder

Uploads are resumable: the orchestrator asks /v1/store/missing which files the device lacks
(neither in its store nor staged whole by an interrupted upload), PUTs only those (a file is
received beside the staging folder and moved in only once whole), then installs. Inside a
file too, when the manifest lists chunk hashes: the answer's "arrived" says how many bytes of
a cut upload are held (whole chunks, verified), and a PUT with ?offset= at that length sends
the rest, each chunk checked against the staged signed manifest (its signature is checked as
it is PUT) before it is kept. A job id names its output folder <root>/jobs/<id>; posting a
job whose result is already there returns that result instead of running it again, so a
retried request never runs a job twice.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from agent.bundle import (
    NAME_PATTERN,
    BundleError,
    OffsetRefused,
    arrived_bytes,
    current_build,
    install_bundle,
    list_builds,
    missing_files,
    verify_build,
)
from agent.jobs import AgentBusy, busy_message, lock_problem, read_lock, run_job, stop_job
from agent.protocol import (
    FILES,
    MANIFEST,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    SIGNATURE,
    DeviceInfo,
    JobResult,
    JobSpec,
    Manifest,
    ProtocolError,
    from_dict,
    to_dict,
    to_json,
)
from agent.uploads import receive_chunks, staged_manifest
from engine.httpserver import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    REQUEST_DEADLINE_S,
    GuardedHandler,
    GuardedServer,
    RequestError,
)

MAX_JSON_BYTES = 16 << 20
MAX_FILE_BYTES = 64 << 30  # one file of a build (SD 1.4's UNet in fp32 is 3.4 GB)
CHUNK = 1 << 20
EVENTS_KEPT = 1000
DEFAULT_HOST = "127.0.0.1"


class ServeError(Exception):
    """The server cannot start (no token, bad root); the CLI prints it and exits 1."""


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def load_token(path: Path) -> str:
    """The bearer token from its file; refuses a missing or empty one, and one that other users
    can read (they could then drive the device)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        if os.name != "nt" and mode & (stat.S_IRWXG | stat.S_IRWXO):  # Windows has no such bits
            raise ServeError(f"the token file {path} is open to other users (mode {stat.S_IMODE(mode):o}); "
                             f"fix with `chmod 600 {path}`")
        token = path.read_text().strip()
    except OSError as exc:
        raise ServeError(f"cannot read the token file {path}: {exc.strerror or exc}; "
                         "create it with a long random token (e.g. `openssl rand -hex 32 > FILE`)") from None
    if not token:
        raise ServeError(f"the token file {path} is empty; put a long random token in it "
                         "(the agent never serves without one)")
    return token


def _check_name(kind: str, value: str) -> str:
    if not NAME_PATTERN.fullmatch(value):
        raise HTTPError(400, f"{kind} {value!r}: use letters, digits and ._+- (not starting with '.' or '-')")
    return value


def _safe_relative(path: str) -> str:
    parts = path.split("/")
    if not path or "\\" in path or "\x00" in path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise HTTPError(400, f"bad path {path!r}: relative, forward slashes, no '.', '..' or empty parts")
    return path


# ---- device info without holding a GPU in the server ------------------------------------------


def adapter_in_child() -> dict:
    """The adapter's capabilities, read in a short-lived child so that the long-running server
    never holds a GPU device of its own (jobs need it)."""
    code = "import json; from engine.device import get_gpu; print(json.dumps(get_gpu().caps.as_dict()))"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class DeviceInfoSource:
    """DeviceInfo on request: the adapter once (cached on success), the rest (thermal, battery,
    clocks) fresh each time."""

    def __init__(self, adapter_fn=adapter_in_child):
        self.adapter_fn = adapter_fn
        self._adapter: dict | None = None
        self._lock = threading.Lock()

    def __call__(self) -> DeviceInfo:
        from agent.deviceinfo import collect_local

        with self._lock:
            adapter = self._adapter
            if adapter is None:
                try:
                    adapter = self._adapter = self.adapter_fn()
                except Exception as exc:
                    adapter = {"error": f"no usable WebGPU adapter: {exc}"}
        return collect_local(adapter=adapter)


# ---- jobs run by this server --------------------------------------------------------------


@dataclass
class RunningJob:
    job_id: str
    out_dir: Path
    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    first_event: int = 0  # index of events[0] among all events (older ones dropped)
    done: threading.Event = field(default_factory=threading.Event)
    result: JobResult | None = None
    busy: str | None = None
    error: str | None = None

    def add(self, event: dict) -> None:
        if len(self.events) == self.events.maxlen:
            self.first_event += 1
        self.events.append(event)

    def since(self, n: int) -> tuple[int, list[dict]]:
        events = list(self.events)
        start = max(0, n - self.first_event)
        return self.first_event + len(events), events[start:]


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server side of TLS from a PEM certificate (chain) and its private key."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    for path in (cert, key):
        if not Path(path).is_file():
            raise ServeError(f"cannot read {path}: no such file; give --tls-cert and --tls-key as PEM files")
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ServeError(f"cannot use the certificate {cert} with the key {key}: {exc}; give a PEM certificate "
                         "and the PEM private key it was issued for") from None
    return context


class AgentServer(GuardedServer):
    def __init__(self, address: tuple[str, int], root: Path, token: str, info=None, quiet: bool = False,
                 job_runner=run_job, tls: ssl.SSLContext | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, request_deadline_s: float = REQUEST_DEADLINE_S):
        if not token:
            raise ServeError("refusing to serve without a token")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = token.encode()
        self.info = info or DeviceInfoSource()
        self.job_runner = job_runner
        self.jobs: dict[str, RunningJob] = {}
        self.jobs_lock = threading.Lock()
        super().__init__(address, AgentHandler, tls=tls, quiet=quiet, max_connections=max_connections,
                         idle_timeout_s=idle_timeout_s, request_deadline_s=request_deadline_s)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / _check_name("job id", job_id)

    def start_job(self, spec: JobSpec) -> RunningJob:
        with self.jobs_lock:
            job = self.jobs.get(spec.job_id)
            if job is not None and not job.done.is_set():
                return job
            held = read_lock(self.root)
            if held is not None and lock_problem(held) is None:
                raise HTTPError(503, busy_message(held))
            job = self.jobs[spec.job_id] = RunningJob(spec.job_id, self.job_dir(spec.job_id))
        threading.Thread(target=self._run, args=(spec, job), name=f"job-{spec.job_id}", daemon=True).start()
        return job

    def _run(self, spec: JobSpec, job: RunningJob) -> None:
        try:
            job.result = self.job_runner(spec, job.out_dir, self.root, progress=job.add)
        except AgentBusy as exc:
            job.busy = str(exc)
        except Exception as exc:  # run_job turns job failures into results; this is the agent's bug
            job.error = f"{type(exc).__name__}: {exc}"
        finally:
            job.done.set()


class AgentHandler(GuardedHandler):
    server: AgentServer
    server_version = "farm-agent"

    # ---- plumbing -----------------------------------------------------------------------

    def log_message(self, format, *args):  # noqa: A002  (the base class's name)
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} {time.strftime('%H:%M:%S')} {format % args}\n")

    def _send(self, status: int, body: bytes, content_type: str = "application/json",
              headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header(PROTOCOL_HEADER, str(PROTOCOL_VERSION))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data) -> None:
        text = data if isinstance(data, str) else json.dumps(data, indent=2, sort_keys=True)
        self._send(status, (text + "\n").encode())

    def _error(self, status: int, message: str) -> None:
        headers = {"WWW-Authenticate": 'Bearer realm="farm-agent"'} if status == 401 else None
        if status == 401 or self.command in ("PUT", "POST"):
            self.close_connection = True  # the body we did not read must not be taken as a request
        self._send(status, (json.dumps({"error": message}) + "\n").encode(), headers=headers)

    def _authorized(self) -> bool:
        header = self.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.server.token)

    def _length(self, limit: int) -> int:
        try:
            return self.content_length(limit)
        except RequestError as exc:
            raise HTTPError(exc.status, str(exc)) from None

    def _read_json(self):
        try:
            raw = self.read_body(MAX_JSON_BYTES)
        except RequestError as exc:
            raise HTTPError(exc.status, str(exc)) from None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise HTTPError(400, f"body is not valid JSON: {exc}") from None

    def _document(self, cls, data):
        """A protocol document; another protocol version -> 409, other mistakes -> 400."""
        try:
            return from_dict(cls, data)
        except ProtocolError as exc:
            version = data.get("protocol", PROTOCOL_VERSION) if isinstance(data, dict) else PROTOCOL_VERSION
            raise HTTPError(409 if version != PROTOCOL_VERSION else 400, str(exc)) from None

    def _dispatch(self) -> None:
        if not self._authorized():
            self._error(401, "missing or wrong bearer token")
            return
        theirs = self.headers.get(PROTOCOL_HEADER)
        if theirs is not None and theirs.strip() != str(PROTOCOL_VERSION):
            self._error(409, f"the client speaks protocol {theirs.strip()}, this agent speaks {PROTOCOL_VERSION}: "
                             "upgrade the older of the orchestrator and the agent (deploy a new build)")
            return
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = parse_qs(url.query)
        try:
            if parts[:1] != ["v1"]:
                raise HTTPError(404, f"no route {url.path}; routes start with /v1/")
            handler = self._route(self.command, parts[1:])
            handler(parts[1:], query)
        except HTTPError as exc:
            self._error(exc.status, str(exc))
        except Exception as exc:  # a bug must answer 500, not drop the connection
            self._error(500, f"{type(exc).__name__}: {exc}")

    def _route(self, method: str, p: list[str]):
        table = [
            ("GET", ["info"], self.get_info),
            ("GET", ["builds"], self.get_builds),
            ("POST", ["store", "missing"], self.store_missing),
            ("GET", ["store", "missing"], self.store_missing),
            ("PUT", ["bundles", "*", "manifest.json"], self.put_bundle_file),
            ("PUT", ["bundles", "*", "manifest.sig"], self.put_bundle_file),
            ("PUT", ["bundles", "*", "files", "**"], self.put_bundle_file),
            ("POST", ["bundles", "*", "install"], self.install),
            ("POST", ["jobs"], self.post_job),
            ("GET", ["jobs", "*"], self.get_job),
            ("POST", ["jobs", "*", "stop"], self.stop_job),
            ("GET", ["jobs", "*", "events"], self.get_events),
            ("GET", ["jobs", "*", "artifacts", "**"], self.get_artifact),
        ]
        allowed = []
        for m, pattern, fn in table:
            if _matches(pattern, p):
                if m == method:
                    return fn
                allowed.append(m)
        if allowed:
            raise HTTPError(405, f"{method} is not allowed here; use {', '.join(sorted(set(allowed)))}")
        raise HTTPError(404, f"no route /v1/{'/'.join(p)}")

    do_GET = do_PUT = do_POST = _dispatch

    # ---- routes ------------------------------------------------------------------------

    def get_info(self, p, q) -> None:
        self._json(200, to_json(self.server.info()))

    def get_builds(self, p, q) -> None:
        current = current_build(self.server.root)
        damaged = verify_build(self.server.root, current) if current else []
        self._json(200, {"current": current.build_id if current else None,
                         "current_damaged": damaged,  # files of the current build no longer intact
                         "builds": [{"build_id": b.build_id, "version": b.manifest.version,
                                     "created": b.manifest.created, "files": len(b.manifest.files)}
                                    for b in list_builds(self.server.root)]})

    def store_missing(self, p, q) -> None:
        manifest = self._document(Manifest, self._read_json())
        missing = missing_files(manifest, self.server.root, staged=self._staging(manifest.build))
        arrived = arrived_bytes(manifest, self.server.root, missing)
        self._json(200, {"build": manifest.build, "missing": [to_dict(f) for f in missing],
                         "arrived": arrived,  # sha256 -> bytes held of a cut upload: PUT the rest ?offset=
                         "missing_bytes": sum(f.size for f in missing) - sum(arrived.values())})

    def _staging(self, build: str) -> Path:
        return self.server.root / "incoming" / _check_name("build id", build)

    def put_bundle_file(self, p, q) -> None:
        staging = self._staging(p[1])
        rel = _safe_relative("/".join(p[2:]))
        target = staging / rel
        length = self._length(MAX_FILE_BYTES)
        # An authorized upload of a model's weights takes what it takes (each read still has
        # the idle timeout); the request deadline is for what comes before the token is known.
        self.request_read()
        if "offset" in q:
            self._put_chunks(staging, rel, q["offset"][0], length)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the staging folder, never inside it: a bundle folder holds only its files.
        tmp = self.server.root / "incoming" / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                left = length
                while left:
                    chunk = self.rfile.read(min(CHUNK, left))
                    if not chunk:
                        raise HTTPError(400, f"the body ended after {length - left} of {length} bytes")
                    f.write(chunk)
                    left -= len(chunk)
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if rel == SIGNATURE and (staging / MANIFEST).is_file():
            # Checked as it is staged: files are checked against it as they come, and a build
            # signed with another key is refused before any of its files is sent.
            try:
                staged_manifest(staging, self.server.root)
            except BundleError as exc:
                target.unlink(missing_ok=True)
                raise HTTPError(400, f"build {p[1]!r} refused: {exc}") from None
        self._json(201, {"stored": rel, "size": length})

    def _put_chunks(self, staging: Path, rel: str, offset: str, length: int) -> None:
        """The rest of a file from byte `offset` (what /v1/store/missing said is held), kept a
        verified chunk at a time, so a cut costs at most the chunk it went through."""
        if not rel.startswith(f"{FILES}/") or not offset.isdigit():
            raise HTTPError(400, f"?offset= takes a byte count and a file under {FILES}/, not {offset!r} for {rel}")
        left = length

        def read(n: int) -> bytes:
            nonlocal left
            data = self.rfile.read(min(n, left)) if left else b""
            left -= len(data)
            return data

        try:
            entry, held = receive_chunks(staging, self.server.root, rel.removeprefix(f"{FILES}/"), int(offset), read)
        except BundleError as exc:
            raise HTTPError(416 if isinstance(exc, OffsetRefused) else 400, str(exc)) from None
        if held < entry.size:
            raise HTTPError(400, f"the body ended after {length - left} of {length} bytes; {held} bytes of "
                                 f"{rel} are held, resume from there")
        if left:
            raise HTTPError(400, f"{left} bytes past the end of {rel}")
        self._json(201, {"stored": rel, "size": entry.size, "from": int(offset)})

    def install(self, p, q) -> None:
        staging = self._staging(p[1])
        if self.headers.get("Content-Length") not in (None, "0"):
            self.rfile.read(self._length(MAX_JSON_BYTES))  # the body carries nothing; drain it
        if not staging.is_dir():
            raise HTTPError(404, f"nothing staged for build {p[1]!r}; PUT its manifest.json, manifest.sig and files first")
        try:
            build = install_bundle(staging, self.server.root,
                                   allow_downgrade=q.get("allow_downgrade", ["0"])[0] in ("1", "true", "yes"))
        except BundleError as exc:
            raise HTTPError(400, f"install of build {p[1]!r} refused: {exc}") from None
        shutil.rmtree(staging, ignore_errors=True)
        self._json(200, {"build_id": build.build_id, "path": str(build.path), "files": len(build.manifest.files),
                         "kept_current": build.kept_current})

    def post_job(self, p, q) -> None:
        spec = self._document(JobSpec, self._read_json())
        out_dir = self.server.job_dir(spec.job_id)
        job = self.server.jobs.get(spec.job_id)
        if (job is None or job.done.is_set()) and (out_dir / "result.json").is_file():
            self._json(200, (out_dir / "result.json").read_text())  # already ran: never twice
            return
        job = self.server.start_job(spec)
        if q.get("wait", ["0"])[0] not in ("1", "true", "yes"):
            self._json(202, {"job_id": spec.job_id, "status": "running", "location": f"/v1/jobs/{spec.job_id}"})
            return
        job.done.wait()
        self._job_answer(job)

    def stop_job(self, p, q) -> None:
        body = self._read_json() if self.headers.get("Content-Length") not in (None, "0") else {}
        reason = body.get("reason") if isinstance(body, dict) else None
        job_id = _check_name("job id", p[1])
        if not stop_job(self.server.root, job_id, reason if isinstance(reason, str) else "stopped by the farm"):
            raise HTTPError(404, f"job {job_id} is not running on this device")
        self._json(200, {"job_id": job_id, "stopped": True})

    def _job_answer(self, job: RunningJob) -> None:
        if job.busy:
            raise HTTPError(503, job.busy)
        if job.error:
            raise HTTPError(500, f"the agent failed to run job {job.job_id!r}: {job.error}")
        self._json(200, to_json(job.result))

    def get_job(self, p, q) -> None:
        job_id = p[1]
        out_dir = self.server.job_dir(job_id)
        job = self.server.jobs.get(job_id)
        if job is not None and not job.done.is_set():
            n, events = job.since(0)
            self._json(202, {"job_id": job_id, "status": "running", "events": n,
                             "last_event": events[-1] if events else None})
        elif job is not None:
            self._job_answer(job)
        elif (out_dir / "result.json").is_file():
            self._json(200, (out_dir / "result.json").read_text())
        else:
            raise HTTPError(404, f"no job {job_id!r} on this device")

    def get_events(self, p, q) -> None:
        job = self.server.jobs.get(p[1])
        if job is None:
            raise HTTPError(404, f"no job {p[1]!r} has run since this agent started")
        try:
            since = int(q.get("since", ["0"])[0])
        except ValueError:
            raise HTTPError(400, "since must be an integer") from None
        n, events = job.since(since)
        self._json(200, {"job_id": job.job_id, "next": n, "done": job.done.is_set(), "events": events})

    def get_artifact(self, p, q) -> None:
        out_dir = self.server.job_dir(p[1]).resolve()
        rel = _safe_relative("/".join(p[3:]))
        path = (out_dir / rel).resolve()
        if out_dir not in path.parents or not path.is_file():
            raise HTTPError(404, f"job {p[1]!r} has no file {rel!r}")
        size = path.stat().st_size
        self.send_response(200)
        self.send_header("Content-Type", "image/png" if path.suffix == ".png" else "application/octet-stream")
        self.send_header("Content-Length", str(size))
        self.send_header(PROTOCOL_HEADER, str(PROTOCOL_VERSION))
        self.end_headers()
        with open(path, "rb") as f:
            shutil.copyfileobj(f, self.wfile, CHUNK)


def _matches(pattern: list[str], parts: list[str]) -> bool:
    """`*` is one path segment, a trailing `**` one or more."""
    if pattern and pattern[-1] == "**":
        return len(parts) >= len(pattern) and _matches(pattern[:-1], parts[: len(pattern) - 1])
    return len(pattern) == len(parts) and all(a in ("*", b) for a, b in zip(pattern, parts, strict=True))


def make_server(root: Path, token: str, host: str = DEFAULT_HOST, port: int = 0, **kw) -> AgentServer:
    try:
        return AgentServer((host, port), root, token, **kw)
    except (OSError, socket.gaierror) as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def serve(root: Path, token_file: Path, host: str = DEFAULT_HOST, port: int = 8765, ready=None, *,
          tls_cert: Path | None = None, tls_key: Path | None = None,
          idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Serve until interrupted. `ready(server)` is called once it listens (tests, the demo)."""
    if (tls_cert is None) != (tls_key is None):
        raise ServeError("give both --tls-cert and --tls-key (the certificate and its private key), or neither")
    token = load_token(token_file)
    tls = tls_context(tls_cert, tls_key) if tls_cert is not None else None
    server = make_server(root, token, host, port, tls=tls, idle_timeout_s=idle_timeout_s)
    print(f"farm-agent serving on {server.url} (root {server.root}, protocol {PROTOCOL_VERSION})",
          file=sys.stderr, flush=True)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()

