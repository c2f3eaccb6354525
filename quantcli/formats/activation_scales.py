"""Calibrated scales a checkpoint carries: the activation scheme its config declares, each
quantized module's static input scale and the FP8 KV-cache scales per attention layer.

Names, directions and shapes come from the layout tables (`Layout.optional` rows with an
input-scale role, `Layout.kv_names`); nothing here knows a suffix. Shared by inspect (shown) and
verify (checked: quantcli/verify/activation_scales.py). Scalars only: a few bytes each are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantcli.formats.fused import FUSED_QKV, fused_group_of
from quantcli.formats.layouts.base import Direction, Layout, to_direction
from quantcli.formats.module_kinds import default_exclusion

# The multiplier's divisor: input_scale = amax_x / 2688 (NVFP4: E4M3 max 448 x E2M1 max 6),
# amax / 448 for FP8 activations and the FP8 KV cache (docs/formats.md, "Calibrated scales").
AMAX_DIVISOR = {"nvfp4": 2688.0}
FP8_DIVISOR = 448.0
# An activation amax above the FP16 range means the scale was stored in the other direction.
AMAX_BOUND = 65504.0


@dataclass
class InputScale:
    """One module's static activation scale as stored, and the activation amax it implies."""

    module: str
    tensor: str
    value: float  # as stored
    direction: str  # multiply | divide
    amax: float  # value turned into the multiplier, times the recipe's divisor
    divisor: float = 448.0  # the recipe's: amax / divisor is the multiplier


@dataclass
class KvScale:
    attention: str  # the attention module (model.layers.0.self_attn)
    k_tensor: str
    v_tensor: str
    k_scale: float | None  # None: missing
    v_scale: float | None


@dataclass
class CalibratedScales:
    activation_scheme: str  # static | dynamic | none (the config)
    kv_cache: str | None  # the config key declaring an FP8 KV cache, or None
    inputs: list[InputScale] = field(default_factory=list)
    missing_inputs: list[str] = field(default_factory=list)  # tensors a static scheme needs and lacks
    kv: list[KvScale] = field(default_factory=list)


def divisor_of(recipe: str) -> float:
    return AMAX_DIVISOR.get(recipe, FP8_DIVISOR)


def _scalar(tensors, name: str) -> float | None:
    if name not in tensors:
        return None
    t = tensors.get(name)
    return float(t.to(torch.float32).reshape(-1)[0]) if t.numel() == 1 else math.nan


def _input_scales(layout: Layout, modules: dict[str, str], tensors, static: bool) -> tuple[list, list]:
    found, missing = [], []
    for module, recipe in sorted(modules.items()):
        for row in layout.input_scale_rows(recipe):
            name = f"{module}{row.suffix}"
            value = _scalar(tensors, name)
            if value is None:
                if static:
                    missing.append(name)
                continue
            multiplier = float(to_direction(torch.tensor(value), row.direction))
            found.append(InputScale(module, name, value, row.direction or Direction.MULTIPLY,
                                    multiplier * divisor_of(recipe), divisor_of(recipe)))
    return found, missing


def _kv_scales(layout: Layout, names) -> list[KvScale]:
    """One row per attention module that has a k_proj and v_proj, or one fused q/k/v Linear, in
    the layout's KV names."""
    out = []
    separate = {n.split(".k_proj.")[0]: (f"{n.split('.k_proj.')[0]}.k_proj", f"{n.split('.k_proj.')[0]}.v_proj")
                for n in names if ".k_proj." in n}
    fused = {}
    for n in names:
        module = n.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        if leaf in FUSED_QKV and parent not in separate:
            fused[parent] = (module, module)
    for parent, (k_module, v_module) in sorted({**fused, **separate}.items()):
        if default_exclusion(parent, {}) == "vision tower":  # a vision encoder's attention keeps no KV cache
            continue
        k = layout.kv_names(k_module).get("k_scale")
        v = layout.kv_names(v_module).get("v_scale")
        if k and v:
            out.append(KvScale(parent, k, v, None, None))
    return out


def calibrated_scales(layout: Layout, config: dict, modules: dict[str, str], names, tensors) -> CalibratedScales:
    """What `config` declares and which scales the tensors hold (`modules`: module -> recipe)."""
    scheme = layout.activation_scheme(config)
    out = CalibratedScales(scheme, layout.kv_cache_declared(config))
    out.inputs, out.missing_inputs = _input_scales(layout, modules, tensors, scheme == "static")
    out.kv = _kv_scales(layout, names)
    for row in out.kv:
        row.k_scale, row.v_scale = _scalar(tensors, row.k_tensor), _scalar(tensors, row.v_tensor)
    if out.kv_cache is None and all(r.k_scale is None and r.v_scale is None for r in out.kv):
        out.kv = []
    return out


def scale_names(scales: CalibratedScales) -> set[str]:
    """Every calibrated-scale tensor present (not dense weights)."""
    names = {s.tensor for s in scales.inputs}
    for r in scales.kv:
        names.update(n for n, v in ((r.k_tensor, r.k_scale), (r.v_tensor, r.v_scale)) if v is not None)
    return names


def missing_kv(scales: CalibratedScales) -> list[str]:
    """KV-scale tensors an FP8 KV cache declared in the config needs and the checkpoint lacks."""
    if scales.kv_cache is None:
        return []
    return [n for r in scales.kv for n, v in ((r.k_tensor, r.k_scale), (r.v_tensor, r.v_scale)) if v is None]


def fused_input_mismatches(scales: CalibratedScales) -> dict[str, dict[str, float]]:
    """Fused groups (q/k/v, gate/up) whose members store different input scales."""
    groups: dict[str, dict[str, float]] = {}
    for s in scales.inputs:
        g = fused_group_of(s.module)
        if g:
            groups.setdefault(g, {})[s.tensor] = s.value
    return {g: v for g, v in sorted(groups.items()) if len(v) > 1 and len(set(v.values())) > 1}


def scale_value_fault(value: float, amax: float, direction: str) -> str | None:
    """Why a stored input or KV scale is wrong, or None: not finite, not positive, or implying an
    activation amax beyond the FP16 range (stored in the other direction)."""
    if not math.isfinite(value):
        return f"is {value}, not finite"
    if value <= 0:
        return f"is {value:g}, not positive"
    if not math.isfinite(amax) or amax > AMAX_BOUND:
        other = "divisor" if direction == Direction.MULTIPLY else "multiplier"
        return (f"is {value:g}, which as a {direction} scale implies an activation amax of {amax:.4g} "
                f"(> {AMAX_BOUND:g}); it looks stored as a {other} (inverted)")
    return None
