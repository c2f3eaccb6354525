"""Tables whose first column is a tensor or module name, for the face (render.py): rows grouped
by layer pattern (quantcli/cli/grouping.py) unless the caller asks for one row per name, and names
that never lose their distinguishing tail.

A column either belongs to the grouping key (rows group only when those cells agree) or has a
`merge` that turns the group's values into one cell (a sum, a min..max range). When the table is
wider than the console, the dotted prefix most names share is replaced by `…` and named under
the table; whatever still does not fit wraps (overflow="fold"), so no cell is ever cut short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from quantcli.cli.grouping import group_names, natural_key, short_prefix

ELLIPSIS = "…"
# One rule per kind of number, in every table: errors to 4 significant digits with trailing zeros
# kept (0.09530 beside 0.09566), scales to 4 significant digits (%.4g: 3.342e-05, 0.0018).
ERROR = "{:#.4g}"
SCALE = "{:.4g}"


def counted(n: int, noun: str, plural: str | None = None, spec: str = "") -> str:
    """A count and its noun, singular only for one: `1 empty tensor`, `2 empty tensors`,
    `3 MoE routers/gates` (each `/` alternative takes the `s`); `spec` formats the number (`,`)."""
    word = noun if n == 1 else plural or "/".join(part + "s" for part in noun.split("/"))
    return f"{n:{spec}} {word}"


@dataclass(frozen=True)
class Column:
    header: str
    justify: str = "left"
    # None: the cell is part of the grouping key (a string); else it merges the group's values
    merge: Callable[[list], str] | None = None
    # a column the reader can do without (it repeats what others say): left out, and named under
    # the table, before the rows fall back to cards
    optional: bool = False


def value_range(fmt: str = "{:.4g}") -> Callable[[list], str]:
    """A merge: one value, or `min..max` of the group's values (None and missing ones skipped)."""

    def merge(values: list) -> str:
        present = [v for v in values if v is not None]
        if not present:
            return "-"
        lo, hi = min(present), max(present)
        return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}..{fmt.format(hi)}"

    return merge


def total(fmt: Callable[[float], str]) -> Callable[[list], str]:
    """A merge: the sum of the group's values, formatted."""
    return lambda values: fmt(sum(values))


def named_table(con: Console, name_header: str, names: Sequence[str], rows: Sequence[Sequence], columns:
                Sequence[Column], *, per_tensor: bool = False, title: str | None = None) -> Table:
    """The table, grouped by layer pattern with a count column unless `per_tensor`."""
    keyed = [i for i, c in enumerate(columns) if c.merge is None]
    if per_tensor:
        order = sorted(range(len(names)), key=lambda i: natural_key(names[i]))
        labels, members = [names[i] for i in order], [(i,) for i in order]
    else:
        groups = group_names(names, [tuple(r[i] for i in keyed) for r in rows])
        labels, members = [g.pattern for g in groups], [g.members for g in groups]
    cells = []
    for group in members:
        first = rows[group[0]]
        cells.append([c.merge([rows[m][i] for m in group]) if c.merge else first[i] for i, c in enumerate(columns)])
    counts = None if per_tensor else [str(len(g)) for g in members]
    return fitted_table(con, name_header, labels, cells, columns, counts=counts, title=title)


def fitted_table(con: Console, name_header: str, labels: Sequence[str], cells: Sequence[Sequence[str]],
                 columns: Sequence[Column], *, counts: Sequence[str] | None = None, title: str | None = None) -> Table:
    """The rows in the order given, each name whole: as they are when the table fits the console,
    else with the common dotted prefix cut, else as one card per row."""
    labels = list(labels)
    table = _build(name_header, labels, counts, cells, columns, title, prefix="")
    if _fits(con, table):
        return table
    prefix = short_prefix(labels)
    cut = [ELLIPSIS + label[len(prefix):] if prefix and label.startswith(prefix) else label for label in labels]
    if prefix:
        table = _build(name_header, cut, counts, cells, columns, title, prefix)
        if _fits(con, table):
            return table
    keep = [i for i, c in enumerate(columns) if not c.optional]
    if len(keep) < len(columns):
        table = _build(name_header, cut, counts, [[row[i] for i in keep] for row in cells],
                       [columns[i] for i in keep], title, prefix,
                       left_out=[c.header for c in columns if c.optional])
        if _fits(con, table):
            return table
    # Too narrow for one line per row: each row becomes its name on a line of its own, then its
    # cells as `header value` pairs (wrapped between pairs), so no name or value is squeezed.
    return _cards(name_header, labels, counts, cells, columns, title)


def _cards(name_header: str, labels: list[str], counts: list[str] | None, cells: list[list[str]],
           columns: Sequence[Column], title: str | None) -> Table:
    table = Table.grid(padding=(0, 0))
    table.title = title
    table.add_column(overflow="fold")
    for i, label in enumerate(labels):
        head = Text(label, style="bold")
        if counts is not None and counts[i] != "1":
            head.append(f"  ({counts[i]} {name_header}s)")
        pairs = [f"{c.header} {v}" for c, v in zip(columns, cells[i]) if v not in ("", "-")]
        table.add_row(head)
        table.add_row(Padding(Text(" · ".join(pairs)), (0, 0, 0, 4)))  # the indent holds on wrapped lines
    return table


def _build(name_header: str, labels: list[str], counts: list[str] | None, cells: list[list[str]],
           columns: Sequence[Column], title: str | None, prefix: str, left_out: Sequence[str] = ()) -> Table:
    notes = [f"{ELLIPSIS} = {prefix}"] if prefix else []
    if left_out:
        notes.append(f"left out to fit: {', '.join(left_out)} (--json has it)")
    caption = "; ".join(notes) or None
    table = Table(title=title, caption=caption, caption_justify="left")
    table.add_column(name_header, overflow="fold")
    if counts is not None:
        table.add_column("n", justify="right", overflow="fold")
    for c in columns:
        table.add_column(c.header, justify=c.justify, overflow="fold")
    for i, label in enumerate(labels):
        table.add_row(label, *([counts[i]] if counts is not None else []), *cells[i])
    return table


def _fits(con: Console, table: Table) -> bool:
    # measured as if the console were unbounded: the table's natural width, before rich squeezes it
    return Measurement.get(con, con.options.update_width(1 << 16), table).maximum <= con.width


__all__ = ["ERROR", "SCALE", "Column", "fitted_table", "named_table", "total", "value_range"]
