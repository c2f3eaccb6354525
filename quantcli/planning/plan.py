"""Plan a conversion from headers alone: which tensors are quantized with which recipe, what is
excluded and why, fused groups, every output tensor's name, dtype and shape.

Everything that can go wrong with shapes or options is found here, before any tensor data is
read, and reported all at once.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from quantcli.checkpoint.safetensors_io import DTYPES, ITEMSIZE, OutSpec, dtype_name
from quantcli.checkpoint.source import Source
from quantcli.errors import LayoutError, QuantcliError, RecipeError
from quantcli.formats import patterns
from quantcli.formats.experts import every_layers_experts, experts_module
from quantcli.formats.facts import Calibration
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import DEFAULT_LAYOUT, Layout, get_layout, layouts_for, layouts_holding, module_of
from quantcli.formats.module_kinds import default_exclusion, is_dense_linear
from quantcli.formats.transformers_view import TransformersView
from quantcli.planning import consumer_names
from quantcli.planning.actions import Action
from quantcli.planning.consumer_names import output_heads, source_view, spelled, transposed_modules, unnamed_warning
from quantcli.planning.fused_groups import drop_single_member_groups, one_precision_per_fused_group
from quantcli.planning.rounding import Rounding
from quantcli.recipes import RECIPES, Recipe, get_recipe

if TYPE_CHECKING:  # the walk's types only: importing the model layer costs every plan its import time
    from quantcli.model.reach import Reach
    from quantcli.planning.transforms import TransformOp

# docs/formats.md, "What is never quantized by default". (reason, pattern on the module name)
# 3-D expert parameters without a `.weight` suffix (gpt-oss, Llama 4) are stored [E, in, out].
TRANSPOSED_EXPERTS = re.compile(r"experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shard: str
    dtype: str
    shape: tuple[int, ...]
    recipe: str | None = None  # None: passed through unchanged
    module: str | None = None
    transpose: bool = False  # [E, K, N] source stacks are quantized as [E, N, K]
    fused_group: str | None = None
    outputs: tuple[OutSpec, ...] = ()
    # Quantized sources (convert from an already quantized checkpoint): how this module is read
    # and what happens to it. `shape` is then the logical shape and `source_bytes` what is read.
    action: Action = Action.QUANTIZE
    source_recipe: str | None = None
    source_bytes: int | None = None
    # Re-quantized with a recipe whose scales take the weight's dtype (int4): the dtype the decoded
    # source is cast to before quantizing (from_quantized.requantize_dtype says why); else None.
    requantize_dtype: str | None = None

    @property
    def quantized(self) -> bool:
        return self.recipe is not None

    @property
    def logical_shape(self) -> tuple[int, ...]:
        if self.transpose:
            return (*self.shape[:-2], self.shape[-1], self.shape[-2])
        return self.shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes_in(self) -> int:
        if self.source_bytes is not None:
            return self.source_bytes
        return self.numel * ITEMSIZE.get(self.dtype, 1)

    @property
    def bytes_out(self) -> int:
        return sum(o.nbytes for o in self.outputs)


EMPTY_TENSOR = "empty tensor"  # the exclusion reason of a weight with a 0-size dimension


@dataclass(frozen=True)
class Exclusion:
    module: str
    reason: str


@dataclass
class Options:
    recipe: str
    layout: str | None = None
    ignore: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # empty: every eligible Linear
    overrides: list[tuple[str, str]] = field(default_factory=list)  # (pattern, recipe), first match wins
    scale_rule: str | None = None
    activations: str | None = None  # "static": calibrated activation scales (nvfp4 W4A4, fp8)
    kv_cache: str | None = None  # "fp8": calibrated k_scale / v_scale
    calibration: Calibration | None = None
    scale_search: str = "none"  # none | mse: how NVFP4 / MX block scales are chosen (kernels/search.py)
    rounding: Rounding = field(default_factory=Rounding)  # to nearest, or GPTQ per module (planning/rounding.py)
    rotate: str | None = None  # "vo": rotate values and outputs per head first (planning/transforms.py)
    auto: object | None = None  # --auto: planning/auto.py's AutoRequest (candidates, budget) before the choice
    auto_choice: object | None = None  # after it: its AutoChoice, which the overrides and ignore list spell out


@dataclass
class Plan:
    source: Source
    layout: Layout | None  # None: a dense checkpoint (dequantize to `dense_dtype`)
    options: Options
    tensors: list[TensorPlan]
    exclusions: list[Exclusion]
    warnings: list[str]  # what planning found; `all_warnings` puts the source's first
    recipes: dict[str, Recipe]
    source_layout: Layout | None = None  # set when the source is quantized
    dense_dtype: str | None = None
    notes: list[str] = field(default_factory=list)
    walk: Reach | None = None  # with --calibration: what the layer walk reaches (planning/calibration.py)
    # What transformers makes of the source's modules (planning/consumer_names.py), None without it
    transformers: TransformersView | None = None
    # Exact transforms of source tensors before rounding: {source tensor: op} (planning/transforms.py)
    transforms: dict[str, TransformOp] = field(default_factory=dict)

    @property
    def all_warnings(self) -> list[str]:
        """What opening the source found (duplicate or unindexed tensors), then what planning
        found: for every plan (dense or quantized source), so convert and --dry-run print both.
        Kept apart so that a plan rebuilt with `replace` never lists the source's twice."""
        return [*self.source.warnings, *self.warnings]

    @property
    def target(self) -> str:
        return self.layout.name if self.layout is not None else self.dense_dtype

    @property
    def lossless(self) -> bool:
        """No value changes: every quantized module is carried over byte for byte."""
        acts = {t.action for t in self.tensors if t.action != Action.COPY}
        return bool(acts) and acts <= {"relayout"}

    def by_shard(self) -> dict[str, list[TensorPlan]]:
        out: dict[str, list[TensorPlan]] = {s: [] for s in self.source.shards}
        for t in self.tensors:
            out[t.shard].append(t)
        return out

    def fused_groups(self) -> dict[str, list[TensorPlan]]:
        groups: dict[str, list[TensorPlan]] = {}
        for t in self.tensors:
            if t.fused_group:
                groups.setdefault(t.fused_group, []).append(t)
        return groups

    def modules_by_recipe(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in self.tensors:
            if t.quantized:
                out.setdefault(t.recipe, []).append(t.module)
        return out

    def excluded_names(self) -> list[str]:
        """The exact module names for the layout's exclusion key: every Linear left unquantized,
        and the output head where the model has one (a tied head has no tensor but is still an
        unquantized Linear; an encoder such as BertModel has none to name), each also under the
        name transformers gives it where that differs (planning/consumer_names.py)."""
        names = {e.module for e in self.exclusions} | set(output_heads(self.source.config, self.transformers))
        return spelled(names, self.transformers)

    def consumer_modules_by_recipe(self) -> dict[str, list[str]]:
        """modules_by_recipe with transformers' names beside the checkpoint's: a config's targets."""
        return {r: spelled(ms, self.transformers) for r, ms in self.modules_by_recipe().items()}

    @property
    def bytes_in(self) -> int:
        return sum(t.bytes_in for t in self.tensors)

    @property
    def bytes_out(self) -> int:
        return sum(t.bytes_out for t in self.tensors)

    def params(self, quantized: bool | None = None) -> int:
        return sum(t.numel for t in self.tensors if quantized is None or t.quantized == quantized)


def matches(pattern: str, module: str) -> bool:
    """The consumers' module-name rules (quantcli/formats/patterns.py: regex, exact, glob, parent module,
    dotted segment, fused name); a pattern written on the tensor (`*q_proj.weight`) also counts."""
    return patterns.matches(pattern, module) or patterns.matches(pattern, module + ".weight")


def output_specs(layout: Layout, module: str, recipe: Recipe, shape: tuple[int, ...],
                 weight_dtype: torch.dtype) -> tuple[OutSpec, ...]:
    """Names, dtypes and shapes the layout will write for a `shape` weight quantized in
    `weight_dtype` (int4's scales take it), with no data read."""
    return tuple(OutSpec(n, dtype_name(dtype), shp)
                 for n, dtype, shp in layout.output_specs(module, recipe, shape, weight_dtype))


def _choose_recipe(module: str, opts: Options) -> str:
    for pattern, recipe in opts.overrides:
        if matches(pattern, module):
            return recipe
    return opts.recipe


def make_plan(source: Source, opts: Options) -> Plan:
    """The plan for a dense source: every tensor copied, or quantized by the recipe its module
    gets, or excluded with a reason; refused as a whole if it is inconsistent or quantizes nothing."""
    layout, recipes = _layout_and_recipes(opts)
    hf = source_view(source.config, {n: i.shape for _, n, i in _owned_tensors(source)})
    found = _Planned(heads=frozenset(output_heads(source.config, hf)), warnings=unnamed_warning(source.config, hf),
                     transposed=transposed_modules(source.config, hf))
    for shard, name, info in _owned_tensors(source):
        _plan_tensor(found, source, opts, layout, recipes, shard, name, info)
    one_precision_per_fused_group(found.tensors, lambda m, why: found.exclusions.append(Exclusion(m, why)),
                                  found.warnings, {e.module: e.reason for e in found.exclusions})
    tensors = drop_single_member_groups(found.tensors)
    mix = {t.recipe for t in tensors if t.quantized}  # what modules get: an override matching nothing adds nothing
    layout.require_mix(mix, layouts_holding(mix))  # from headers alone, not at finalize after every shard
    errors: list[str] = []
    _check_collisions(tensors, errors)
    _check_whole_expert_layers(tensors, found.exclusions, errors)
    if errors:
        raise QuantcliError(f"{len(errors)} problem(s) in the plan: " + "; ".join(errors))
    warnings = found.warnings + _unmatched_patterns(opts, found.candidates)
    if not any(t.quantized for t in tensors):
        raise QuantcliError(_nothing_to_quantize(source, layout, found.exclusions))
    return Plan(source, layout, opts, tensors, found.exclusions, warnings, recipes, transformers=hf)


def _check_whole_expert_layers(tensors: list[TensorPlan], exclusions: list[Exclusion], errors: list[str]) -> None:
    """An MoE layer's 3-D stacks are quantized together or left dense together: the exclusion list
    names the whole layer (`mlp.experts`), so an engine would read a quantized stack in it as
    dense (`--ignore '...experts.down_proj'` alone on gpt-oss did that)."""
    excluded = {e.module for e in exclusions}
    for t in tensors:
        if t.quantized and len(t.shape) == 3 and experts_module(t.name) in excluded:
            errors.append(f"{experts_module(t.name)}: {t.name} would be quantized while other stacks of the layer "
                          f"stay dense, which no engine loads; --ignore '{every_layers_experts(t.name)}' (all of "
                          f"it) or none of it")
            return


@dataclass
class _Planned:
    """What planning a dense source collects, tensor by tensor."""

    tensors: list[TensorPlan] = field(default_factory=list)
    exclusions: list[Exclusion] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)  # Linear and expert modules: what patterns can select
    heads: frozenset[str] = frozenset()  # the output head's names (consumer_names.output_heads)
    transposed: Callable[[str], bool] = lambda module: False  # a Conv1D module (consumer_names.transposed_modules)


