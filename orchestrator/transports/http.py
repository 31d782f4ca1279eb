"""The http transport: a network agent (`farm-agent serve`) on a Mac, a Linux or Windows GPU
host, or anything else reached over the network. Every request carries the bearer token and
the protocol version header; the agent's answers map onto the transport errors (401
unauthorized, 409 protocol mismatch, 503 busy). Deploys stage the signed manifest, ask
/v1/store/missing, PUT only those files (the agent writes each to a temporary name and renames
it whole; a file of more than one chunk from the bytes of it a cut upload left, which the
agent keeps a verified chunk at a time), then install. Jobs are posted without waiting and
followed through their event feed, so progress streams and a dead agent is noticed within the
request timeout, not at the end of the job's time limit.

An https agent is verified against the CA given as `ca_file` (for a farm device: the PEM file
<config_dir>/tokens/<serial>.ca.pem beside its token), else against the system's trusted CAs.
A redirect to another origin (scheme, host, port) is refused rather than followed: the token
goes to the device's own address and nowhere else."""

from __future__ import annotations

import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlsplit

from agent.protocol import (
    FILES,
    MANIFEST,
    PROTOCOL_HEADER,
    PROTOCOL_VERSION,
    SIGNATURE,
    DeviceInfo,
    JobSpec,
    Manifest,
    ManifestFile,
    ProtocolError,
    from_dict,
    from_json,
    to_json,
)
from orchestrator.transports.base import (
    MAX_REPLY_BYTES,
    AgentExit,
    BundleRefused,
    DeviceBusy,
    DeviceOffline,
    DeviceTimeout,
    DeviceUnauthorized,
    InfraFailure,
    ProgressFn,
    ProtocolMismatch,
    Transport,
    TransportError,
    emit,
    reply_too_large,
)

