"""What tables call builds: each build's label, else the distinguishing end of its name among
the builds the table shows (store.build_display_names), with the full names listed once under
the table (`legend`), where they can be read and copied whole."""

from __future__ import annotations

from collections.abc import Iterable

from .output import console, escape


def build_names(session, names: Iterable[str | None]) -> dict[str, str]:
    """{full name: what the table shows} for the builds `names` (None: a row with no build)."""
    from orchestrator import store

    return store.build_display_names(session, [n for n in names if n])


def legend(shown: dict[str, str]) -> None:
    """One line per build the table calls by another name: `A = demo-20261129T012011Z-a`."""
    for name, short in shown.items():
        if short != name:
            console.print(f"[bold]{escape(short)}[/] = {escape(name)}", highlight=False, soft_wrap=True)
