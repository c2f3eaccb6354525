"""The activation buffer: the hidden states of every calibration batch between two decoder layers.

It is the one thing in calibration that grows with the data (samples x tokens x hidden x 4
bytes), so above a budget it lives in a memory-mapped file instead of anonymous memory: the
kernel writes it back and evicts it under pressure, and peak memory stays one layer's weights
plus what the OS chooses to keep cached. Each layer reads batch j and writes its output over the
same slot, so the buffer never holds more than one copy of the activations.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from quantcli.errors import QuantcliError

BUDGET_ENV = "QUANTCLI_CALIBRATION_BUFFER_GIB"
DEFAULT_BUDGET_GIB = 2.0


def budget_bytes() -> int:
    raw = os.environ.get(BUDGET_ENV, str(DEFAULT_BUDGET_GIB))
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib < 0:
        raise QuantcliError(f"{BUDGET_ENV}={raw!r}: expected a number of GiB >= 0 (0 always spills to disk)")
    return int(gib * 2**30)


class ActivationBuffer:
    """FP32 hidden states of each batch: in memory up to `budget` bytes, each slot beyond it in a
    memory-mapped temporary file. A slot takes its shape from its first write (the hidden states
    a model hands its layers need not be [batch, tokens, hidden_size])."""

    def __init__(self, device: torch.device, budget: int):
        self.device = device
        self.budget = budget
        self.nbytes = 0  # in memory
        self._dir: Path | None = None
        self._slots: dict[int, torch.Tensor] = {}
        self._mapped: set[int] = set()

    @property
    def spilled(self) -> bool:
        return bool(self._mapped)

    def write(self, j: int, hidden: torch.Tensor) -> None:
        hidden = hidden.detach()
        old = self._slots.get(j)
        if old is not None and j in self._mapped and tuple(old.shape) == tuple(hidden.shape):
            old.copy_(hidden.to(torch.float32))
            return
        if old is not None and j not in self._mapped:
            self.nbytes -= old.numel() * 4
        size = hidden.numel() * 4
        if self.nbytes + size > self.budget and size > 0:
            self._slots[j] = self._map(j, hidden)
            return
        self._mapped.discard(j)
        self._slots[j] = hidden.to(torch.float32)
        self.nbytes += size

    def _map(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="quantcli-calibration-"))
        path = self._dir / f"batch-{j}.f32"
        with open(path, "wb") as f:  # reserve the space now: a full disk is an OSError here,
            os.posix_fallocate(f.fileno(), 0, hidden.numel() * 4)  # not a SIGBUS in the middle of a layer
        slot = torch.from_file(str(path), shared=True, size=hidden.numel(), dtype=torch.float32).view(hidden.shape)
        slot.copy_(hidden.to(torch.float32))
        self._mapped.add(j)
        return slot

    def read(self, j: int) -> torch.Tensor:
        slot = self._slots[j]
        return slot.to(self.device) if j in self._mapped else slot

    def close(self) -> None:
        self._slots, self._mapped, self.nbytes = {}, set(), 0
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> ActivationBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
