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
    """FP32 hidden states of each batch, in memory or (above the budget) in a temporary file."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device, budget: int):
        self.shapes = shapes
        self.device = device
        total = sum(math.prod(s) for s in shapes)
        self.nbytes = total * 4
        self.spilled = self.nbytes > budget and total > 0
        self._dir: Path | None = None
        self._slots: list[torch.Tensor | None] = [None] * len(shapes)
        if self.spilled:
            try:
                self._map(total)
            except BaseException:
                self.close()
                raise

    def _map(self, total: int) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="quantcli-calibration-"))
        path = self._dir / "activations.f32"
        with open(path, "wb") as f:  # reserve the space now: a full disk is an OSError here,
            os.posix_fallocate(f.fileno(), 0, self.nbytes)  # not a SIGBUS in the middle of a layer
        flat = torch.from_file(str(path), shared=True, size=total, dtype=torch.float32)
        offset = 0
        for j, s in enumerate(self.shapes):
            n = math.prod(s)
            self._slots[j] = flat[offset: offset + n].view(s)
            offset += n

    def write(self, j: int, hidden: torch.Tensor) -> None:
        if self.spilled:
            self._slots[j].copy_(hidden.detach().to(torch.float32))
        else:
            self._slots[j] = hidden.detach()

    def read(self, j: int) -> torch.Tensor:
        slot = self._slots[j]
        return slot.to(self.device) if self.spilled else slot

    def close(self) -> None:
        self._slots = [None] * len(self.shapes)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> ActivationBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
