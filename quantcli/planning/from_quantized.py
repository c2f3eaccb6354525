"""Plans for converting from quantized sources: lossless re-layout, dequantize, re-quantize.

The source's layout and per-module recipes come from `detect` (shared with inspect and verify).
Per quantized module:
- relayout   (same recipe, another layout): codes and block scales are carried over byte for
             byte; names, scalar shapes, global-scale direction and config are the target's;
- requantize (another recipe): decode to FP32, then quantize (error compounds: said so);
- dequantize (`--recipe bf16|fp16|fp32`): decode and write a plain weight; no quantization_config.
Modules that are dense in the source stay dense (and are listed as excluded).
"""

from __future__ import annotations

import torch

from quantcli.checkpoint.safetensors_io import DTYPES, OutSpec
from quantcli.checkpoint.source import Source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import CheckpointError, LayoutError, QuantcliError, RecipeError
from quantcli.formats.analysis import describe_module
from quantcli.formats.detect import Detected, all_names, scale_faults
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import DEFAULT_LAYOUT, Layout, get_layout, layouts_for
from quantcli.formats.layouts.base import Role
from quantcli.formats.module_kinds import is_dense_linear
from quantcli.model.transformers_view import view
from quantcli.planning.actions import Action
from quantcli.planning.consumer_names import output_heads
from quantcli.planning.fused_groups import drop_single_member_groups
from quantcli.planning.plan import Exclusion, Options, Plan, TensorPlan, output_specs
from quantcli.recipes import DENSE_RECIPES, get_recipe

DENSE_DTYPES = {"bf16": ("BF16", torch.bfloat16), "fp16": ("F16", torch.float16), "fp32": ("F32", torch.float32)}
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def requantize_dtype(source: Source) -> str:
    """The dtype a decoded module is cast to before a recipe whose scales take the weight's dtype
    (int4) re-quantizes it: the model's own (config.json `torch_dtype`, or transformers 5's
    `dtype`), else BF16. Engines run the model in that dtype and load `weight_scale` into a
    parameter of it (vLLM's CompressedTensorsWNA16 registers it in params_dtype), so scales in
    any other dtype would be rounded at load and no longer be the ones the codes were made with."""
    config = source.config
    named = config.get("torch_dtype") or config.get("dtype")
    return CONFIG_DTYPES.get(named, "BF16") if isinstance(named, str) else "BF16"


def _weight_dtype(recipe, action: str, model_dtype: str, desc) -> str | None:
    """The dtype the module is quantized in when the recipe's scales take it (a scale codec of
    dtype None; otherwise None): a re-layout keeps the source's scale dtype (the bytes carry
    over), a re-quantize uses the model's (requantize_dtype)."""
    if recipe.scale_codec.dtype is not None:
        return None
    if action == Action.RELAYOUT:
        return next(e.dtype for e in desc.tensors if e.role == Role.BLOCK_SCALE)
    return model_dtype


def refuse_corrupt_scales(source: Source, layout: Layout, module: str, recipe: str, ct: CheckpointTensors) -> None:
    """Every scale of a quantized source module is read while planning (they are small), so a
    corrupt one (NaN, Inf, zero or negative where no producer writes it) is refused before
    anything is written: dequantizing, re-laying out or re-quantizing it would write NaN, zero
    or sign-flipped weights without a word."""
    faults = scale_faults(layout, module, layout.recipe_for(recipe), ct)
    if faults:
        name, fault = faults[0]
        raise CheckpointError(f"{name}: {fault}; the source checkpoint {source.label} is corrupt (no correct "
                              f"producer writes this), so converting it would write wrong weights; run "
                              f"`quantcli verify {source.label}` to list every fault")


def _target(opts: Options) -> tuple[Layout | None, object]:
    """The layout and recipe to write (None, None for a dequantize to a plain dtype)."""
    if opts.recipe in DENSE_RECIPES:
        if opts.layout:
            raise QuantcliError(f"--layout {opts.layout}: --recipe {opts.recipe} writes a plain checkpoint; "
                                f"drop --layout")
        return None, None
    get_recipe(opts.recipe)  # unknown names fail here with the list
    layout = get_layout(opts.layout or DEFAULT_LAYOUT[opts.recipe])
    layout.require(opts.recipe, layouts_for(opts.recipe))
    # static activation scales come from calibrating the dense model, never from a quantized source
    layout.require_static(opts.recipe, False, layouts_for(opts.recipe))
    recipe = layout.recipe_for(opts.recipe, opts.scale_rule)
    if opts.scale_search != "none" and not recipe.searches:
        raise QuantcliError(f"--scale-search {opts.scale_search}: only nvfp4, mxfp4 and mxfp8 search their block "
                            f"scales ({opts.recipe} keeps absmax); drop the option")
    return layout, recipe.with_scale_search(opts.scale_search)


