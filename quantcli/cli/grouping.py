"""Rows named by tensor or module names, grouped by layer pattern: the 2,048 expert rows of a
32-layer, 64-expert MoE read as one `model.layers.{0..31}.mlp.experts.{0..63}.down_proj` row.

Pure functions on names (no I/O, no printing), so inspect, convert --dry-run and any other
table share one rule:

- a dotted part written as a plain decimal (`0`, `17`, not `017`) is an index; names that agree
  everywhere else, and whose rows agree in every other column (the caller's `key`), are one group;
- a group's pattern is exact: it names every member and nothing else (`{0..3,5}` when 4 is
  missing). Index sets that are not a product (layer 5 has one expert fewer) are split into the
  fewest such boxes this simple rule finds, never widened;
- `short_prefix` picks the dotted prefix to drop when a table is too narrow, so that a cut name
  loses its common start and keeps its distinguishing tail.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from itertools import product

_INDEX = re.compile(r"0|[1-9][0-9]*")
_PART = re.compile(r"(?:\{[^}]*\}|[^.{])+")  # a dotted part; a {..} range stays whole

Box = tuple[frozenset[int], ...]  # one set of values per index position


@dataclass(frozen=True)
class Group:
    """One table row: the pattern that names exactly its members (indices into the input rows)."""

    pattern: str
    members: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.members)


def braces(values: Iterable[int]) -> str:
    """`5` for one value, else `{0..3,5}`: runs of three or more as a..b, the rest listed."""
    vals = sorted(set(values))
    if len(vals) == 1:
        return str(vals[0])
    parts, start = [], 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[i - 1] + 1:
            run = vals[start:i]
            parts.append(f"{run[0]}..{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)))
            start = i
    return "{" + ",".join(parts) + "}"


def natural_key(name: str) -> tuple:
    """Sort key that orders `layers.2` before `layers.10`."""
    return tuple((0, int(p), "") if _INDEX.fullmatch(p) else (1, 0, p) for p in name.split("."))


def _split(name: str) -> tuple[tuple[str | None, ...], tuple[int, ...]]:
    """(the name with each index part replaced by None, the indices in order)."""
    parts = name.split(".")
    skeleton = tuple(None if _INDEX.fullmatch(p) else p for p in parts)
    return skeleton, tuple(int(p) for p in parts if _INDEX.fullmatch(p))


def _boxes(points: set[tuple[int, ...]]) -> list[Box]:
    """Boxes (products of per-position value sets) that together hold exactly `points`."""
    width = len(next(iter(points)))
    if width == 0:
        return [()]
    columns = [frozenset(p[i] for p in points) for i in range(width)]
    size = 1
    for c in columns:
        size *= len(c)
    if size == len(points):
        return [tuple(columns)]
    # not a product: split on the first index, then give one box to the first values whose
    # remaining boxes are the same (layers 0-4 and 6-31 with 64 experts, layer 5 with 63)
    rest: dict[int, set[tuple[int, ...]]] = {}
    for p in points:
        rest.setdefault(p[0], set()).add(p[1:])
    same: dict[tuple[Box, ...], set[int]] = {}
    for first, tails in rest.items():
        inner = tuple(sorted(_boxes(tails), key=lambda b: tuple(sorted(min(c) for c in b))))
        same.setdefault(inner, set()).add(first)
    return [(frozenset(firsts), *box) for inner, firsts in same.items() for box in inner]


def _pattern(skeleton: tuple[str | None, ...], box: Box) -> str:
    values = iter(box)
    return ".".join(braces(next(values)) if p is None else p for p in skeleton)


def group_names(names: Sequence[str], keys: Sequence[Hashable] | None = None) -> list[Group]:
    """Rows grouped by layer pattern; rows group only when their keys are equal. The groups come
    in the natural order of their first member; members keep the input order."""
    keys = [None] * len(names) if keys is None else keys
    if len(keys) != len(names):
        raise ValueError(f"{len(names)} names but {len(keys)} keys")
    buckets: dict[tuple, dict[tuple[int, ...], list[int]]] = {}
    for row, (name, key) in enumerate(zip(names, keys)):
        skeleton, indices = _split(name)
        buckets.setdefault((skeleton, key), {}).setdefault(indices, []).append(row)
    groups = []
    for (skeleton, _), rows_at in buckets.items():
        for box in _boxes(set(rows_at)):
            members = sorted(r for point in product(*box) for r in rows_at[point])
            groups.append(Group(_pattern(skeleton, box), tuple(members)))
    return sorted(groups, key=lambda g: (min(natural_key(names[m]) for m in g.members), g.pattern))


def short_prefix(names: Sequence[str]) -> str:
    """The dotted prefix (ending in '.') that at least half of `names` share, leaving each of them
    a non-empty rest, and whose removal saves the most characters; '' when there is none.
    Dropping it from those names keeps every distinguishing tail."""
    if not names:
        return ""
    best = ""
    counts: dict[str, int] = {}
    for name in names:
        parts = _PART.findall(name)
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i]) + "."
            counts[prefix] = counts.get(prefix, 0) + 1
    saved = 0
    for prefix, n in counts.items():
        if 2 * n >= len(names) and (len(prefix) * n, len(prefix)) > (saved, len(best)):
            best, saved = prefix, len(prefix) * n
    return best


__all__ = ["Group", "braces", "group_names", "natural_key", "short_prefix"]
