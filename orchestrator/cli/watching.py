"""How the CLI shows long work (orchestrator/services/progress.py watches it): on a terminal a
live table of each device's step, with the hosts no worker serves under it; anywhere else (a
pipe, CI's log) one plain line per change, the no-worker line when it appears and every
reminder ("still waiting after 90 s: ..."), so a piped command is never silent for long. With
--json, stdout keeps the document alone: the no-worker and reminder lines go to stderr."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Group, RenderableType
from rich.live import Live
from rich.text import Text

from orchestrator.services import progress as watched

from .output import Table, console, err_console


def steps_table(title: str) -> Callable[[watched.Progress], RenderableType]:
    """The default live view: one row per step."""
    def render(p: watched.Progress) -> RenderableType:
        table = Table("device", "work", "state", "sent", "note", title=f"{title}: {p.counts()}, {p.elapsed_s:.0f} s")
        for s in p.steps:
            sent = "-" if s.sent is None else watched.mib(s.sent) + (f" / {watched.mib(s.total)}" if s.total else "")
            table.add_row(s.device, s.what, s.state, sent, s.note)
        return table
    return render


class Reporter:
    """A progress.watch `report` for the CLI; a context manager around the watch. Piped, the
    view is printed once at the end too (`summary`), as the live table leaves it on a terminal."""

    def __init__(self, title: str, *, quiet: bool = False,
                 view: Callable[[watched.Progress], RenderableType] | None = None, summary: bool = True):
        self.quiet, self.view, self.summary = quiet, view or steps_table(title), summary
        self.live = console.is_terminal and not quiet
        self._live: Live | None = None
        self._last: watched.Progress | None = None

    def __enter__(self) -> Reporter:
        if self.live:
            self._live = Live(console=console, auto_refresh=False, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()
        elif self.summary and not self.quiet and self._last is not None and exc[0] is None:
            console.print(self.view(self._last))

    def __call__(self, p: watched.Progress) -> None:
        self._last = p
        if self._live is not None:
            view = self.view(p)
            if p.silent:
                view = Group(view, *(Text(line, style="yellow") for line in p.silence_lines()))
            self._live.update(view, refresh=True)
            return
        if self.quiet:  # the document alone on stdout: only what must not go unsaid, on stderr
            lines = (p.silence_lines() if p.why in ("silence", "remind") else []) + \
                ([p.reminder()] if p.why == "remind" else [])
        else:
            lines = watched.lines(p)
        for line in lines:
            (err_console if self.quiet else console).print(line, highlight=False, soft_wrap=True, markup=False)
