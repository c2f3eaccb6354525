"""The calibration pass: data -> layer-by-layer statistics -> ModuleFacts (convert/passes.py)."""

from __future__ import annotations

import sys
import time

import torch

from ..plan import Plan
from .data import token_ids
from .engine import collect
from .scales import scale_facts


def calibrate(plan: Plan, tensors, device: torch.device) -> dict[str, dict[str, object]]:
    """{module: {ModuleFacts field: value}} from running the source over the calibration data."""
    cal = plan.options.calibration
    if cal is None:
        return {}
    ids = token_ids(cal, plan.source.root)
    names = {n for header in plan.source.headers.values() for n in header.tensors}
    stats = collect(plan.source.config, tensors.get, tensors.release, names, ids, cal.batch, device,
                    progress=_LayerProgress() if sys.stderr.isatty() else None)
    return scale_facts(plan, stats)


class _LayerProgress:
    """One self-overwriting stderr line: `calibrating: layer 3/32, 128 samples, 4.1 s/layer (31.2 samples/s)`."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, samples: int) -> None:
        per_layer = (time.monotonic() - self.start) / done
        end = "\n" if done == total else ""
        print(f"\rcalibrating: layer {done}/{total}, {samples} samples, {per_layer:.1f} s/layer "
              f"({samples / max(per_layer, 1e-9):.1f} samples/s)", end=end, file=sys.stderr, flush=True)
