"""QR codes for the terminal, so that a phone's camera can open one of the farm's URLs without
anyone typing it: segno encodes the URL and writes it with Unicode half blocks, two rows of
modules per line of text, inside the four-module quiet zone the QR standard asks for."""

from __future__ import annotations

import io

import segno

QUIET_ZONE = 4  # modules of light margin on every side (ISO/IEC 18004)


def qr_code(url: str) -> segno.QRCode:
    """The QR code of `url` (a full QR code, never a Micro QR code, which phone cameras do not
    read; error correction M or better, segno raising it where the size allows)."""
    return segno.make_qr(url, error="m")


def qr_text(url: str) -> str:
    """`url` as a QR code of Unicode half blocks, one text line per two module rows.

    Light modules are the drawn ones (a terminal draws text light on a dark background), so the
    code reads dark-on-light as a scanner expects on a dark terminal; the quiet zone is drawn
    too, which is what lets a camera find the code on a dark screen."""
    out = io.StringIO()
    qr_code(url).terminal(out, border=QUIET_ZONE, compact=True)
    return out.getvalue()
