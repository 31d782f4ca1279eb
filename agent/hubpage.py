"""A browser device's page, reached through the farm's hub (orchestrator/transports/hub.py): what
`farm-agent run` hands the engine as the session its browser executor runs plans on
(engine.browser.browser_pipeline(session=...)). The hub holds the page; this process reaches
it on the hub's farm side, which asks for the hub's key in HUB_KEY_HEADER.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from engine.errors import BrowserError
from engine.pagehost import reply_result

from .bundle import MANIFEST, SIGNATURE

HUB_KEY_HEADER = "X-Farm-Hub-Key"


def hub_request(url: str, key: str, method: str, body: bytes, timeout_s: float) -> dict[str, Any]:
    """One request to the farm side of a hub, its JSON answer; BrowserError "hub" for an HTTP
    error or a hub that cannot be reached."""
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


class HubPage:
    """A page a hub holds, reached at `url` (http://127.0.0.1:PORT/ctl/DEVICE?key=KEY): the
    session interface engine.browser.BrowserExecutor uses, where the page runs plans from the
    build deployed to it. The model folder must lie in an installed build
    (<agent root>/builds/<build>/...): the page takes shaders and weights from its verified
    copy of that build, never from here."""

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
        build_dir, prefix = build_of(model_dir)
        return {"plan_url": url, "plan_file_sha256": hashlib.sha256(body).hexdigest(), "build": build_dir.name,
                "model_prefix": prefix}

    def close(self) -> None:  # the hub's page outlives this process
        pass


def build_of(model_dir: Path | None) -> tuple[Path, str]:
    """(the installed build folder holding `model_dir`, the model's folder in it as "a/b/")."""
    if model_dir is None:
        raise BrowserError("input", "a page of a farm runs models of a deployed build; no model folder given")
    model_dir = Path(model_dir).resolve()
    for folder in (model_dir, *model_dir.parents):
        if (folder / MANIFEST).is_file() and (folder / SIGNATURE).is_file():
            rel = model_dir.relative_to(folder).as_posix()
            return folder, "" if rel == "." else rel + "/"
    raise BrowserError("input", f"{model_dir} is not in an installed build: the page runs only deployed builds")
