"""Layout for the console's width, shared by the terminal report and every check's detail view (built-in or a
plugin's): a table whose columns fit the width without cutting a word, and dim note lines.

Torch-free: views are drawn in a process that never loads torch or the checks themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text


@dataclass
class FitColumn:
    header: str
    justify: JustifyMethod = "left"
    style: str = ""
    whole: bool = False  # never wrapped (a shape, a number, a name); other columns wrap between words
    give_way: int | None = None  # at a width too narrow for every column, these are left out, lowest first


class FitTable:
    """A table laid out for the width it is rendered at. Every column gets at least its longest word (its longest
    cell, for a `whole` column), so no word is cut; the width left over goes to the columns with more to show. When
    even the words do not fit, the columns that may give way are left out, least needed first, and a line under the
    table says which; only when nothing is left to leave out does the widest column fold."""

    def __init__(self, columns: list[FitColumn], rows: list[list[Text]], title: str | None = None, **options):
        self.columns, self.rows, self.title, self.options = columns, rows, title, options

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        kept = list(range(len(self.columns)))
        while sum(map(self._least, kept)) > self._room(console, options, kept):
            giving_way = [i for i in kept if self.columns[i].give_way is not None]
            if not giving_way:
                break
            kept.remove(min(giving_way, key=lambda i: self.columns[i].give_way or 0))  # None: not in giving_way
        widths = self._widths(kept, self._room(console, options, kept))
        # A whole column narrowed below its longest cell (the last resort) folds like the others rather than crop.
        table = Table(
            *(
                Column(
                    self.columns[i].header,
                    justify=self.columns[i].justify,
                    style=self.columns[i].style,
                    no_wrap=self.columns[i].whole and width >= self._least(i),
                    overflow="fold",
                    width=width,
                )
                for i, width in zip(kept, widths, strict=True)
            ),
            title=self.title,
            title_justify="left",
            **self.options,
        )
        for row in self.rows:
            table.add_row(*(row[i] for i in kept))
        yield table
        left_out = [column.header for i, column in enumerate(self.columns) if i not in kept]
        if left_out:
            yield Text(f"{', '.join(left_out)}: left out to fit the width", style="dim")

    def _room(self, console: Console, options: ConsoleOptions, kept: list[int]) -> int:
        """The width the kept columns' contents share: the rest goes to padding and rules."""
        probe = Table(*(Column(width=1) for _ in kept), **self.options)
        return options.max_width - (Measurement.get(console, options, probe).maximum - len(kept))

    def _widths(self, kept: list[int], room: int) -> list[int]:
        least = [self._least(i) for i in kept]
        most = [
            max(
                self._least(i),
                _longest_line(Text(self.columns[i].header)),
                *(_longest_line(row[i]) for row in self.rows),
            )
            for i in kept
        ]
        if sum(most) <= room:
            return most
        widths = list(least)
        if sum(least) > room:  # even the words do not fit: the widest column folds, a column at a time
            while sum(widths) > room and max(widths) > 1:
                widths[widths.index(max(widths))] -= 1
            return widths
        # The spare width shared evenly, the columns that want least first: a short column gets all it wants and
        # stays on one line, the long ones share what is left.
        spare = room - sum(least)
        wanting = sorted(range(len(kept)), key=lambda n: most[n] - least[n])
        for k, n in enumerate(wanting):
            given = min(most[n] - least[n], spare // (len(wanting) - k))
            widths[n] += given
            spare -= given
        return widths

    def _least(self, i: int) -> int:
        """The narrowest a column can be without cutting a word or folding its header (a header of two words
        read one above the other names nothing). A cell that may be cut short (no_wrap with an ellipsis) asks for
        nothing."""
        column = self.columns[i]
        cells = [row[i] for row in self.rows]
        return max(
            [
                _longest_line(Text(column.header)),
                *(
                    (_longest_line(c) if column.whole else _longest_word(c))
                    for c in cells
                    if not (c.no_wrap and c.overflow == "ellipsis")
                ),
            ]
        )


def _longest_word(text: Text) -> int:
    return max((Text(word).cell_len for word in text.plain.split()), default=0)


def _longest_line(text: Text) -> int:
    return max((Text(line).cell_len for line in text.plain.splitlines()), default=0)


def notes(lines: Iterable[str | None] | None) -> list[Text]:
    """One dim line per note, with nothing to show for the empty ones."""
    return [Text(line, style="dim") for line in lines or [] if line]
