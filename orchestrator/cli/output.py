"""How `farm` writes for people: one rich Console kind for every command, and one Table that
every command's tables use. On a terminal a table fits the terminal without cutting anything a
person reads: a cell wraps at its words (a word longer than its column folds at a character,
never ends in "…"), and when the columns' narrowest widths still do not fit, the least
important columns are left out and a line under the table names them and how to see them.
Anywhere else (a pipe, a log file, CI, a test's captured output) a table is plain text for
tools: its title as a `# ` line, then a header row and one row per record, tab-separated, no box
drawing and no colour; `--json` is the machine format and stays as it is. Values a person must
read or copy whole (fingerprints, URLs, paths, build names) are printed as lines of their own
(`field`), never inside a table cell.

What devices report (a model, a GPU, a driver, an error) is data, never markup: rich would
read "[/]" in a phone's model as a closing tag and fail, and "[link=...]" as a link in the
operator's terminal. A table's text cells are plain text (`Table`; a styled cell is a
`Text`), and a message that mixes markup with values escapes them (`escape`)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable

from rich import table as rich_table
from rich.console import Console, ConsoleDimensions, ConsoleOptions, RenderableType, RenderResult
from rich.markup import escape
from rich.segment import Segment
from rich.text import Text

__all__ = ["FarmConsole", "Table", "Text", "console", "err_console", "escape", "field", "fit_help", "styled"]

# Wide enough for any table the CLI prints; rich sizes a table to its content within this.
UNBOUNDED_WIDTH = 10_000


class FarmConsole(Console):
    """No emoji codes: rich would turn the ":CD:" of a fingerprint (or ":ok:" in a path) into a
    picture."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    @property
    def size(self) -> ConsoleDimensions:
        if not self.is_terminal:
            return ConsoleDimensions(UNBOUNDED_WIDTH, super().size.height)
        return super().size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


