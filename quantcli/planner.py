"""Which planner a source needs: a dense source is planned by plan.make_plan, a quantized one
(re-layout, re-quantize, dequantize) by reformat.make_reformat_plan, after detect finds its layout."""

from __future__ import annotations

from .calibrate.plan import checked_plan
from .plan import Options, Plan
from .reformat import detect_quantized, plan_for
from .source import Source


def plan_conversion(source: Source, opts: Options) -> Plan:
    """The plan for converting `source` with `opts`, from headers (and a quantized source's scales)."""
    return checked_plan(plan_for(source, opts, detect_quantized(source)))
