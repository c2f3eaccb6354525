"""Which planned modules GPTQ can round: the 2-D Linears of the decoder (or encoder) layers,
which the layer walk runs (quantcli/model/layers.py). A module the options select for GPTQ
that is outside them (lm_head, a 3-D expert stack) is rounded to nearest, and the plan says so."""

from __future__ import annotations

from quantcli.model.stack import LAYER_TENSOR
from quantcli.planning.actions import Action
from quantcli.planning.plan import Plan, TensorPlan
from quantcli.planning.rounding import GPTQ


def gptq_reaches(t: TensorPlan) -> bool:
    return len(t.logical_shape) == 2 and bool(LAYER_TENSOR.match(t.name))


def unreached_warnings(plan: Plan) -> list[str]:
    """One line per kind of module selected for GPTQ that it cannot round."""
    rounding = plan.options.rounding
    if not rounding.data_aware:
        return []
    missed = [t for t in plan.tensors if t.action == Action.QUANTIZE and rounding.method_for(t.module) == GPTQ
              and not gptq_reaches(t)]
    stacks = [t.module for t in missed if len(t.logical_shape) != 2]
    outside = [t.module for t in missed if len(t.logical_shape) == 2]
    out = []
    if outside:
        out.append(f"--rounding gptq: {_names(outside)} outside the decoder layers: rounded to nearest "
                   f"(GPTQ rounds the Linears the layer walk runs)")
    if stacks:
        out.append(f"--rounding gptq: {_names(stacks)} 3-D expert stacks: rounded to nearest (GPTQ rounds "
                   f"2-D Linears, one per expert)")
    return out


def _names(modules: list[str]) -> str:
    shown = ", ".join(modules[:3])
    return f"{shown} and {len(modules) - 3} more" if len(modules) > 3 else shown