def _layout_and_recipes(opts: Options) -> tuple[Layout, dict[str, Recipe]]:
    """The layout and every recipe the options use, checked against it (and their mix): before any tensor."""
    if opts.recipe not in RECIPES:
        get_recipe(opts.recipe)  # raises the registry's error listing the names
    for p in opts.ignore:
        patterns.validate(p, "--ignore")
    for p in opts.targets:
        patterns.validate(p, "targets")
    layout = get_layout(opts.layout or DEFAULT_LAYOUT[opts.recipe])
    used = {opts.recipe} | {r for _, r in opts.overrides}
    recipes: dict[str, Recipe] = {}
    for name in sorted(used):
        get_recipe(name)
        layout.require(name, layouts_for(name))
        layout.require_static(name, opts.activations == "static", layouts_for(name))
        recipes[name] = layout.recipe_for(name, opts.scale_rule if get_recipe(name).scale_rules else None
                                          ).with_scale_search(opts.scale_search)
    if opts.scale_rule and not any(r.scale_rules for r in recipes.values()):
        raise QuantcliError(f"--scale-rule {opts.scale_rule}: only MX recipes (mxfp8, mxfp4) take a scale rule")
    if opts.scale_search != "none" and not any(r.searches for r in recipes.values()):
        raise QuantcliError(f"--scale-search {opts.scale_search}: only nvfp4, mxfp4 and mxfp8 search their block "
                            f"scales ({', '.join(sorted(recipes))} keep absmax); drop the option")
    return layout, recipes


