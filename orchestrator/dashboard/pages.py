"""The dashboard's pages: static HTML (static/pages/) whose scripts read JSON, live from the
farm API or offline from files beside them (static/farm.js says how). `render(page, live=)`
gives a page as served by `farm api serve` (assets from the site's root, JSON from /v1 with
a token) or as written by `farm dashboard build` (relative assets, JSON from data/)."""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
PAGES = {"overview": "index.html", "series": "series.html", "alert": "alert.html", "device": "device.html"}
MODE_MARK = "<!--farm:mode-->"


def render(page: str, *, live: bool) -> str:
    html = (STATIC / "pages" / PAGES[page]).read_text(encoding="utf-8")
    head = ('<base href="/"><meta name="farm-mode" content="live">' if live
            else '<meta name="farm-mode" content="offline">')
    return html.replace(MODE_MARK, head, 1)