CHUNK = 1 << 20
CA_SUFFIX = ".ca.pem"  # <token file>.ca.pem: the CA that issued that agent's certificate


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(scheme)


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only within the agent's origin; urllib would otherwise resend every
    header, the bearer token included, to wherever the answer points."""

    def __init__(self, transport: HttpTransport):
        self.transport = transport

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if _origin(newurl) != _origin(req.full_url):
            fp.close()
            raise TransportError(self.transport.name, f"{req.get_method()} {urlsplit(req.full_url).path}: the agent "
                                 f"redirected (HTTP {code}) to another origin, {newurl}; not followed, so the token "
                                 f"stays with {self.transport.url} (check the device's URL)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class HttpTransport(Transport):
    """One network agent at `url` (http://host:8765 or https://...). `timeout_s` bounds each
    request; `poll_s` is how often a running job's events are fetched; `ca_file` is the CA an
    https agent's certificate must chain to (None: the system's trusted CAs)."""

    def __init__(self, url: str, token: str, *, timeout_s: float = 30.0, poll_s: float = 0.5,
                 job_margin_s: float = 120.0, name: str | None = None, ca_file: Path | None = None):
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s, self.poll_s, self.job_margin_s = timeout_s, poll_s, job_margin_s
        self.name = name or self.url.split("://", 1)[-1]
        self.ca_file = Path(ca_file).expanduser() if ca_file is not None else None
        self.ca_hint = "the transport's ca_file"  # where a user puts the CA; from_token_file names the file
        scheme = urlsplit(self.url).scheme.lower()
        if self.ca_file is not None and scheme != "https":
            raise TransportError(self.name, f"a CA file ({self.ca_file}) is given but the agent's URL {self.url} is "
                                 f"not https; serve the agent with --tls-cert/--tls-key and use https://")
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TransportError(self.name, f"cannot load the CA file {self.ca_file}: {exc}; give the PEM "
                                 "certificate of the CA that issued the agent's certificate") from None
        self._arrived: dict[str, int] | None = None  # of the deploy under way (prepare_deploy)
        self._opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context),
                                                   _SameOriginRedirects(self))

    @classmethod
    def from_token_file(cls, url: str, token_file: Path, **kw) -> HttpTransport:
        """The transport with the token in `token_file`; the agent's CA, unless given, is
        `token_file`.ca.pem when that file exists."""
        token_file = Path(token_file).expanduser()
        token = token_file.read_text().strip()
        if not token:
            raise TransportError(url, f"token file {token_file} is empty")
        ca_file = token_file.with_name(token_file.name + CA_SUFFIX)
        if kw.get("ca_file") is None and ca_file.is_file():
            kw["ca_file"] = ca_file
        transport = cls(url, token, **kw)
        transport.ca_hint = str(ca_file)
        return transport

    # ---- requests -----------------------------------------------------------------------------

    def _request(self, method: str, path: str, body=None, sink: Path | None = None,
                 offset: int = 0) -> tuple[int, bytes]:
        """(status, body) for 2xx answers; other statuses raise the matching TransportError.
        `body` may be bytes, a Path (streamed, from byte `offset`) or None. With `sink`, a 200
        body goes to that file."""
        headers = {"Authorization": f"Bearer {self.token}", PROTOCOL_HEADER: str(PROTOCOL_VERSION)}
        data = body
        if isinstance(body, Path):
            headers["Content-Length"] = str(body.stat().st_size - offset)
            data = open(body, "rb")  # noqa: SIM115  (closed below; urllib streams it)
            data.seek(offset)
        elif body is not None:
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                if sink is not None:
                    with open(sink, "wb") as f:
                        while chunk := resp.read(CHUNK):
                            f.write(chunk)
                    return resp.status, b""
                raw = resp.read(MAX_REPLY_BYTES + 1)
                if len(raw) > MAX_REPLY_BYTES:
                    raise reply_too_large(self.name, f"the answer to {method} {path}")
                return resp.status, raw
        except urllib.error.HTTPError as exc:
            raise self._status_error(exc.code, exc.read(), method, path) from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, ssl.SSLCertVerificationError):
                trusted = f"the CA in {self.ca_file}" if self.ca_file else "the system's trusted CAs"
                raise TransportError(self.name, f"{method} {path}: the agent's TLS certificate does not verify "
                                     f"against {trusted} ({reason.verify_message}); put the PEM certificate of "
                                     f"the CA that issued it in {self.ca_hint}") from None
            if isinstance(reason, TimeoutError | socket.timeout):
                raise DeviceTimeout(self.name, f"{method} {path}: no answer within {self.timeout_s:g} s") from None
            raise DeviceOffline(self.name, f"{method} {path}: {reason}") from None
        except TimeoutError:
            raise DeviceTimeout(self.name, f"{method} {path}: no answer within {self.timeout_s:g} s") from None
        except (ConnectionError, OSError) as exc:
            raise DeviceOffline(self.name, f"{method} {path}: connection lost ({exc})") from None
        finally:
            if isinstance(body, Path):
                data.close()

    def _status_error(self, status: int, raw: bytes, method: str, path: str) -> TransportError:
        try:
            message = json.loads(raw).get("error", "")
        except (ValueError, AttributeError):
            message = raw.decode(errors="replace")[:500]
        where = f"{method} {path}: HTTP {status}: {message}"
        if status == 401:
            return DeviceUnauthorized(self.name, f"{where} (check the token file given to `farm-agent serve`)")
        if status == 409:
            return ProtocolMismatch(self.name, where)
        if status == 503:
            return DeviceBusy(self.name, message)
        if status >= 500:
            return InfraFailure(self.name, where)
        return TransportError(self.name, where)

    def _json(self, method: str, path: str, body=None):
        status, raw = self._request(method, path, body)
        return status, json.loads(raw) if raw.strip() else None

    # ---- the Transport interface --------------------------------------------------------------

    def info(self) -> DeviceInfo:
        _, raw = self._request("GET", "/v1/info")
        try:
            return from_json(DeviceInfo, raw)
        except ProtocolError as exc:
            raise ProtocolMismatch(self.name, str(exc)) from None

    def installed_manifest_is(self, manifest_bytes: bytes, manifest: Manifest) -> bool:
        _, builds = self._json("GET", "/v1/builds")
        # Build ids are immutable on the agent; "current_damaged" lists its files no longer intact
        # (an agent without it predates the check: deploy again, it costs only a hash pass there).
        return (bool(builds) and builds.get("current") == manifest.build
                and builds.get("current_damaged", ["unknown"]) == [])

    def prepare_deploy(self, manifest_bytes: bytes, manifest: Manifest) -> list[ManifestFile]:
        _, answer = self._json("POST", "/v1/store/missing", manifest_bytes)
        try:
            lacking = [from_dict(ManifestFile, f) for f in answer["missing"]]
            # An agent that answers "arrived" takes a file's rest by ?offset= and keeps what
            # arrives of it chunk by chunk; an older one takes whole files only.
            arrived = answer.get("arrived")
            self._arrived = None if arrived is None else {str(k): int(v) for k, v in arrived.items()}
        except (ProtocolError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolMismatch(self.name, f"POST /v1/store/missing: {exc}") from None
        return lacking

    def arrived(self, f: ManifestFile) -> int:
        return (self._arrived or {}).get(f.sha256, 0)

    def push_file(self, manifest: Manifest, f: ManifestFile, source: Path, on_bytes) -> None:
        where = f"/v1/bundles/{quote(manifest.build)}/{FILES}/{quote(f.path)}"
        if self._arrived is not None and len(f.chunks) > 1:
            start = self.arrived(f)
            self._request("PUT", f"{where}?offset={start}", source, offset=start)
            on_bytes(f.size - start)
            return
        self._request("PUT", where, source)
        on_bytes(f.size)

    def push_signed(self, manifest: Manifest, bundle_dir: Path) -> None:
        for name in (MANIFEST, SIGNATURE):
            try:
                self._request("PUT", f"/v1/bundles/{quote(manifest.build)}/{name}", bundle_dir / name)
            except TransportError as exc:
                if type(exc) is TransportError:  # a 4xx: the agent refused the signature
                    raise BundleRefused(self.name, exc.detail) from None
                raise

    def install(self, manifest: Manifest, allow_downgrade: bool = False) -> str | None:
        query = "?allow_downgrade=1" if allow_downgrade else ""
        try:
            _, raw = self._request("POST", f"/v1/bundles/{quote(manifest.build)}/install{query}", b"")
        except TransportError as exc:
            if type(exc) is TransportError:  # a 4xx: the agent refused the bundle
                raise BundleRefused(self.name, exc.detail) from None
            raise
        try:
            kept = json.loads(raw).get("kept_current")
        except (ValueError, AttributeError):
            kept = None
        return kept if isinstance(kept, str) else None

    def stop_job(self, job_id: str, reason: str) -> bool:
        try:
            self._request("POST", f"/v1/jobs/{quote(job_id)}/stop", json.dumps({"reason": reason}).encode())
        except TransportError as exc:
            if type(exc) is TransportError and ": HTTP 404:" in exc.detail:  # not running there
                return False
            raise
        return True

    def exec_job(self, spec: JobSpec, limit_s: float, on_line, progress: ProgressFn | None) -> AgentExit:
        """Posted without waiting, then followed through the job's event feed (the agent sends
        events, not lines) until it answers with the JobResult."""
        status, raw = self._request("POST", "/v1/jobs", to_json(spec).encode())
        job = f"/v1/jobs/{quote(spec.job_id)}"
        deadline = time.monotonic() + limit_s
        seen = 0
        while status == 202:
            try:
                _, events = self._json("GET", f"{job}/events?since={seen}")
                for event in events["events"]:
                    emit(progress, event)
                seen = events["next"]
                status, raw = self._request("GET", job)
            except (DeviceOffline, DeviceTimeout) as exc:
                raise InfraFailure(self.name, f"job {spec.job_id}: lost the agent ({exc.detail})") from None
            if status == 202:
                if time.monotonic() > deadline:
                    raise InfraFailure(self.name, f"job {spec.job_id}: still running {limit_s:g} s after it started")
                time.sleep(self.poll_s)
        # The job may end between a fetch of its events and the next look at its status: what it
        # emitted in between (its "finished" among them) is fetched once more, best effort.
        try:
            _, events = self._json("GET", f"{job}/events?since={seen}")
            for event in events["events"]:
                emit(progress, event)
        except TransportError:
            pass
        return AgentExit(0, raw.decode(errors="replace"))

    def read_job_file(self, spec: JobSpec, path: str) -> bytes:
        try:
            return self._request("GET", f"/v1/jobs/{quote(spec.job_id)}/artifacts/{quote(path)}")[1]
        except TransportError as exc:
            if type(exc) is TransportError and "HTTP 404" in exc.detail:
                raise FileNotFoundError(f"{spec.job_id}/{path}") from None
            raise

    def fetch_job_file(self, spec: JobSpec, path: str, tmp: Path) -> None:
        self._request("GET", f"/v1/jobs/{quote(spec.job_id)}/artifacts/{quote(path)}", sink=tmp)