def _owned_tensors(source: Source):
    """(shard, name, info) of every tensor, in shard order, names sorted within a shard."""
    for shard in source.shards:
        for name, info in sorted(source.headers[shard].tensors.items()):
            if source.weight_map and source.weight_map.get(name) != shard:
                continue  # a tensor the index assigns elsewhere (duplicate) is not ours to copy
            yield shard, name, info


def _plan_tensor(found: _Planned, source: Source, opts: Options, layout: Layout, recipes: dict[str, Recipe],
                 shard: str, name: str, info) -> None:
    """Plan one source tensor: a copy, or a quantized module, or an excluded Linear."""
    plain = TensorPlan(name, shard, info.dtype, info.shape, action=Action.COPY,
                       outputs=(OutSpec(name, info.dtype, info.shape),))
    is_linear = name.endswith(".weight") and len(info.shape) == 2
    is_experts = len(info.shape) == 3 and "experts" in name
    if not (is_linear or is_experts):
        found.tensors.append(plain)
        return
    module = module_of(name)
    found.candidates.append(module)
    reason = ("output head" if module in found.heads else consumer_names.TRANSPOSED_LINEAR
              if found.transposed(module) else _exclusion_reason(module, info, is_experts, opts, layout, source.config))
    transpose = bool(is_experts and TRANSPOSED_EXPERTS.search(name))
    shape = (*info.shape[:-2], info.shape[-1], info.shape[-2]) if transpose else info.shape
    recipe = recipes[_choose_recipe(module, opts)] if reason is None else None
    if recipe is not None:
        reason = unfit_reason(recipe, layout, name, shape, info.dtype)
        if reason is not None and is_experts:
            # Most of an MoE's weights: never left dense unasked (an engine would read it as quantized).
            raise QuantcliError(f"{name}: {reason} ('{every_layers_experts(name)}' keeps the expert stacks dense, "
                                f"named in the exclusion list; they are not left dense unasked)")
        if reason is not None:
            found.warnings.append(f"{name}: left unquantized: {reason}")
            recipe = None
    if recipe is None:
        if is_experts:  # named by its experts module, as engines look up the fused MoE layer
            if experts_module(name) not in {e.module for e in found.exclusions}:
                found.exclusions.append(Exclusion(experts_module(name), reason))
        elif is_linear and (is_dense_linear(module) or module in found.heads or found.transposed(module)):
            # GPT-NeoX's head: `embed_out`; a Conv1D, which engines build as a Linear
            found.exclusions.append(Exclusion(module, reason))
        found.tensors.append(plain)
        return
    group = fused_group_of(module) if recipe.has_global_scale else None
    found.tensors.append(TensorPlan(name, shard, info.dtype, info.shape, recipe.name, module, transpose, group,
                                    output_specs(layout, module, recipe, shape, DTYPES[info.dtype])))


