"""The dashboard as a folder that needs no server and no token (`farm dashboard build`): the
pages as `farm api serve` serves them, rendered for offline use, and every JSON document they
read, taken from the API's own routes in this process (a read caller stands in for the token)
and written as data/<path>.js, each calling `farm.offline(path, data)` (scripts, not .json
files: Chromium refuses fetch() from file://). Generated images are copied into data/images/."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from fastapi import FastAPI

from orchestrator import store
from orchestrator.analysis import series as farm_series
from orchestrator.dashboard import pages
from orchestrator.infra.settings import Settings
from orchestrator.store.models import ApiScope

from . import deps, tokens
from .app import create_app

SAFE_SEGMENT = re.compile(r"^[A-Za-z0-9._-]+$")
OWNED = ("static", "data")  # folders of the output that are the site's own, rewritten whole
# The file that marks a folder as one this farm wrote a dashboard into: only such a folder (or an
# empty or new one) is written, since writing it deletes its static/ and data/.
MARKER = ".devicefarm-dashboard"


class ExportError(RuntimeError):
    """A route answered an offline export with an error."""


def file_of(path: str) -> str:
    """The file a page reads `path` from offline (static/farm.js, fileOf, names them the same)."""
    segments = [unquote(s) for s in path.split("/") if s]
    return "data/" + "/".join(s if SAFE_SEGMENT.match(s) else "x" + s.encode().hex() for s in segments) + ".js"


async def _asgi_get(app: FastAPI, path: str) -> tuple[int, bytes]:
    """One GET through the app, in process (no lifespan: nothing is started)."""
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": unquote(path), "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"offline")], "client": ("127.0.0.1", 0), "server": ("offline", 80)}

    requested, done = False, asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()  # a streamed response listens for the client leaving until it is sent
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


class _Exporter:
    def __init__(self, app: FastAPI, out: Path):
        self.app, self.out = app, out

    def get(self, path: str) -> bytes:
        status, body = asyncio.run(_asgi_get(self.app, path))
        if status != 200:
            raise ExportError(f"GET {path} answered {status}: {body[:300].decode(errors='replace')}")
        return body

    def json(self, path: str) -> Any:
        data = json.loads(self.get(path))
        target = self.out / file_of(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"farm.offline({json.dumps(path)}, {json.dumps(data, ensure_ascii=False)});\n",
                          encoding="utf-8")
        return data


def export_site(settings: Settings, out_dir: Path | str) -> Path:
    """Write the offline dashboard into `out_dir`; returns its index.html. Images whose file is
    gone are left out (the page then says it could not read them)."""
    app = create_app(settings)
    reader = deps.Reader.__metadata__[0].dependency
    app.dependency_overrides[reader] = lambda: tokens.Caller(token_id=0, name="farm dashboard build",
                                                             scope=ApiScope.read)
    try:
        _write(app, Path(out_dir))
    finally:
        app.state.sessions.kw["bind"].dispose()
    return Path(out_dir) / "index.html"


def _image(export: _Exporter, out: Path, ref: dict | None) -> None:
    """An image a page shows, into data/images/ (once; one the store lost is left out: the page
    says it could not be read)."""
    if ref is None or (out / "data" / "images" / ref["file"]).exists():
        return
    try:
        body = export.get(ref["url"])
    except ExportError:
        return
    (out / "data" / "images").mkdir(parents=True, exist_ok=True)
    (out / "data" / "images" / ref["file"]).write_bytes(body)


def _check_out(out: Path) -> None:
    """Refuse a folder that holds anything but a dashboard of this farm's: its marker, or (one
    written before the marker) nothing but the site's own names with its index page."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out} is not a folder")
    names = {entry.name for entry in out.iterdir()}
    if not names or MARKER in names:
        return
    ours = set(OWNED) | set(pages.PAGES.values())
    index = out / "index.html"
    if names <= ours and index.is_file() and '<meta name="farm-mode"' in index.read_text(errors="replace"):
        return
    raise ExportError(f"it holds files that are not a dashboard this farm wrote (no {MARKER}), and writing one "
                      f"replaces its {' and '.join(f'{o}/' for o in OWNED)}; give a new or empty folder")


def _write(app: FastAPI, out: Path) -> None:
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("written by `farm dashboard build`: it replaces static/, data/ and the pages here\n")
    for owned in OWNED:
        shutil.rmtree(out / owned, ignore_errors=True)
    shutil.copytree(pages.STATIC, out / "static", ignore=shutil.ignore_patterns("pages"))
    for page, name in pages.PAGES.items():
        (out / name).write_text(pages.render(page, live=False), encoding="utf-8")
    export = _Exporter(app, out)
    export.json("/v1/overview")
    export.json("/v1/alerts")
    export.json("/v1/alert-groups")  # the open ones: the overview's alerts, a row per group
    with app.state.sessions() as session:
        series_ids = [s.id for s in farm_series.list_series(session)]
        alert_ids = store.alert_ids(session)
        serials = [d.serial for d in store.all_devices(session)]
        build_names = [b.name for b in store.builds_in_order(session)]
    for ident in series_ids:
        export.json(f"/v1/series/{ident}")
        export.json(f"/v1/series/{ident}/events")
        export.json(f"/v1/series/{ident}/kernels")
    for alert_id in alert_ids:
        export.json(f"/v1/alerts/{alert_id}")
        context = export.json(f"/v1/alerts/{alert_id}/context")
        for ref in context["images"].values():
            _image(export, out, ref)
    for name in build_names:
        path = f"/v1/builds/{quote(name, safe='')}"
        export.json(path)
        for ref in export.json(f"{path}/gallery")["images"]:
            _image(export, out, ref)
    for serial in serials:
        path = f"/v1/devices/{quote(serial, safe='')}"
        export.json(path)
        export.json(f"{path}/health")

