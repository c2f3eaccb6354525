"""A weight pass's per-layer statistics, summed over the batches in one order whatever the number
of ranks, so that 1, 2 or 3 ranks hand the pass the same bits.

Floating-point addition is not associative: a sum's bits depend on the order of its terms. The
order here is the global batch order, S = ((P0 + P1) + P2) + ..., where Pb is batch b's partial
(itself the sum, in call order, of what the module recorded in that batch). Rank r of n runs
batches r, r + n, r + 2n, ... (the walk's split), so its j-th batch is global batch j * n + r,
in round j. After each round the ranks meet: each posts the names, shapes, dtypes and token
counts of its round's partials (JSON, through the store; nothing pickled), then one all_gather
carries the partials themselves, flattened to FP64 (exact for FP32, BF16 and FP64 statistics),
and the lead folds them in rank order, which is batch order. One process folds each batch as it
ends: the same additions in the same order. Memory: one partial per module per rank plus the
running sums, however many batches (a rank holding all its partials would grow with the data).
"""

from __future__ import annotations

import math

import torch

from quantcli.convert.world import World


class OrderedSum:
    """Per key (a checkpoint module): the sum of every batch's partial, in global batch order, and
    how many rows it sums over. Only the lead keeps the sums (`keep`); every rank must call
    `end_batch` after each of its batches and `finish` once, since the ranks meet there."""

    def __init__(self, world: World, batches: int, keep: bool):
        self.world = world
        self.rounds = math.ceil(batches / world.size)
        self.keep = keep
        self.folded = 0
        self._batch: dict[str, torch.Tensor] = {}
        self._batch_rows: dict[str, int] = {}
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    def add(self, key: str, partial: torch.Tensor, rows: int) -> None:
        """Part of this rank's current batch (a module recorded twice in one batch adds up here)."""
        now = self._batch.get(key)
        self._batch[key] = partial if now is None else now + partial
        self._batch_rows[key] = self._batch_rows.get(key, 0) + rows

    def end_batch(self) -> None:
        """This rank's current batch is complete: fold its round."""
        self._fold_round()

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """After this rank's last batch: the rounds it has no batch in (the others may), then the
        sums and row counts (empty on ranks that do not keep them)."""
        while self.folded < self.rounds:
            self._fold_round()
        return self.sums, self.rows

    def _fold_round(self) -> None:
        mine, rows = self._batch, self._batch_rows
        self._batch, self._batch_rows = {}, {}
        self.folded += 1
        if self.world.size == 1:
            self._fold(mine, rows)
            return
        posted = {k: [list(v.shape), str(v.dtype).removeprefix("torch."), rows[k]] for k, v in sorted(mine.items())}
        everyone = self.world.settle_all(lambda: posted)
        if not any(everyone):  # no rank recorded anything this round (every rank sees the same)
            return
        length = max(sum(math.prod(shape) for shape, _, _ in part.values()) for part in everyone)
        flat = torch.zeros(length, dtype=torch.float64)
        if mine:
            values = torch.cat([v.detach().reshape(-1).to("cpu", torch.float64) for _, v in sorted(mine.items())])
            flat[:values.numel()] = values
        for part, data in zip(everyone, self.world.all_gather(flat)):  # rank order = batch order
            self._fold(*_unflatten(part, data))

    def _fold(self, partials: dict[str, torch.Tensor], rows: dict[str, int]) -> None:
        if not self.keep:
            return
        for k in sorted(partials):  # in place: the same bits as s + p, without a K x K allocation a batch
            if k in self.sums:
                self.sums[k].add_(partials[k])
            else:
                self.sums[k] = partials[k].clone()
            self.rows[k] = self.rows.get(k, 0) + rows[k]


def _unflatten(posted: dict, data: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One rank's round back into {key: partial} (its own shape and dtype) and {key: rows}."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k, (shape, dtype, _) in posted.items():
        n = math.prod(shape)
        out[k] = data[offset:offset + n].reshape(shape).to(getattr(torch, dtype))
        offset += n
    return out, {k: rows for k, (_, _, rows) in posted.items()}

