"""Reading a planned module from the source: the dense weight, or the decoded module of a
quantized source. Shared by the passes and the per-shard job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.formats.decode import decode_module
from quantcli.planning.plan import Plan, TensorPlan
from quantcli.recipes import QuantizedTensor


@dataclass(frozen=True)
class ModuleReader:
    """Reads modules of `plan.source` onto `device`. Each worker holds its own (the open files in
    `tensors` are its only state, and they only cache reads)."""

    plan: Plan
    tensors: CheckpointTensors
    device: torch.device
    backend: str
    # The staging folder (a pass may keep what it learned there, for --resume) and the job's
    # progress callback (a pass reports its phase as `progress(0, "calibrating: ...")`).
    stage: Path | None = None
    progress: Callable[[int, str], None] | None = None

    def source_quantized(self, t: TensorPlan) -> QuantizedTensor:
        """A module of a quantized source, read through the source layout."""
        layout = self.plan.source_layout
        return layout.from_disk(t.module, layout.recipe_for(t.source_recipe), self.tensors.get, self.tensors.where)

    def weight(self, t: TensorPlan) -> torch.Tensor:
        """The weight to quantize, on the device, as [..., N, K]: the source tensor (transformed
        where the plan's transforms change it), or the decoded module of a quantized source."""
        if t.source_recipe is None:
            w = self.tensors.get(t.name).to(self.device)
            op = self.plan.transforms.get(t.name)
            if op is not None:  # an exact transform first (planning/transforms.py), in FP64 -> FP32
                w = op.apply(w)
            return w.transpose(-1, -2) if t.transpose else w
        layout = self.plan.source_layout
        return decode_module(layout, t.module, layout.recipe_for(t.source_recipe), self.source_quantized(t),
                             backend=self.backend, device=self.device)

    def source_tensor(self, name: str) -> torch.Tensor:
        """A source tensor by name as the output's model holds it: transformed where the plan's
        transforms change it (what a layer walk over the converted model loads)."""
        op = self.plan.transforms.get(name)
        return self.tensors.get(name) if op is None else op.apply(self.tensors.get(name))

    def inputs(self, t: TensorPlan) -> list[str]:
        """The source tensors a planned tensor reads."""
        if t.source_recipe is None:
            return [t.name]
        layout = self.plan.source_layout
        return [d.name for d in layout.describe(t.module, layout.recipe_for(t.source_recipe))]

    def release(self, t: TensorPlan) -> None:
        """Drop the source tensors `t` read (memory stays a few tensors whatever the shard size)."""
        for name in self.inputs(t):
            self.tensors.release(name)
