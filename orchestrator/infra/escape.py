"""Strings that leave the farm for another renderer, made inert for that renderer. Device
serials and models, kernel labels, build names, error texts and reasons come from devices and
from a pull request's own code: as Markdown they could close a code span and carry links,
images and @mentions, or shift a table's columns; as Slack mrkdwn `<!channel>` pings a channel
and `<url|text>` is a link; in an email header a CR or LF starts another header.

- `md_code(s)`: `s` as one Markdown code span (GitHub-flavoured), whatever it holds: a fence of
  more backticks than any run inside, line breaks as spaces, and in a table cell `|` escaped
  (GFM splits a row's cells before it reads code spans). Inside a code span nothing is a link,
  an image, markup or a mention.
- `slack(s)`: `&`, `<` and `>` as Slack's entities, so no control sequence (`<!here>`,
  `<@U123>`, `<https://...|...>`) survives, and line breaks kept.
- `header(s)`: one line for an email header: CR, LF and other control characters as spaces."""

from __future__ import annotations

import re

_BACKTICKS = re.compile(r"`+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f\u2028\u2029\x85]")


def md_code(s: object, *, table: bool = False) -> str:
    text = _CONTROL.sub(" ", str(s))
    if table:
        text = text.replace("|", "\\|")
    if not text.strip():
        return "` `"
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(text)), default=0) + 1)
    # CommonMark strips one space from each end of a code span that begins or ends with one;
    # pad where the text itself begins or ends with a backtick or a space
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def slack(s: object) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def header(s: object) -> str:
    return _CONTROL.sub(" ", str(s)).strip()
