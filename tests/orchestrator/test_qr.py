"""orchestrator/infra/qr.py: the terminal QR code, read back module by module. Each text line holds
two module rows as Unicode half blocks with light modules drawn; reading it back must give
segno's matrix of the URL (error correction M or better) inside a four-module light quiet
zone, in ceil((size + 8) / 2) lines of size + 8 characters."""

from __future__ import annotations

import math

import pytest
import segno

from orchestrator.infra.qr import QUIET_ZONE, qr_text

# character -> (top module dark, bottom module dark); light modules are the drawn ones
HALF_BLOCKS = {"█": (0, 0), "▀": (0, 1), "▄": (1, 0), " ": (1, 1)}

URLS = ["https://farm.lan/",
        "https://10.0.0.5:8443/run?device=phone-1&session=Zm9vYmFy",
        "https://farm.example.org:8443/" + "x" * 200]


def _read_back(text: str) -> list[list[int]]:
    """The module rows (1 = dark) the text draws."""
    rows: list[list[int]] = []
    for line in text.splitlines():
        pairs = [HALF_BLOCKS[c] for c in line]
        rows += [[top for top, _ in pairs], [bottom for _, bottom in pairs]]
    return rows


@pytest.mark.parametrize("url", URLS)
def test_the_text_draws_segnos_matrix_inside_a_quiet_zone(url):
    text = qr_text(url)
    qr = segno.make_qr(url, error="m")
    assert not qr.is_micro and qr.error in ("M", "Q", "H")
    size = len(qr.matrix)  # modules per side of the symbol
    side = size + 2 * QUIET_ZONE
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == math.ceil(side / 2)
    assert all(len(line) == side for line in lines)
    assert set(text) <= {*HALF_BLOCKS, "\n"}

    rows = _read_back(text)[:side]  # an odd side leaves the last line's lower half as padding
    symbol = [row[QUIET_ZONE:QUIET_ZONE + size] for row in rows[QUIET_ZONE:QUIET_ZONE + size]]
    assert symbol == [list(row) for row in qr.matrix]
    margin = rows[:QUIET_ZONE] + rows[-QUIET_ZONE:] + [r[:QUIET_ZONE] + r[-QUIET_ZONE:] for r in rows]
    assert not any(any(row) for row in margin)  # the quiet zone is light all round


def test_the_same_url_gives_the_same_text_and_another_url_another():
    assert qr_text(URLS[0]) == qr_text(URLS[0])
    assert qr_text(URLS[0]) != qr_text(URLS[0].replace("farm", "farn"))