def _module_plan(det: Detected, module: str, src_recipe: str, ct: CheckpointTensors, names: dict,
                 opts: Options, layout: Layout | None, recipe, widened: set[str],
                 model_dtype: str) -> tuple[TensorPlan | None, list[str]]:
    """The plan of one quantized source module (or the problems that stop it) and its disk names;
    `model_dtype` is what a weight-dtype recipe re-quantizes in (requantize_dtype)."""
    src_layout = det.layout
    desc = describe_module(src_layout, module, src_recipe, ct)
    disk = [d.name for d in src_layout.describe(module, src_layout.recipe_for(src_recipe))]
    if desc.problems:
        return None, [f"{module}: {p}" for p in desc.problems]
    codes = disk[0]
    shape = tuple(desc.logical_shape)
    base = dict(name=codes, shard=names[codes], dtype=ct.info(codes).dtype, shape=shape, module=module,
                source_recipe=src_recipe, source_bytes=sum(ct.info(n).nbytes for n in disk))
    if recipe is None:
        out_name, transposed = src_layout.dense_name(module)
        out_shape = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
        return TensorPlan(**base, transpose=transposed, action=Action.DEQUANTIZE,
                          outputs=(OutSpec(out_name, DENSE_DTYPES[opts.recipe][0], out_shape),)), []
    try:
        recipe.check(module, shape, torch.float32)
        layout.check_shape(module, recipe, shape)
    except (RecipeError, LayoutError) as exc:
        return None, [str(exc)]
    action = "relayout" if src_recipe == recipe.name else "requantize"
    dtype = _weight_dtype(recipe, action, model_dtype, desc)
    if action == Action.RELAYOUT and dtype is None:  # scales that keep the weight's dtype are not widened
        widened.update(e.dtype for e in desc.tensors if e.role != Role.CODES and e.dtype in ("BF16", "F16"))
    group = fused_group_of(module) if recipe.has_global_scale and action == Action.REQUANTIZE else None
    return TensorPlan(**base, recipe=recipe.name, fused_group=group, action=action,
                      requantize_dtype=dtype if action == Action.REQUANTIZE else None,
                      outputs=output_specs(layout, module, recipe, shape, DTYPES[dtype or "F32"])), []


def _warnings(src_layout: Layout, opts: Options, source: Source, tensors: list[TensorPlan],
              widened: set[str]) -> list[str]:
    warnings = []
    if widened:
        warnings.append(f"{src_layout.name} scales stored as {'/'.join(sorted(widened))} are written as F32, "
                        f"which consumers expect: every {'/'.join(sorted(widened))} value is exactly an F32 value, "
                        f"so the re-layout stays lossless")
    if opts.scale_search != "none" and any(t.action == Action.RELAYOUT for t in tensors):
        warnings.append(f"--scale-search {opts.scale_search}: modules already {opts.recipe} in the source are "
                        f"re-laid out byte for byte, so they keep the source's scales (nothing is re-quantized)")
    if any(t.action == Action.REQUANTIZE for t in tensors):
        warnings.append(f"re-quantizing {src_layout.name} weights to {opts.recipe}: the errors of both "
                        f"quantizations add up")  # the summary's `next:` line gives the verify command
    return warnings


def make_reformat_plan(source: Source, opts: Options, det: Detected) -> Plan:
    if opts.overrides or opts.targets or opts.ignore:
        raise QuantcliError(f"{source.label}: is already quantized ({det.layout.name}); --ignore, targets and "
                            f"overrides apply to unquantized sources (modules dense in the source stay dense)")
    layout, recipe = _target(opts)
    names = all_names(source)
    errors: list[str] = []
    tensors: list[TensorPlan] = []
    consumed: set[str] = set()
    widened: set[str] = set()  # float scale dtypes of the source written as F32
    exclusions = []
    hf = view(source.config, [*det.modules, *(n[: -len(".weight")] for n in names if n.endswith(".weight"))])
    heads = output_heads(source.config, hf)
    with CheckpointTensors(source) as ct:
        for module, src_recipe in sorted(det.modules.items()):
            refuse_corrupt_scales(source, det.layout, module, src_recipe, ct)
            plan, problems = _module_plan(det, module, src_recipe, ct, names, opts, layout, recipe, widened,
                                          requantize_dtype(source))
            errors.extend(problems)
            if plan is not None:
                tensors.append(plan)
                consumed.update(d.name for d in det.layout.describe(module, det.layout.recipe_for(src_recipe)))
        for name, shard in names.items():
            if name in consumed:
                continue
            info = ct.info(name)
            tensors.append(TensorPlan(name, shard, info.dtype, info.shape, action=Action.COPY,
                                      outputs=(OutSpec(name, info.dtype, info.shape),)))
            if name.endswith(".weight") and len(info.shape) == 2 and (is_dense_linear(name[:-7]) or name[:-7] in heads):
                exclusions.append(Exclusion(name[:-7], "dense in the source"))
    if errors:
        raise QuantcliError(f"{len(errors)} problem(s) converting {source.label}: " + "; ".join(errors))
    return Plan(source, layout, opts, drop_single_member_groups(tensors), exclusions,
                _warnings(det.layout, opts, source, tensors, widened),
                {recipe.name: recipe} if recipe else {}, source_layout=det.layout,
                dense_dtype=opts.recipe if recipe is None else None, transformers=hf)
