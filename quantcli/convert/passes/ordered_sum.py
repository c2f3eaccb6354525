"""A weight pass's per-layer statistics, summed over the calibration rows in one order whatever
the number of ranks, so that 1, 2 or 3 ranks hand the pass the same bits.

Floating-point addition is not associative: a sum's bits depend on the order of its terms and on
how they are grouped. What the ranks ship is each batch's input rows, not a statistic of them:
the lead appends every batch's rows to the key's pending rows in global batch order, and when
they reach `group_rows(K)` it computes the pass's statistic of them at once (X^T X of all those
rows: one large matmul instead of one K x K product, allocation and addition per batch, which
for short batches cost more than the products themselves) and adds it to the key's sum:
S = ((stat(G0) + stat(G1)) + stat(G2)) + ..., the groups Gi consecutive rows in batch order. The
groups depend only on the rows' order and K, never on which rank ran a batch.

Rank r of n runs batches r, r + n, r + 2n, ... (the walk's split), so its j-th batch is global
batch j * n + r, in round j. After each round the ranks meet: each posts the names, shapes,
dtypes and row counts of its round's rows (JSON, through the store; nothing pickled), then one
all_gather carries the rows themselves, flattened to FP64 (exact for FP32, BF16 and FP64 rows),
and the lead appends them in rank order, which is batch order. One process appends each batch as
it ends: the same rows in the same order. Memory: the pending rows of a key never outgrow its
sum (group_rows(K) x K FP32 values <= K x K FP64 ones), plus one round's rows.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from quantcli.convert.world import World

GROUP_ROWS = 4096  # rows per statistic product, at most: past a few thousand a matmul is no faster per row


def group_rows(k: int) -> int:
    """How many pending rows of width `k` make a group: GROUP_ROWS, or fewer where that many FP32
    rows would take more memory than the K x K FP64 sum they go into."""
    return max(1, min(GROUP_ROWS, 2 * k))


class OrderedSum:
    """Per key (a checkpoint module): `statistic(rows)` summed over groups of its input rows in
    global batch order, and how many rows it sums over. Only the lead keeps the sums (`keep`);
    every rank must call `end_batch` after each of its batches and `finish` once, since the
    ranks meet there."""

    def __init__(self, world: World, batches: int, keep: bool, statistic: Callable[[torch.Tensor], torch.Tensor]):
        self.world = world
        self.rounds = math.ceil(batches / world.size)
        self.keep = keep
        self.statistic = statistic
        self.folded = 0
        self._batch: dict[str, list[torch.Tensor]] = {}
        self._pending: dict[str, list[torch.Tensor]] = {}  # the lead's rows not yet in a group's product
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    def add(self, key: str, rows: torch.Tensor) -> None:
        """Input rows [tokens, K] of this rank's current batch (a module recorded twice in one
        batch ships both). Copied: the walk's tensors may change before the group is computed."""
        self._batch.setdefault(key, []).append(rows.detach().clone())

    def end_batch(self) -> None:
        """This rank's current batch is complete: fold its round."""
        self._fold_round()

    def finish(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """After this rank's last batch: the rounds it has no batch in (the others may), the last
        groups, then the sums and row counts (empty on ranks that do not keep them)."""
        while self.folded < self.rounds:
            self._fold_round()
        for k in sorted(self._pending):
            self._product(k)
        return self.sums, self.rows

    def _fold_round(self) -> None:
        mine = {k: v[0] if len(v) == 1 else torch.cat(v) for k, v in self._batch.items()}
        self._batch = {}
        self.folded += 1
        if self.world.size == 1:
            self._fold(mine)
            return
        posted = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in sorted(mine.items())}
        everyone = self.world.settle_all(lambda: posted)
        if not any(everyone):  # no rank recorded anything this round (every rank sees the same)
            return
        length = max(sum(math.prod(shape) for shape, _ in part.values()) for part in everyone)
        flat = torch.zeros(length, dtype=torch.float64)
        if mine:
            values = torch.cat([v.reshape(-1).to("cpu", torch.float64) for _, v in sorted(mine.items())])
            flat[:values.numel()] = values
        for part, data in zip(everyone, self.world.all_gather(flat)):  # rank order = batch order
            self._fold(_unflatten(part, data))

    def _fold(self, batch: dict[str, torch.Tensor]) -> None:
        """One batch's rows, in batch order: pending until they make a group."""
        if not self.keep:
            return
        for k in sorted(batch):
            pending = self._pending.setdefault(k, [])
            pending.append(batch[k])
            self.rows[k] = self.rows.get(k, 0) + batch[k].shape[0]
            if sum(x.shape[0] for x in pending) >= group_rows(batch[k].shape[-1]):
                self._product(k)

    def _product(self, k: str) -> None:
        """The statistic of key k's pending rows, added to its sum in place (the same bits as
        s + p, without a K x K allocation)."""
        pending = self._pending.pop(k)
        part = self.statistic(pending[0] if len(pending) == 1 else _joined(pending))
        del pending
        if k in self.sums:
            self.sums[k].add_(part)
        else:
            self.sums[k] = part


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    """Consecutive row chunks as one FP64 tensor (the exact values of FP32, BF16 and FP64 rows),
    copied once: the statistics compute in FP64, and joining in the chunks' dtype first would
    copy every row twice (1.4 of a 2-layer run's 12.5 s of statistics went to such copies)."""
    out = torch.empty(sum(c.shape[0] for c in chunks), chunks[0].shape[-1], dtype=torch.float64,
                      device=chunks[0].device)
    at = 0
    for c in chunks:
        out[at:at + c.shape[0]].copy_(c)
        at += c.shape[0]
    return out


def _unflatten(posted: dict, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """One rank's round back into {key: rows} (their own shape and dtype)."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for k, (shape, dtype) in posted.items():
        n = math.prod(shape)
        out[k] = data[offset:offset + n].reshape(shape).to(getattr(torch, dtype))
        offset += n
    return out
