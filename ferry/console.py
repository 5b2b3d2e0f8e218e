"""What the ``ferry`` commands print (Rich on a terminal, plain lines off one), and the
pieces of their command lines they share.

Scripts read the plain form (and ``--json``): columns two spaces apart, ``-``
for nothing, a progress line every few seconds. A person at a terminal gets
Rich tables and live bars. The choice is the stream's own ``isatty()``, not
Rich's guess (which ``FORCE_COLOR`` and ``TERM`` sway), so a pipe is always
plain.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Annotated, Any, Protocol

import typer

Row = Sequence[Any]
IdArgument = Annotated[str, typer.Argument(metavar="ID", show_default=False)]


def on_terminal(stream: IO[str] | None = None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty()
    except ValueError:  # a closed stream
        return False


def cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def plain_rows(columns: Sequence[str], rows: Sequence[Row]) -> list[str]:
    """The header and rows, each column padded to its widest cell, two spaces apart."""
    table = [list(columns), *([cell(v) for v in row] for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    return [
        "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]


def show_table(
    columns: Sequence[str],
    rows: Sequence[Row],
    plain: Callable[[Sequence[str], Sequence[Row]], list[str]] = plain_rows,
) -> None:
    """A Rich table on a terminal; off one, the lines ``plain`` makes (aligned columns)."""
    if not on_terminal():
        for line in plain(columns, rows):
            print(line)
        return
    from rich.box import SIMPLE_HEAD
    from rich.console import Console
    from rich.table import Table

    table = Table(*columns, box=SIMPLE_HEAD, header_style="bold")
    for row in rows:
        table.add_row(*(cell(v) for v in row))
    Console().print(table)


def show_fields(fields: Sequence[tuple[str, Any]]) -> None:
    """One object as ``name  value`` lines (a two-column grid on a terminal); None is left out."""
    shown = [(name, cell(value)) for name, value in fields if value is not None]
    if not on_terminal():
        width = max((len(name) for name, _ in shown), default=0)
        for name, value in shown:
            print(f"{name:{width}}  {value}")
        return
    from rich.console import Console
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    for name, value in shown:
        grid.add_row(name, value)
    Console().print(grid, markup=False)


def print_json(document: Any) -> None:
    """One JSON document on one line (a list is printed as one document per line by the caller)."""
    print(json.dumps(document, separators=(",", ":"), ensure_ascii=False))


def fail(message: str, code: int = 1) -> typer.Exit:
    """``error: <message>`` on stderr; raise what this returns to exit with ``code``."""
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code)


def one_of(*allowed: str) -> Callable[[str | None], str | None]:
    """The check of an option with fixed values, refused in argparse's words."""

    def check(value: str | None) -> str | None:
        if value is not None and value not in allowed:
            choices = ", ".join(repr(a) for a in allowed)
            raise typer.BadParameter(f"invalid choice: {value!r} (choose from {choices})")
        return value

    return check


def _choice(metavar: str, allowed: Sequence[str], help_: str) -> dict[str, Any]:
    return {
        "metavar": metavar,
        "callback": one_of(*allowed),
        "autocompletion": lambda: list(allowed),
        "help": help_,
        "show_default": False,
    }


def choice_option(flag: str, metavar: str, allowed: Sequence[str], help_: str) -> Any:
    """An option with fixed values: checked as :func:`one_of` does, and completed."""
    return typer.Option(flag, **_choice(metavar, allowed, help_))


def choice_argument(metavar: str, allowed: Sequence[str], help_: str) -> Any:
    """An argument with fixed values: checked as :func:`one_of` does, and completed."""
    return typer.Argument(**_choice(metavar, allowed, help_))


# --- progress bars -------------------------------------------------------------


class Bar(Protocol):
    def show(self, label: str, done: float, total: float, tail: str) -> None: ...

    def end(self) -> None: ...


class PlainBar:
    """A line every 5 s (and the last one at 100 %): logs and scripts read these."""

    def __init__(self, stream: IO[str], width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self._last = 0.0

    def show(self, label: str, done: float, total: float, tail: str) -> None:
        share = min(done / total, 1.0) if total else 0.0
        if time.monotonic() - self._last < 5 and share < 1.0:
            return
        self._last = time.monotonic()
        filled = int(share * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"{label} [{bar}] {share * 100:5.1f}%  {tail}\n")
        self.stream.flush()

    def end(self) -> None:
        pass


class RichBar:
    """A live Rich bar, redrawn in place; ``end`` leaves its last state on the screen."""

    def __init__(self, stream: IO[str]) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[tail]}", markup=False),
            console=Console(file=stream),
        )
        self.task: TaskID | None = None

    def show(self, label: str, done: float, total: float, tail: str) -> None:
        if self.task is None:
            self.progress.start()
            self.task = self.progress.add_task(label, total=total, tail=tail)
        self.progress.update(self.task, description=label, completed=done, total=total, tail=tail)

    def end(self) -> None:
        if self.task is not None:
            self.progress.stop()
            self.task = None


def progress_bar(stream: IO[str] | None = None) -> Bar:
    stream = sys.stderr if stream is None else stream
    return RichBar(stream) if on_terminal(stream) else PlainBar(stream)