class Table(rich_table.Table):
    """A rich table whose text cells are plain text, never markup (a styled cell: `styled`),
    that fits a terminal without cutting a cell and is plain TSV anywhere else.

    `drop_first`: the headers of the columns to leave out first when a terminal is too narrow
    for every column, most expendable first; after them columns go from the right. The first
    column and those named in `keep` always stay: when they alone are still too wide, their
    longest words fold at a character (never cut)."""

    def __init__(self, *headers: str | rich_table.Column, drop_first: Iterable[str] = (), keep: Iterable[str] = (),
                 **kwargs) -> None:
        super().__init__(*headers, **kwargs)
        self.drop_first = tuple(drop_first)
        self.keep = tuple(keep)

    def add_column(self, header: RenderableType = "", *args, overflow: str = "fold", **kwargs) -> None:
        # "fold" over rich's "ellipsis": a word longer than its column breaks at a character
        # rather than losing its end (`3,…`, `de…`); columns are dropped before that happens.
        super().add_column(header, *args, overflow=overflow, **kwargs)

    def add_row(self, *cells: RenderableType | None, **kwargs) -> None:
        super().add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in cells), **kwargs)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if not console.is_terminal:
            yield from _plain_lines(self, console, options)
            return
        shown, dropped = self._fitting_columns(console, options)
        table = copy.copy(self)
        table.columns = self._narrowed(console, options, shown)
        yield from rich_table.Table.__rich_console__(table, console, options)
        if dropped:
            yield Text(f"not shown at {options.max_width} columns: {', '.join(dropped)} (a wider terminal, "
                       "--json or piping the output shows every column)", style="dim")

    def _fitting_columns(self, console: Console, options: ConsoleOptions) -> tuple[list, list[str]]:
        """The columns whose narrowest widths (each cell's longest word) fit the width, and the
        headers of those left out. A table without headers (a record's fields, one a row) keeps
        every column: there would be no name to say what was left out."""
        if not self.show_header:
            return list(self.columns), []
        need = {id(c): self._narrowest(console, options, c)[0] for c in self.columns}
        headers = [_plain(console, c.header) for c in self.columns]
        order = [headers.index(h) for h in self.drop_first if h in headers]
        order += [i for i in range(len(self.columns) - 1, 0, -1) if i not in order]
        order = [i for i in order if i > 0 and headers[i] not in self.keep]
        shown = list(self.columns)
        dropped: list[str] = []
        for index in order:
            if sum(need[id(c)] for c in shown) + self._extra_width_of(len(shown)) <= options.max_width:
                break
            shown.remove(self.columns[index])
            dropped.append(headers[index])
        return shown, dropped

    def _narrowed(self, console: Console, options: ConsoleOptions, columns: list) -> list:
        """`columns`, each given a width when together they are wider than the terminal: the
        widest are narrowed first, none below its longest word. (rich narrows the widest
        columns without that floor, so a header such as "devices x metrics" broke mid-word.)"""
        floors, widths = map(list, zip(*(self._narrowest(console, options, c) for c in columns), strict=True))
        excess = sum(widths) + self._extra_width_of(len(columns)) - options.max_width
        if excess <= 0:
            return columns
        while excess > 0:
            narrowable = [i for i, w in enumerate(widths) if w > floors[i]]
            if not narrowable:
                break  # the columns kept are wider than the terminal even so: rich folds them
            top = max(widths[i] for i in narrowable)
            below = [widths[i] for i in narrowable if widths[i] < top]
            for i in (i for i in narrowable if widths[i] == top):
                cut = min(widths[i] - max(floors[i], max(below, default=0)), excess)
                widths[i] -= cut
                excess -= cut
        return [dataclasses.replace(c, width=w - self._get_padding_width(c._index))
                for c, w in zip(columns, widths, strict=True)]

    def _narrowest(self, console: Console, options: ConsoleOptions, column: rich_table.Column) -> tuple[int, int]:
        """A column's narrowest width (its longest word; all of its text when it must not wrap)
        and its natural width, padding included."""
        measured = self._measure_column(console, options.update_width(UNBOUNDED_WIDTH), column)
        return measured.maximum if column.no_wrap else measured.minimum, measured.maximum

    def _extra_width_of(self, columns: int) -> int:
        """What the box's edges and separators take around `columns` columns."""
        if not self.box:
            return 0
        return columns - 1 + (2 if self.show_edge else 0)


def _plain(console: Console, cell: RenderableType | None) -> str:
    """A cell as one line of plain text: no markup, no styles, tabs and newlines as spaces."""
    if cell is None:
        return ""
    if isinstance(cell, str):
        text = console.render_str(cell).plain
    elif isinstance(cell, Text):
        text = cell.plain
    else:
        options = console.options.update(width=UNBOUNDED_WIDTH, no_wrap=True)
        text = " ".join("".join(s.text for s in line).rstrip() for line in console.render_lines(cell, options))
    return " ".join(text.replace("\t", " ").split())


def _plain_lines(table: rich_table.Table, console: Console, options: ConsoleOptions) -> RenderResult:
    """The table for tools: `# title`, the header row, one row per record, tab-separated."""
    if table.title:
        yield Segment(f"# {_plain(console, table.title)}")
        yield Segment.line()
    rows = [[_plain(console, c.header) for c in table.columns]] if table.show_header else []
    cells = [list(c.cells) for c in table.columns]
    rows += [[_plain(console, column[r]) for column in cells] for r in range(table.row_count)]
    for row in rows:
        yield Segment("\t".join(row))
        yield Segment.line()
    if table.caption:
        yield Segment(f"# {_plain(console, table.caption)}")
        yield Segment.line()


def styled(text: object, style: str) -> Text:
    """`text` in `style`, as plain text: for a table cell or a message part."""
    return Text(str(text), style=style)


def field(out: Console, name: str, value: object, note: str = "") -> None:
    """`name: value` on a line of its own, the value whole (long values wrap with the line,
    never inside a cell)."""
    out.print(f"[bold]{escape(name)}:[/] {escape(str(value))}{escape(note)}", highlight=False, soft_wrap=True)


