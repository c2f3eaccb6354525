"""What a checkpoint's modules are, read from its headers: the analysis inspect, verify and the
re-layout planner share. Every function returns data (dataclasses from here, serialized by
quantcli.reports.to_json); nothing here prints.

- describe_module: one quantized module's disk tensors, logical shape, bits per parameter and
  the problems found in its tensors (ModuleDescription)
- module_stats: scale ranges, zero blocks, saturation and NaN/Inf, from the data (ModuleStats)
- fused_mismatches: fused groups whose members carry different global scales
- exclusion_list / is_excluded / linear_modules: which Linears are left unquantized, and whether
  the checkpoint says so
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import CheckpointError
from quantcli.formats import patterns
from quantcli.formats.decode import decode_module
from quantcli.formats.detect import Detected, disk_problems, tensors_look_like
from quantcli.formats.experts import experts_module
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import Layout, layouts_for
from quantcli.formats.layouts.base import Role
from quantcli.formats.module_kinds import is_dense_linear
from quantcli.reports import OMITTED

EXCLUSION_KEYS = ("exclude_modules", "ignore", "ignored_layers", "modules_to_not_convert")
SCALE_RULES = ("floor", "even", "rceil")


def exclusion_list(config: dict) -> list[str]:
    """The checkpoint's list of modules left unquantized (the first non-empty consumer key)."""
    qc = config.get("quantization_config") or {}
    hq = (config.get("hf_quant_config") or {}).get("quantization") or {}
    for key in EXCLUSION_KEYS:
        for where, section in (("hf_quant_config.json quantization", hq), ("config.json quantization_config", qc)):
            value = section.get(key) if isinstance(section, dict) else None
            if not value:
                continue
            # a bare string would be read character by character; say so instead of guessing
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise CheckpointError(f"{where}.{key}: must be a list of module names or patterns, "
                                      f"got {type(value).__name__} {value!r:.60}")
            return list(value)
    return []


def is_excluded(module: str, excluded: list[str]) -> bool:
    """Whether the exclusion list covers `module` by the consumers' rules (quantcli/formats/patterns.py)."""
    return patterns.matches_any(excluded, module)


def linear_modules(names: dict[str, str], tensors: CheckpointTensors) -> list[str]:
    """2-D `.weight` tensors that are Linear layers (not embeddings or norms) in dense form."""
    out = []
    for name in names:
        if name.endswith(".weight") and len(tensors.info(name).shape) == 2:
            module = name[: -len(".weight")]
            if is_dense_linear(module):
                out.append(module)
    return out


def dense_expert_stacks(names: dict[str, str], tensors: CheckpointTensors) -> dict[str, list[str]]:
    """{experts module: its 3-D float tensors}: MoE expert stacks in dense form (gpt-oss's
    `mlp.experts.gate_up_proj`), which a quantized checkpoint must quantize or name as excluded."""
    out: dict[str, list[str]] = {}
    for name in names:
        info = tensors.info(name)
        if len(info.shape) == 3 and ".experts." in name and info.dtype in ("BF16", "F16", "F32"):
            out.setdefault(experts_module(name), []).append(name)
    return out


@dataclass
class TensorEntry:
    """One disk tensor of a quantized module, as the layout names it and the header stores it."""

    name: str
    role: str
    dtype: str
    shape: list[int]
    encoding: str
    direction: str
    value: float = OMITTED  # a scalar global scale's value (a few bytes, so it is read)


@dataclass
class ModuleStats:
    """What the data of one module holds (inspect --stats); only the fields its scale encoding has."""

    scale_min: float = OMITTED
    scale_max: float = OMITTED
    scale_nonfinite: int = OMITTED
    e8m0_histogram: dict[str, int] = OMITTED
    e8m0_255_count: int = OMITTED
    nonfinite_values: int = OMITTED
    zero_block_fraction: float = OMITTED
    saturated_fraction: float = OMITTED
    # what absmax scaling saturates by construction: one code per block (NVFP4 1/16 = 6.25 %);
    # OMITTED for E8M0 scales, which put the block amax near, not onto, the largest element
    saturated_inherent: float = OMITTED


@dataclass
class ModuleDescription:
    """One quantized module. A module that cannot be described as its recipe and layout carries
    only module, recipe, (empty) tensors, bytes, params and the problem; the rest stays OMITTED."""

    module: str
    recipe: str
    tensors_look_like: str | None = OMITTED
    logical_shape: list[int] | None = OMITTED
    logical_dtype: str = OMITTED
    storage_dtype: str | None = OMITTED
    storage_shape: list[int] | None = OMITTED
    packing: str | None = OMITTED
    block: list[int] = OMITTED
    scale_rule: str | None = OMITTED
    tensors: list[TensorEntry] = field(default_factory=list)
    bytes: int = 0
    params: int = 0
    bits_per_param: float | None = OMITTED
    problems: list[str] = field(default_factory=list)
    stats: ModuleStats = OMITTED
    # the manifest's record of a data-aware rounding (GPTQ, or round to nearest instead and why):
    # method, tokens, output_error, nearest_output_error, dampening, reason
    rounding: dict = OMITTED

    @classmethod
    def undescribable(cls, module: str, recipe: str, problem: str) -> ModuleDescription:
        return cls(module=module, recipe=recipe, problems=[problem])


