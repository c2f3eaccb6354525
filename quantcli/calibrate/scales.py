"""Calibration statistics -> ModuleFacts: activation scales (shared across fused groups) and
KV-cache scales, as multipliers (docs/formats.md, "Calibrated scales")."""

from __future__ import annotations

import torch

from quantcli.calibrate.engine import Stats
from quantcli.errors import QuantcliError
from quantcli.formats.activation_scales import FP8_DIVISOR, divisor_of
from quantcli.formats.fused import fused_group_of
from quantcli.planning.plan import Plan


def scale_for(amax: float, divisor: float) -> torch.Tensor:
    """The F32 multiplier amax / divisor, rounded once from the exact quotient; an all-zero
    activation gets amax 1 (a scale is never 0, its reciprocal never Inf). verify's rerun uses it too."""
    return torch.tensor((amax if amax > 0 else 1.0) / divisor, dtype=torch.float64).to(torch.float32)


def needs_walk(plan: Plan) -> bool:
    """Whether the plan writes anything the calibration walk learns (scale_facts below: static
    activation scales, KV-cache scales, an activation-weighted scale search). --rounding gptq alone
    does not: its weight pass walks the layers itself (convert/passes/weight_walk.py)."""
    opts = plan.options
    return opts.calibration is not None and (opts.activations == "static" or opts.kv_cache == "fp8"
                                             or opts.scale_search == "mse")


def scale_facts(plan: Plan, stats: Stats) -> dict[str, dict[str, object]]:
    """{module: {ModuleFacts field: value}} for the calibrated tensors the plan writes (none
    unless needs_walk)."""
    out: dict[str, dict[str, object]] = {}
    if plan.options.activations == "static":
        _input_scales(plan, stats, out)
    if plan.options.kv_cache == "fp8":
        for attn, k in stats.keys.items():
            k_module, v_module = plan.walk.kv_modules.get(attn, (f"{attn}.k_proj", f"{attn}.v_proj"))
            out.setdefault(k_module, {})["k_scale"] = scale_for(k, FP8_DIVISOR)
            out.setdefault(v_module, {})["v_scale"] = scale_for(stats.values[attn], FP8_DIVISOR)
    if plan.options.scale_search == "mse":  # activation-weighted search
        for t in plan.tensors:
            ms = stats.channel_ms(t.module) if t.quantized else None
            if ms is not None:
                out.setdefault(t.module, {})["input_channel_ms"] = ms
    return out


def _input_scales(plan: Plan, stats: Stats, out: dict[str, dict[str, object]]) -> None:
    quantized = [t for t in plan.tensors if t.quantized]
    shared, unrouted = input_amax([t.module for t in quantized], stats)
    noted: set[str] = set()
    for t in quantized:
        found = out.setdefault(t.module, {})
        found["input_scale"] = scale_for(shared[t.module], divisor_of(t.recipe))
        expert = t.module.rpartition(".")[0]  # one note per expert, on its first module
        if t.module in unrouted and expert not in noted:
            noted.add(expert)
            found["note"] = (f"{expert}: no calibration token was routed to this expert; its input scales are the "
                             f"max over {unrouted[t.module]}'s experts")


def input_amax(modules: list[str], stats: Stats) -> tuple[dict[str, float], dict[str, str]]:
    """The activation amax each quantized module's static scale is made from: the max over its
    fused group (q/k/v, gate/up: one activation scale per fused GEMM); an expert no calibration
    token was routed to takes the max over its experts block in the same role. Returns that and
    {unrouted expert module: its experts block}."""
    amax = dict(stats.inputs)
    unrouted = _fill_unrouted_experts(modules, stats, amax)
    missing = [m for m in modules if m not in amax]
    if missing:
        raise QuantcliError(f"--calibration: the model's forward never reached {len(missing)} quantized "
                            f"module(s) (first: {missing[0]}); --ignore them")
    group_max: dict[str, float] = {}
    for m in modules:
        g = fused_group_of(m) or m
        group_max[g] = max(group_max.get(g, 0.0), amax[m])
    return {m: group_max[fused_group_of(m) or m] for m in modules}, unrouted


def _fill_unrouted_experts(modules: list[str], stats: Stats, amax: dict[str, float]) -> dict[str, str]:
    """Give each unreached expert module its block-and-role max; {module: experts block}."""
    role_max: dict[str, float] = {}
    for module, role in stats.expert_roles.items():
        if module in stats.inputs:
            role_max[role] = max(role_max.get(role, 0.0), stats.inputs[module])
    unrouted = {}
    for m in modules:
        role = stats.expert_roles.get(m)
        if m not in amax and role is not None and role in role_max:
            amax[m] = role_max[role]
            unrouted[m] = role.split(":")[0]
    return unrouted
