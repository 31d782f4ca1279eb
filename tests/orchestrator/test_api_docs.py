"""The farm API's documentation pages work with no internet (issue 41): /docs and /redoc loaded
Swagger UI and ReDoc from a CDN (FastAPI's defaults) and were blank on the farm's offline
machines. They are vendored (orchestrator/api/static/vendor) and served by the API itself:

- /docs and /redoc name only the farm's own asset URLs, which answer with the scripts;
- the vendored files ship in the package;
- headless Chromium, with no route to the internet, renders Swagger UI's operations."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from asgi_server import serving
from fastapi.testclient import TestClient
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_dashboard_live import browser  # noqa: F401  (the shared headless Chromium fixture)

from orchestrator.api.app import DOCS_ASSETS, create_app
from orchestrator.infra.settings import Settings
from orchestrator.store import upgrade

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-docs")
    settings = Settings(data_dir=tmp / "data", config_dir=tmp / "config", host_name="h")
    upgrade(settings.database_url)
    return create_app(settings)


@pytest.mark.parametrize(("page", "scripts"), [("/docs", ["swagger-ui-bundle.js"]),
                                               ("/redoc", ["redoc.standalone.js"])])
def test_the_docs_pages_load_only_the_farms_own_assets(api, page, scripts):
    with TestClient(api) as client:
        html = client.get(page).text
        urls = re.findall(r'(?:src|href)="([^"]*)"', html)
        assert urls and [u for u in urls if u.startswith(("http:", "https:", "//"))] == [], urls
        assert "fonts.googleapis" not in html and "cdn.jsdelivr" not in html
        for name in scripts:
            (url,) = [u for u in urls if u.endswith(name)]
            script = client.get(url)
            assert script.status_code == 200 and "javascript" in script.headers["content-type"]
            assert len(script.content) > 500_000  # the whole bundle, not a stub
        policy = client.get(page).headers["content-security-policy"]
        assert "http" not in policy and "frame-ancestors 'none'" in policy  # nothing from elsewhere


def test_the_vendored_docs_assets_ship_in_the_package():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "orchestrator.api"]
    files = [p.relative_to(DOCS_ASSETS.parent.parent).as_posix() for p in DOCS_ASSETS.rglob("*") if p.is_file()]
    assert "static/vendor/swagger-ui/swagger-ui-bundle.js" in files and len(files) >= 9
    assert [f for f in files if not any(fnmatch.fnmatch(f, p) and f.count("/") == p.count("/")
                                        for p in patterns)] == []


def test_swagger_ui_renders_offline(api, browser):  # noqa: F811
    """This machine has no route to the internet: a CDN asset would never load."""
    with serving(api) as base:
        browser.get(f"{base}/docs")
        WebDriverWait(browser, 20).until(lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
        paths = {e.get_attribute("data-path") for e in browser.find_elements(By.CSS_SELECTOR,
                                                                              ".opblock-summary-path")}
        assert "/v1/alerts/{alert_id}/acknowledge" in paths and "/v1/me" in paths
