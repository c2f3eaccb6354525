"""verify --reference SRC --calibration DATA: each quantized Linear judged by its layer-output error.

The calibration rerun walks the reference model layer by layer (model/layers.py); here a pass
rides along with calibration's own (StatsPass) and, on every batch, gives each quantized Linear's
input x three products: x W^T (the reference's output), x (D - W)^T with D the checkpoint's
decoded weight, and x (R - W)^T with R the reference rounded to nearest under the checkpoint's
own stored scales. A quantization whose output error is at most judge.OUTPUT_MARGIN above R's is a
rounding of the reference to those scales, or better: round-to-nearest in any variant is within
a hair of R, a scale search's codes are R, GPTQ's error feedback lands below it. Swapped codes or
a rescaled block land far above. Output errors replace the weight-error rule of judge.py for
these modules (GPTQ's weight error may exceed it while its outputs are better); the gain, block
and scale rules stay. The inputs are model/inputs.py's: a Linear's own, and each MoE expert's
Linears' (where the experts block multiplies by that expert's weights), with the reference's
weight of each module read from the reference checkpoint; expert stacks stored 3-D keep the
weight rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.calibrate.engine import Stats, StatsPass
from quantcli.formats.decode import decode_module
from quantcli.kernels.decode import apply_scale, scale_values
from quantcli.model.inputs import input_hooks
from quantcli.model.layers import LayerPass, Weights, walk_layers


@dataclass
class OutputError:
    """Sums over the calibration tokens of one Linear: |x W^T|^2, |x (D - W)^T|^2, |x (R - W)^T|^2."""

    reference: float = 0.0
    checkpoint: float = 0.0
    rounded: float = 0.0

    def rel(self, sse: float) -> float:
        return (sse / self.reference) ** 0.5 if self.reference > 0 else sse ** 0.5


def round_to_scales(w: torch.Tensor, recipe, q) -> torch.Tensor:
    """R: the 2-D reference `w` rounded to nearest under `q`'s stored scales, decoded (FP32)."""
    spec = recipe.spec
    scale = torch.ones(w.shape, dtype=torch.float32, device=w.device)
    apply_scale(scale, scale_values(q.scale.to(w.device), None if q.global_scale is None else
                                    q.global_scale.to(w.device), spec), spec)
    dtype = q.scale.dtype if spec.scale.dtype is None else w.dtype  # a weight-dtype scale's quotient rounding
    values = spec.scale.scaled(w.to(torch.float32), scale, dtype)
    return spec.element.decode(spec.element.encode(values)).mul_(scale)


class OutputErrors(LayerPass):
    """Calibration's statistics pass, plus the three products per quantized Linear and batch.
    `targets`: checkpoint module -> (recipe, q) of the 2-D modules to judge."""

    def __init__(self, stats: Stats, layout, targets: dict, device: torch.device, get):
        self.stats_pass, self.layout, self.targets, self.device = StatsPass(stats), layout, targets, device
        self.get = get  # the reference's checkpoint tensors
        self.errors: dict[str, OutputError] = {}
        self._deltas: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def begin(self, stack) -> None:
        self.stats_pass.begin(stack)

    def observe(self, layer, prefix: str, names) -> list:
        hooks = self.stats_pass.observe(layer, prefix, names)

        def record(module: str, x: torch.Tensor, expert: int | None = None) -> None:
            if module in self.targets:
                self._record(module, x)

        return hooks + input_hooks(layer, prefix, names, record)

    def cache(self, layer, prefix: str):
        return self.stats_pass.cache(layer, prefix)

    def layer_done(self, layer, prefix: str, names, cache) -> None:
        self.stats_pass.layer_done(layer, prefix, names, cache)
        self._deltas.clear()  # one layer's decoded weights at a time

    def finish(self, stack, get, buffer, input_batches: list) -> list[str]:
        return self.stats_pass.finish(stack, get, buffer, input_batches)

    def _record(self, module: str, x: torch.Tensor) -> None:
        """The three products for `module` (a 2-D weight [out, in]; a 3-D stack keeps the weight rules)."""
        if module not in self._deltas:
            w = self.get(f"{module}.weight").to(x.device, torch.float32)
            if tuple(w.shape) != tuple(self.targets[module][1].shape):
                self.targets = {m: t for m, t in self.targets.items() if m != module}
                return
            recipe, q = self.targets[module]
            d = decode_module(self.layout, module, recipe, q, device=w.device)
            self._deltas[module] = (w, d.sub_(w), round_to_scales(w, recipe, q).sub_(w))
        w, dq, dr = self._deltas[module]
        x = x.reshape(-1, w.shape[1]).to(torch.float32)
        e = self.errors.setdefault(module, OutputError())
        e.reference += float(torch.linalg.vector_norm(x @ w.T, dtype=torch.float64) ** 2)
        e.checkpoint += float(torch.linalg.vector_norm(x @ dq.T, dtype=torch.float64) ** 2)
        e.rounded += float(torch.linalg.vector_norm(x @ dr.T, dtype=torch.float64) ** 2)


def collect_with_outputs(config: dict, source: Weights, ids, batch: int, device, layout,
                         targets: dict) -> tuple[Stats, dict[str, OutputError]]:
    """calibrate.engine.collect's statistics, and the output errors of `targets`."""
    stats = Stats()
    job = OutputErrors(stats, layout, targets, device, source.get)
    walk_layers(config, source, ids, batch, device, job)
    return stats, job.errors
