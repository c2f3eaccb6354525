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
Linears' (the tokens routed to it, and act(gate) * up), with the expert's reference rows of the
experts block the layer holds; expert stacks stored 3-D keep the weight rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from quantcli.calibrate.engine import Stats, StatsPass
from quantcli.formats.decode import decode_module
from quantcli.kernels.decode import apply_scale, scale_values
from quantcli.model.inputs import input_hooks
from quantcli.model.layers import LayerPass, walk_layers


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

    def __init__(self, stats: Stats, layout, targets: dict, device: torch.device):
        self.stats_pass, self.layout, self.targets, self.device = StatsPass(stats), layout, targets, device
        self.errors: dict[str, OutputError] = {}
        self._deltas: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(self, layer, prefix: str, weights, experts) -> list:
        hooks = self.stats_pass.observe(layer, prefix, weights, experts)
        self._reference = {m: w for m, w in reference_weights(layer, prefix, weights, experts).items()
                           if m in self.targets and tuple(w().shape) == tuple(self.targets[m][1].shape)}

        def record(module: str, x: torch.Tensor) -> None:
            if module in self._reference:
                self._record(module, x)

        return hooks + input_hooks(layer, prefix, weights, experts, record)

    def cache(self, prefix: str):
        return self.stats_pass.cache(prefix)

    def layer_done(self, layer, prefix: str, weights, cache) -> None:
        self.stats_pass.layer_done(layer, prefix, weights, cache)
        self._deltas.clear()  # one layer's decoded weights at a time

    def finish(self, stack, get, buffer, count: int) -> None:
        self.stats_pass.finish(stack, get, buffer, count)

    def _record(self, module: str, x: torch.Tensor) -> None:
        w = self._reference[module]().to(torch.float32)
        if module not in self._deltas:
            recipe, q = self.targets[module]
            d = decode_module(self.layout, module, recipe, q, device=w.device)
            self._deltas[module] = (d.sub_(w), round_to_scales(w, recipe, q).sub_(w))
        x = x.reshape(-1, w.shape[1]).to(torch.float32)
        dq, dr = self._deltas[module]
        e = self.errors.setdefault(module, OutputError())
        e.reference += float(torch.linalg.vector_norm(x @ w.T, dtype=torch.float64) ** 2)
        e.checkpoint += float(torch.linalg.vector_norm(x @ dq.T, dtype=torch.float64) ** 2)
        e.rounded += float(torch.linalg.vector_norm(x @ dr.T, dtype=torch.float64) ** 2)


def reference_weights(layer, prefix: str, weights, experts) -> dict[str, Callable[[], torch.Tensor]]:
    """{checkpoint module: its 2-D weight [out, in] in the loaded `layer`}: each Linear's, and each
    MoE expert's gate, up and down rows of its block's fused parameters (gate rows, then up rows,
    in `gate_up_proj`), read when called."""
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for sub, mod in layer.named_modules():
        if isinstance(mod, torch.nn.Linear):
            out[weights.checkpoint_module(prefix + sub)] = lambda mod=mod: mod.weight
        elif prefix + sub in experts and len(experts[prefix + sub].gate) > 1:  # per-expert Linears
            modules = experts[prefix + sub]
            for e in range(len(modules.gate)):
                gate, up, down = modules.of(e)
                out[gate] = lambda mod=mod, e=e: mod.gate_up_proj[e].chunk(2, dim=0)[0]
                out[up] = lambda mod=mod, e=e: mod.gate_up_proj[e].chunk(2, dim=0)[1]
                out[down] = lambda mod=mod, e=e: mod.down_proj[e]
    return out


def collect_with_outputs(config: dict, get, release, names, ids, batch: int, device, layout,
                         targets: dict) -> tuple[Stats, dict[str, OutputError]]:
    """calibrate.engine.collect's statistics, and the output errors of `targets`."""
    stats = Stats()
    job = OutputErrors(stats, layout, targets, device)
    walk_layers(config, get, release, names, ids, batch, device, job)
    return stats, job.errors
