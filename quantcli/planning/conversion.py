"""The one entry point of planning: `plan_conversion(source, options)`. The source's layout is
detected once, here; a dense source is planned by plan.make_plan, a quantized one (re-layout,
re-quantize, dequantize) by from_quantized.make_reformat_plan, and a calibrated run's checks and
tensors are added by calibration.checked_plan. Without a recipe, a quantized source keeps its
own: `convert SRC DST --layout L` is a re-layout."""

from __future__ import annotations

from dataclasses import replace

from quantcli.checkpoint.safetensors_io import OutSpec
from quantcli.checkpoint.source import Source
from quantcli.errors import CheckpointError, QuantcliError
from quantcli.formats.consistency import CONFIG_NAME, config_fix, contradictions, missing_config, undeclared_codes_in
from quantcli.formats.detect import Detected, detect
from quantcli.planning.actions import Action
from quantcli.planning.auto import check_choice, explained
from quantcli.planning.calibration import checked_plan
from quantcli.planning.from_quantized import DENSE_DTYPES, make_reformat_plan
from quantcli.planning.plan import Options, Plan, TensorPlan, make_plan
from quantcli.planning.transforms import with_transforms
from quantcli.recipes import DENSE_RECIPES, RECIPES


def plan_conversion(source: Source, opts: Options) -> Plan:
    """The plan for converting `source` with `opts`, from headers (and a quantized source's scales)."""
    if opts.auto is not None:  # the choice needs the scoring walk (evaluate/auto_scores.py), not planning alone
        raise QuantcliError("--auto (or auto in --config): only `quantcli convert` chooses formats; give a recipe "
                            "here, or convert with --auto")
    missing = missing_config(source)
    if missing is not None:  # the output would load nowhere: refused before any work
        raise CheckpointError(f"{source.label}: {CONFIG_NAME} {missing}; nothing converted: {config_fix(source)}")
    found = detect(source)
    stale = _config_against_tensors(source, found)
    detected = found if found is not None and found.modules else None
    if not opts.recipe:
        opts = replace(opts, recipe=default_recipe(source, detected))
    if detected is not None:
        plan = make_reformat_plan(source, opts, detected)
    elif opts.recipe in DENSE_RECIPES and opts.rotate:  # a transform alone: the dense model, rotated
        plan = with_transforms(dense_plan(source, opts), DENSE_DTYPES[opts.recipe][0])
    elif opts.recipe in DENSE_RECIPES:
        raise QuantcliError(f"--recipe {opts.recipe}: the source {source.label} is not quantized; "
                            "nothing to dequantize")
    else:
        plan = make_plan(source, opts)
    plan = checked_plan(with_transforms(plan) if not plan.transforms else plan)
    if opts.auto_choice is not None:
        check_choice(plan, opts.auto_choice)
        plan = explained(plan, opts.auto_choice)
    return replace(plan, warnings=[*stale, *plan.warnings]) if stale else plan


def dense_plan(source: Source, opts: Options) -> Plan:
    """Every tensor of a dense source copied: what a transform-only conversion starts from."""
    if opts.calibration is not None or opts.rounding.data_aware:
        raise QuantcliError(f"--recipe {opts.recipe}: a dense output has nothing to calibrate or round; drop "
                            f"--calibration and --rounding, or choose a quantizing recipe")
    tensors = [TensorPlan(name, shard, info.dtype, tuple(info.shape), action=Action.COPY,
                          outputs=(OutSpec(name, info.dtype, tuple(info.shape)),))
               for shard, header in source.headers.items() for name, info in header.tensors.items()
               if not source.weight_map or source.weight_map.get(name) == shard]
    return Plan(source, None, opts, tensors, [], [], {}, dense_dtype=opts.recipe)


def _config_against_tensors(source: Source, det: Detected | None) -> list[str]:
    """Refuse codes that no config declares (they would be read as weights); a quantization
    config over dense weights is a warning: the output's config replaces it."""
    found = contradictions(source, det)
    if found and (det is None or undeclared_codes_in(source)):
        raise CheckpointError(f"{source.label}: {found[0]}; nothing converted")
    return [f"{CONFIG_NAME}: {w}; converting the tensors as the dense weights they are, and the output's "
            f"{CONFIG_NAME} replaces that quantization config" for w in found]


def default_recipe(source: Source, detected: Detected | None) -> str:
    """The recipe a conversion without --recipe writes: the quantized source's own, when it has one."""
    choices = f"{', '.join(RECIPES)} (or {'/'.join(DENSE_RECIPES)} to dequantize a quantized source)"
    if detected is None:
        raise QuantcliError(f"--recipe is required: {source.label} is not quantized; choose one of {choices}, "
                            f"or set 'recipe' in --config")
    recipes = sorted(set(detected.modules.values()))
    if len(recipes) > 1:
        raise QuantcliError(f"--recipe is required: {source.label} mixes {', '.join(recipes)}, so there is no one "
                            f"recipe to keep; choose one of {choices}")
    return recipes[0]
