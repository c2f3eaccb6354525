"""Calibration statistics -> ModuleFacts: activation scales (shared across fused groups) and
KV-cache scales, as multipliers (FORMATS.md B 3, 6.1, 9)."""

from __future__ import annotations

import torch

from ..errors import QuantcliError
from ..plan import Plan, fused_group_of
from .engine import Stats

E4M3_MAX, E2M1_MAX = 448.0, 6.0
# The largest value the activation's element format reaches with scale 1 (the divisor of amax).
ACTIVATION_DIVISOR = {"fp8": E4M3_MAX, "fp8-channel": E4M3_MAX, "nvfp4": E2M1_MAX * E4M3_MAX}


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64).to(torch.float32)


def scale_facts(plan: Plan, stats: Stats) -> dict[str, dict[str, object]]:
    """{module: {ModuleFacts field: value}} for the calibrated tensors the plan writes."""
    out: dict[str, dict[str, object]] = {}
    if plan.options.activations == "static":
        group_max: dict[str, float] = {}
        quantized = [t for t in plan.tensors if t.quantized]
        missing = [t.module for t in quantized if t.module not in stats.inputs]
        if missing:
            raise QuantcliError(f"--calibration: the model's forward never reached {len(missing)} quantized "
                                f"module(s) (first: {missing[0]}); --ignore them")
        for t in quantized:
            g = fused_group_of(t.module) or t.module
            group_max[g] = max(group_max.get(g, 0.0), stats.inputs[t.module])
        for t in quantized:
            amax = group_max[fused_group_of(t.module) or t.module]
            out[t.module] = {"input_scale": _f32(_positive(amax) / ACTIVATION_DIVISOR[t.recipe])}
    if plan.options.kv_cache == "fp8":
        for attn, k in stats.keys.items():
            out.setdefault(f"{attn}.k_proj", {})["k_scale"] = _f32(_positive(k) / E4M3_MAX)
            out.setdefault(f"{attn}.v_proj", {})["v_scale"] = _f32(_positive(stats.values[attn]) / E4M3_MAX)
    return out


def _positive(amax: float) -> float:
    """An all-zero activation gets amax 1 (scale never 0, its reciprocal never Inf)."""
    return amax if amax > 0 else 1.0
