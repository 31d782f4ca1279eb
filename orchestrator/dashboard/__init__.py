"""The self-contained HTML dashboard: `build_site` reads the store once (data), draws the trend
charts as inline SVG (charts) and writes a folder of static pages (site) that works offline,
from file:// or any static server, with no external script, font or stylesheet. `farm
dashboard build | serve` (orchestrator/cli/dashboard.py) is its command line."""

from .site import build_site

__all__ = ["build_site"]
