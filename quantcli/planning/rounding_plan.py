"""Which planned modules GPTQ can round: the Linears and 3-D expert stacks of the decoder (or
encoder) layers, which the layer walk runs (quantcli/model/layers.py). A module the options
select for GPTQ that is outside them (lm_head) is rounded to nearest, and the plan says so."""

from __future__ import annotations

from quantcli.errors import QuantcliError
from quantcli.planning.actions import Action
from quantcli.planning.plan import Plan, TensorPlan
from quantcli.planning.rounding import GPTQ
from quantcli.recipes import RECIPES
from quantcli.rounding.spans import scales_per_span


def gptq_reaches(plan: Plan, t: TensorPlan) -> bool:
    """A weight inside one of the layers the walk runs (plan.walk, set with --calibration): a 2-D
    Linear, or a 3-D expert stack (rounded expert by expert, each from the tokens routed to it)."""
    return len(t.logical_shape) in (2, 3) and plan.walk is not None and plan.walk.layer_of(t.name) is not None


def unreached_warnings(plan: Plan) -> list[str]:
    """One line per kind of module selected for GPTQ that it cannot round."""
    rounding = plan.options.rounding
    if not rounding.data_aware:
        return []
    missed = [t for t in plan.tensors if t.action == Action.QUANTIZE and rounding.method_for(t.module) == GPTQ
              and not gptq_reaches(plan, t)]
    outside = [t.module for t in missed]
    if not outside:
        return []
    return [f"--rounding gptq: {_names(outside)} outside the decoder layers: rounded to nearest (GPTQ rounds "
            f"the Linears and expert stacks the layer walk runs)"]


def check_scales_option(plan: Plan) -> None:
    """A scale choice the user gave (--gptq-scales, gptq_scales in --config) is refused where
    every module GPTQ rounds has per-tensor or per-row scales: those come from the original
    weights either way, so it would change nothing (as --scale-search and --scale-rule are
    refused for recipes that do not take them)."""
    rounding = plan.options.rounding
    if rounding.scales_given is None:
        return
    rounded = {t.recipe for t in plan.tensors if t.action == Action.QUANTIZE and
               rounding.method_for(t.module) == GPTQ and gptq_reaches(plan, t)}
    if rounded and not any(scales_per_span(plan.recipes[r].spec) for r in rounded):
        blocks = [name for name, recipe in RECIPES.items() if scales_per_span(recipe.spec)]
        raise QuantcliError(f"{rounding.scales_given}: changes nothing for "
                            f"{', '.join(sorted(rounded))}, whose per-tensor or per-row scales GPTQ always takes "
                            f"from the original weights (it chooses block scales for {', '.join(blocks)}); drop "
                            f"the option")


def _names(modules: list[str]) -> str:
    shown = ", ".join(modules[:3])
    return f"{shown} and {len(modules) - 3} more" if len(modules) > 3 else shown