# ---- help ---------------------------------------------------------------------------------
# Typer's options panel is a rich table whose columns rich narrows with "…": at 80 columns
# `farm check --help` showed `--unet-repetitio…`, and every flag a `<bool>` type. This one keeps
# each option's names whole: names (and a value's type) in a column of their own beside the help
# where the terminal has room for both, else on a line of their own with the help under them.

HELP_MIN_WIDTH = 28  # the narrowest help column worth having beside the names


def _options_panel(*, name: str, params: list, ctx, markup_mode, console: Console) -> None:
    from rich.padding import Padding
    from rich.panel import Panel
    from rich.table import Table as RichTable
    from typer import rich_utils
    from typer.core import TyperArgument

    rows = []
    for param in params:
        if isinstance(param, TyperArgument):
            names = Text(param.display_name_raw + ("..." if param.nargs != 1 else ""), style=rich_utils.STYLE_OPTION)
        else:
            names = Text(" / ".join(", ".join(opts) for opts in (param.opts, param.secondary_opts) if opts),
                         style=rich_utils.STYLE_OPTION)
        kind = Text(style=rich_utils.STYLE_TYPES)
        if not (getattr(param, "is_flag", False) or getattr(param, "count", False)):
            kind.append(param.display_type_rich(ctx) or "")
            limits = param._get_number_range_help_str() if hasattr(param, "_get_number_range_help_str") else None
            if limits:
                kind.append(rich_utils.RANGE_STRING.format(limits))
        required = Text(rich_utils.REQUIRED_SHORT_STRING if param.required else "",
                        style=rich_utils.STYLE_REQUIRED_SHORT)
        rows.append((required, names, kind, rich_utils._get_parameter_help(param=param, ctx=ctx,
                                                                           markup_mode=markup_mode)))
    if not rows:
        return
    inside = console.width - 4  # the panel's edges and padding
    names_width = max(r[1].cell_len for r in rows)
    kind_width = max(r[2].cell_len for r in rows)
    table = RichTable(show_header=False, box=None, expand=True, pad_edge=False, padding=(0, 1))
    if 2 + names_width + 1 + kind_width + 1 + HELP_MIN_WIDTH <= inside:
        table.add_column(width=1, no_wrap=True)
        table.add_column(no_wrap=True, min_width=names_width)
        table.add_column(no_wrap=True, min_width=kind_width)
        table.add_column(ratio=1, overflow="fold")
        for row in rows:
            table.add_row(*row)
    else:  # too narrow for both: each option's names on their line, its help under them
        table.add_column(overflow="fold")
        for required, names, kind, help_ in rows:
            head = Text.assemble(required, " " if required.plain else "", names, " " if kind.plain else "", kind)
            table.add_row(head)
            if help_.renderables:
                table.add_row(Padding(help_, (0, 0, 0, 4)))
    console.print(Panel(table, border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=rich_utils.ALIGN_OPTIONS_PANEL))


def _flowing(paragraphs: list[str], markup_mode=None) -> str:
    """Help paragraphs as prose that flows to the terminal's width: a docstring's own line
    breaks (made for the source file) are spaces; a paragraph that starts with \\b keeps them."""
    return "\n\n".join(p.strip("\b\n") if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)


def _command_help(*, help_text: str, markup_mode) -> RenderableType:
    """A command's line in its group's list: the first paragraph of its help, flowing."""
    import inspect

    from typer import rich_utils

    first = _flowing([inspect.cleandoc(help_text).split("\n\n")[0]])
    return rich_utils._make_rich_text(text=first.removeprefix("\b").strip(),
                                      style=rich_utils.STYLE_OPTION_HELP, markup_mode=markup_mode)


def fit_help() -> None:
    """Every `--help` lays its options out as `_options_panel` does and lets its prose flow
    (called once, by the CLI)."""
    from typer import rich_utils

    rich_utils._print_options_panel = _options_panel
    rich_utils._make_command_help = _command_help
    rich_utils._fix_linebreaks = _flowing


console = FarmConsole()
err_console = FarmConsole(stderr=True)
