"""The dashboard's pages: one static HTML page (static/pages/page.html) given each page's title
and script, whose scripts read JSON, live from the farm API or offline from files beside them
(static/farm.js says how). `render(page, live=)`
gives a page as served by `farm api serve` (assets from the site's root, JSON from /v1 with
a token) or as written by `farm dashboard build` (relative assets, JSON from data/)."""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
# page -> the file it is written as, its title and its script
PAGES = {"overview": "index.html", "series": "series.html", "alert": "alert.html", "device": "device.html",
         "gallery": "gallery.html"}
TITLES = {"overview": "devicefarm overview", "series": "series · devicefarm", "alert": "alert · devicefarm",
          "device": "device · devicefarm", "gallery": "gallery · devicefarm"}
SCRIPTS = {"overview": "overview.js", "series": "series.js", "alert": "alert.js", "device": "device.js",
           "gallery": "gallery.js"}
MODE_MARK, TITLE_MARK, SCRIPT_MARK = "<!--farm:mode-->", "<!--farm:title-->", "<!--farm:script-->"


def render(page: str, *, live: bool) -> str:
    html = (STATIC / "pages" / "page.html").read_text(encoding="utf-8")
    head = ('<base href="/"><meta name="farm-mode" content="live">' if live
            else '<meta name="farm-mode" content="offline">')
    return (html.replace(MODE_MARK, head, 1).replace(TITLE_MARK, TITLES[page], 1)
            .replace(SCRIPT_MARK, SCRIPTS[page], 1))