def _disk_entries(layout: Layout, module: str, recipe, tensors: CheckpointTensors) -> tuple[list, int, list[str]]:
    """(entries of the disk tensors present, their bytes, 'X is missing' problems)."""
    entries, nbytes, problems = [], 0, []
    for d in layout.describe(module, recipe):
        if d.name not in tensors:
            problems.append(f"{d.name} is missing")
            continue
        info = tensors.info(d.name)
        nbytes += info.nbytes
        entry = TensorEntry(name=d.name, role=d.role, dtype=info.dtype, shape=list(info.shape), encoding=d.encoding,
                            direction=d.direction)
        if d.role == Role.GLOBAL_SCALE and info.numel == 1:
            entry.value = float(tensors.get(d.name).to(torch.float32).reshape(()))
        entries.append(entry)
    return entries, nbytes, problems


def describe_module(layout: Layout, module: str, recipe_name: str, tensors: CheckpointTensors,
                    scale_rule: str | None = None) -> ModuleDescription:
    recipe = layout.recipe_for(recipe_name, scale_rule if scale_rule in SCALE_RULES else None)
    codes_name = layout.describe(module, recipe)[0].name
    entries, nbytes, problems = _disk_entries(layout, module, recipe, tensors)
    codes = tensors.info(codes_name) if codes_name in tensors else None
    logical = None
    if codes is not None:
        logical = list(layout.logical_shape(recipe, tuple(codes.shape)))
        problems.extend(disk_problems(layout, module, recipe, tuple(logical), tensors))
    looks_like = tensors_look_like(module, recipe.name, tensors)
    if looks_like and looks_like != recipe.name:
        problems.append(f"config says {recipe.name} but the tensors look like {looks_like}")
    numel = math.prod(logical) if logical else 0
    # Bits per parameter count codes and scales: compressed-tensors' `weight_shape` is 16 bytes of
    # metadata per module, not a cost per parameter (int4 stays 4 + 16/128 on any shape).
    bits_bytes = nbytes - sum(tensors.info(e.name).nbytes for e in entries if e.role == Role.SHAPE)
    element = recipe.element
    return ModuleDescription(
        module=module, recipe=recipe.name, tensors_look_like=looks_like, logical_shape=logical,
        logical_dtype=element.manifest_name, storage_dtype=codes.dtype if codes else None,
        storage_shape=list(codes.shape) if codes else None,
        packing=f"{element.packing} low_first" if element.packed else None,
        block=list(recipe.block), scale_rule=recipe.scale_rule, tensors=entries, bytes=nbytes, params=numel,
        bits_per_param=round(8 * bits_bytes / numel, 4) if numel else None, problems=problems)


def module_stats(layout: Layout, module: str, recipe_name: str, tensors: CheckpointTensors) -> ModuleStats:
    recipe = layout.recipe_for(recipe_name)
    q = layout.from_disk(module, recipe, tensors.get, tensors.where)
    out = ModuleStats(**recipe.scale_stats(q))
    w = decode_module(layout, module, recipe, q)
    out.nonfinite_values = int((~torch.isfinite(w)).sum())
    blocks = recipe.block[1] or w.shape[-1]
    if w.shape[-1] % blocks == 0:
        g = w.reshape(-1, blocks)
        out.zero_block_fraction = round(float((g.abs().amax(dim=1) == 0).float().mean()), 6)
    out.saturated_fraction = round(recipe.saturated_fraction(q), 6)
    inherent = inherent_saturation(recipe, tuple(q.shape))
    if inherent is not None:
        out.saturated_inherent = round(inherent, 6)
    return out


def inherent_saturation(recipe, shape: tuple[int, ...]) -> float | None:
    """The share of codes at the element's max that absmax scaling puts there by construction:
    each block's amax maps to the largest element, so one code per block (partial edge blocks
    count whole). None for power-of-two (E8M0) scales, which map the amax below the max."""
    if recipe.scale_encoding == "e8m0_bias127" or len(shape) < 2 or not math.prod(shape):
        return None
    rows, cols = recipe.block
    if rows == 0 and cols == 0:  # one scale for the whole tensor
        return 1.0 / math.prod(shape)
    n, k = shape[-2], shape[-1]
    blocks = math.prod(shape[:-2]) * math.ceil(n / (rows or n)) * math.ceil(k / (cols or k))
    return blocks / math.prod(shape)


@dataclass
class FusedMismatch:
    """A fused group (q/k/v, gate/up) whose members carry different global scales."""

    group: str
    global_scales: dict[str, float]


def global_scale_value(m: ModuleDescription) -> float | None:
    value = next((t.value for t in m.tensors if t.role == Role.GLOBAL_SCALE), None)
    return None if value is OMITTED else value


def fused_mismatches(modules: list[ModuleDescription]) -> list[FusedMismatch]:
    groups: dict[str, dict[str, float]] = {}
    for m in modules:
        g = fused_group_of(m.module)
        value = global_scale_value(m)
        if g and value is not None:
            groups.setdefault(g, {})[m.module] = value
    return [FusedMismatch(group=g, global_scales=v) for g, v in sorted(groups.items())
            if len(v) > 1 and len(set(v.values())) > 1]


def unservable_problems(det: Detected | None, modules: list[ModuleDescription]) -> list[str]:
    """A (recipe, layout) pair that a producer writes but no serving engine loads (ModelOpt's
    MXFP4 export): readable and convertible, but say so plainly, once per recipe."""
    if det is None:
        return []
    recipes = sorted({m.recipe for m in modules if m.recipe in det.layout.unservable})
    return [f"{len(recipes)} {r} module(s): no serving engine loads {r} in the {det.layout.name} layout; "
            f"convert it with --layout {' or --layout '.join(x for x in layouts_for(r) if x != det.layout.name)}"
            for r in recipes]


__all__ = ["FusedMismatch", "ModuleDescription", "ModuleStats", "TensorEntry", "describe_module", "exclusion_list",
           "fused_mismatches", "is_excluded", "linear_modules", "module_stats", "unservable_problems"]