def _exclusion_reason(module: str, info, is_experts: bool, opts: Options, layout: Layout,
                      config: dict) -> str | None:
    """Why a Linear or expert module stays unquantized (first reason wins), or None."""
    reason = default_exclusion(module, config)
    if reason is None and math.prod(info.shape) == 0:
        reason = EMPTY_TENSOR  # a 0-size dimension: nothing to quantize, passed through as is
    if reason is None and any(matches(p, module) for p in opts.ignore):
        reason = "--ignore"
    if reason is None and opts.targets and not any(matches(p, module) for p in opts.targets):
        reason = "not in targets"
    if reason is None and layout.experts_only and not is_experts:
        reason = f"{layout.name} layout quantizes MoE experts only"
    if reason is None and DTYPES.get(info.dtype) not in (torch.float32, torch.float16, torch.bfloat16):
        reason = f"dtype {info.dtype} is not a float weight"
    return reason


def unfit_reason(recipe: Recipe, layout: Layout, name: str, shape: tuple[int, ...], dtype: str) -> str | None:
    """Why the recipe or the layout cannot take this weight (its shape), or None."""
    try:
        recipe.check(name, shape, DTYPES[dtype])
        layout.check_shape(name, recipe, shape)
    except (RecipeError, LayoutError) as exc:
        return str(exc).split(": ", 1)[1]
    return None


def _nothing_to_quantize(source: Source, layout: Layout, exclusions: list[Exclusion]) -> str:
    """Why a conversion would write an unquantized copy, which nobody asks for on purpose."""
    if layout.experts_only:
        return (f"{source.label}: --layout {layout.name} quantizes 3-D MoE expert stacks only, and this checkpoint has "
                f"none; use --layout compressed-tensors for dense Linears")
    reasons = sorted({e.reason for e in exclusions})
    why = f" (left dense: {'; '.join(reasons[:3])})" if reasons else " (no Linear or expert weights found)"
    return (f"{source.label}: no tensor can be quantized with these options{why}; check --ignore/targets, or "
            f"`quantcli convert ... --dry-run` to see each tensor's reason")


def _unmatched_patterns(opts: Options, modules: list[str]) -> list[str]:
    """A pattern that selects no Linear or expert module is most likely a typo: said before the
    work, with the module name closest to it (difflib) as the likely intent."""
    out = []
    for label, given in (("ignore", opts.ignore), ("targets", opts.targets),
                         ("override", [p for p, _ in opts.overrides])):
        for p in given:
            if not any(matches(p, m) for m in modules):
                # a name's closest module is a likely typo; a regular expression's is not
                close = [] if p.startswith("re:") else difflib.get_close_matches(p, modules, n=1, cutoff=0.0)
                hint = f" (closest module name: {close[0]!r})" if close else ""
                out.append(f"{label} pattern {p!r} matches no Linear or expert module, so it has no effect{hint}")
    return out


def _check_collisions(tensors: list[TensorPlan], errors: list[str]) -> None:
    seen: dict[str, str] = {}
    for t in tensors:
        for o in t.outputs:
            if o.name in seen and seen[o.name] != t.name:
                errors.append(f"output tensor {o.name} would be written for both {seen[o.name]} and {t.name}")
            seen[o.name] = t.name
