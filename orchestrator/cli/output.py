"""How `farm` writes for people: one rich Console kind for every command. On a terminal it fits
the terminal; anywhere else (a pipe, a log file, CI, a test's captured output) there is no width
to fit, so it is as wide as what it prints: tables keep every cell whole, whatever COLUMNS or the
parent process's terminal say. Values a person must read or copy whole (fingerprints, URLs,
paths, build names) are printed as lines of their own (`field`), never inside a table cell
that a narrow terminal would cut or fold.

What devices report (a model, a GPU, a driver, an error) is data, never markup: rich would
read "[/]" in a phone's model as a closing tag and fail, and "[link=...]" as a link in the
operator's terminal. A table's text cells are plain text (`Table`; a styled cell is a
`Text`), and a message that mixes markup with values escapes them (`escape`)."""

from __future__ import annotations

from rich import table as rich_table
from rich.console import Console, ConsoleDimensions, RenderableType
from rich.markup import escape
from rich.text import Text

__all__ = ["FarmConsole", "Table", "Text", "console", "err_console", "escape", "field", "styled"]

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
    """A rich table whose text cells are plain text, never markup (a styled cell: `styled`)."""

    def add_row(self, *cells: RenderableType | None, **kwargs) -> None:
        super().add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in cells), **kwargs)


def styled(text: object, style: str) -> Text:
    """`text` in `style`, as plain text: for a table cell or a message part."""
    return Text(str(text), style=style)


def field(out: Console, name: str, value: object, note: str = "") -> None:
    """`name: value` on a line of its own, the value whole (long values wrap with the line,
    never inside a cell)."""
    out.print(f"[bold]{escape(name)}:[/] {escape(str(value))}{escape(note)}", highlight=False, soft_wrap=True)


console = FarmConsole()
err_console = FarmConsole(stderr=True)
