"""The two kinds of pass, as types, and how each kind's ranks combine what they found.

A *fact pass* learns small per-module values (ModuleFacts fields). Each rank computes partial
values over its share of the work (its shards, its calibration batches) and the ranks combine
them by max (`combined_max`); a max is exact, so any number of ranks ends with one process's
values bit for bit.

A *weight pass* produces the quantized tensors themselves (data-aware rounding). It runs the
source model layer by layer on the calibration data; per layer, a statistic per quantized module
is summed over the calibration rows in global batch order whatever the number of ranks
(`ordered_sum.py`), the pass turns each module's weight and statistic into its quantized tensor,
and the walk feeds the layer's quantized output forward (`weight_walk.py`). Its products are
staged in the staging folder and written by the shard job as they are (convert/staged.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import torch

from quantcli.convert.reading import ModuleReader
from quantcli.convert.world import World
from quantcli.formats.facts import ModuleFacts
from quantcli.planning.plan import Options, Plan, TensorPlan
from quantcli.recipes import QuantizedTensor, Recipe

Facts = dict[str, dict[str, object]]  # {module: {ModuleFacts field: value}}


class FactPass(Protocol):
    """What it learned, the same on every rank (partials combined by `combined_max`)."""

    def __call__(self, reader: ModuleReader, world: World) -> Facts: ...


def combined_max(values: Mapping[str, float], share: Callable[[object], list],
                 all_max: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """Each name's max over the ranks' partial `values` (non-negative: maxima of |x|), by name
    in sorted order; a name no rank has stays absent. `share(v)` returns every rank's JSON `v`,
    `all_max(t)` the elementwise max of `t` over the ranks (World.settle_all / World.all_max)."""
    names = sorted({n for part in share(sorted(values)) for n in part})
    missing = -1.0  # below every value, so a rank without the name never wins
    best = all_max(torch.tensor([values.get(n, missing) for n in names], dtype=torch.float64)).tolist()
    return {n: v for n, v in zip(names, best) if v != missing}


@dataclass(frozen=True)
class ModuleWork:
    """What a weight pass rounds one planned tensor from."""

    tensor: TensorPlan
    recipe: Recipe
    weight: torch.Tensor  # as the shard job would quantize it: [..., N, K], the source dtype, on the device
    statistic: torch.Tensor | None  # the sum over every batch's partial; None: no token reached the module
    tokens: int  # how many input rows the statistic sums over
    facts: ModuleFacts  # what the fact passes learned (fused-group amax, calibrated scales)
    backend: str
    options: Options  # the conversion's (a pass reads its own settings there)
    # a 3-D expert stack [E, N, K]: (statistic, tokens) of each expert (the tokens routed to it), else None
    experts: tuple[tuple[torch.Tensor | None, int], ...] | None = None


@dataclass(frozen=True)
class Rounded:
    """A pass's quantized tensor and its account of how it rounded it, which the manifest keeps
    for the module (`rounding`) and, when `note` is set, the summary and manifest notes say."""

    q: QuantizedTensor
    record: dict
    note: str | None = None


class WeightPass(Protocol):
    """A pass whose product is quantized tensors. `name` is recorded with every staged layer
    (a resumed run of another pass is refused)."""

    name: str

    def takes(self, plan: Plan, t: TensorPlan) -> bool:
        """Whether this pass produces `t`'s tensors (a quantized Linear a decoder layer reads);
        the shard job quantizes the rest as usual."""

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        """The partial statistic of a module from a group of its input rows `x` [rows, K] (as
        recorded: FP32 or BF16; FP64 holding those values where the group joins several batches'),
        e.g. X^T X in FP64; additive over rows: the walk sums it over consecutive groups of rows
        in global batch order (ordered_sum.py), a group holding one batch's rows or several's."""

    def quantize(self, work: ModuleWork) -> QuantizedTensor | Rounded:
        """The module's quantized tensor: `work.recipe`'s codes and scales for `work.tensor`'s
        logical shape, as `Recipe.quantize` returns them (the layout writes it), with or without
        an account of the rounding."""

    def matmul_dtype(self, plan: Plan) -> torch.dtype | None:
        """The dtype the walk runs the layers' matmuls in for this pass (model/layers.py
        matmuls_in), None for FP32."""

    def feeds_quantized(self, plan: Plan) -> bool:
        """Whether the next layer's inputs come from this layer as quantized (sequential, as
        GPTQ compensates errors downstream) rather than from the source's own weights."""
