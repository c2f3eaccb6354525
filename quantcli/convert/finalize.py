"""After the shards: the index, config.json (with the layout's quantization_config), the
layout's extra files, copied files, the model card, and the manifest, from the plan and what
the shards learned."""

from __future__ import annotations

import importlib
import shutil
import threading
from dataclasses import replace
from pathlib import Path

from quantcli import __version__
from quantcli.calibrate.record import calibrated_entries, calibration_record
from quantcli.checkpoint.manifest import DiskEntry, Manifest, ModuleEntry
from quantcli.checkpoint.source import INDEX
from quantcli.convert.progress import write_json_atomic
from quantcli.convert.records import Findings
from quantcli.formats.layouts.base import Role, stored_value
from quantcli.planning.actions import Action
from quantcli.planning.plan import Plan, TensorPlan
from quantcli.planning.transforms import record as transform_record


def import_ahead() -> None:
    """Import the model card's module on a helper thread while the shards are converted: its
    huggingface_hub and yaml cost ~0.15 s, which start-up no longer pays (`write_side_files`'
    own import then finds it loaded, or waits for it: imports lock per module)."""
    threading.Thread(target=importlib.import_module, args=("quantcli.convert.model_card",), daemon=True,
                     name="quantcli-import").start()


def write_side_files(plan: Plan, stage: Path) -> None:
    """Everything but the shards and the manifest."""
    from quantcli.convert.model_card import write_model_card

    source = plan.source
    if source.weight_map or len(source.shards) > 1:
        weight_map = {o.name: t.shard for t in plan.tensors for o in t.outputs}
        index = {"metadata": {"total_size": plan.bytes_out}, "weight_map": dict(sorted(weight_map.items()))}
        write_json_atomic(stage / INDEX, index)
    for rel in source.other_files():
        target = stage / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source.root / rel, target)
    write_json_atomic(stage / "config.json", _write_configs(plan, stage))
    write_model_card(plan, stage)


def _write_configs(plan: Plan, stage: Path) -> dict:
    """The layout's extra files; returns config.json: the source's, with the layout's
    quantization_config (none for a dense output). Targets and exclusions name each module as the
    checkpoint does and as transformers does where that differs (planning/consumer_names.py)."""
    groups, excluded = plan.consumer_modules_by_recipe(), plan.excluded_names()
    config = dict(plan.source.config)
    config.pop("quantization_config", None)
    if plan.layout is not None and any(t.quantized for t in plan.tensors):
        config["quantization_config"] = plan.layout.quantization_config(groups, excluded)
        extra = plan.layout.extra_files(groups, excluded)
        opts = plan.options
        if opts.activations == "static" or opts.kv_cache == "fp8":
            plan.layout.declare_calibration(config["quantization_config"], extra, groups,
                                            static=opts.activations == "static", kv_fp8=opts.kv_cache == "fp8")
        for name, obj in extra.items():
            write_json_atomic(stage / name, obj)
    return config


def build_manifest(plan: Plan, fp: str, found: Findings) -> Manifest:
    modules = [_manifest_module(plan, t, found) for t in plan.tensors if t.quantized]
    excluded = tuple(plan.excluded_names()) if plan.layout is not None else ()
    rounding = plan.options.rounding.record() if plan.options.rounding.data_aware else None
    transforms = transform_record(plan.options.rotate, plan.transforms) if plan.transforms else None
    return Manifest(__version__, plan.target, plan.options.recipe, plan.source.describe(), fp, tuple(modules),
                    excluded, lossless=plan.lossless, notes=tuple(found.note_list()),
                    calibration=calibration_record(plan), rounding=rounding, transforms=transforms,
                    auto=plan.options.auto_choice.record() if plan.options.auto_choice is not None else None)


def _manifest_module(plan: Plan, t: TensorPlan, found: Findings) -> ModuleEntry:
    recipe = plan.recipes[t.recipe]
    specs = {o.name: o for o in t.outputs}
    disk = []
    for d in plan.layout.describe(t.module, recipe):
        o = specs[d.name]
        value = None
        if d.role == Role.GLOBAL_SCALE:
            value = stored_value(found.globals[t.module], d.direction)
        disk.append(DiskEntry(d.name, d.role, o.dtype, o.shape, d.encoding, d.direction, value))
    disk += calibrated_entries(plan.layout, t, recipe, {d.name for d in disk})
    entry = module_entry(t, recipe, tuple(disk))
    if t.action == Action.RELAYOUT and recipe.scale_rules:  # the bytes are the source producer's
        entry = replace(entry, scale_rule=f"as in the {plan.source_layout.name} source")
    if t.action == Action.RELAYOUT:  # so are the scales: no search chose them
        entry = replace(entry, scale_search=None)
    if found.weighted.get(t.module):  # calibration statistics weighted the search
        entry = replace(entry, scale_search_weights=found.weighted[t.module])
    if found.rounding.get(t.module):  # a weight pass rounded it from the calibration data
        entry = replace(entry, rounding=found.rounding[t.module])
    if t.action == Action.REQUANTIZE:  # verify against the original model adds this error to its yardstick
        entry = replace(entry, requantized_from=t.source_recipe, requantize_rel_err=found.errors.get(t.module))
    return entry


def module_entry(t: TensorPlan, recipe, disk: tuple[DiskEntry, ...]) -> ModuleEntry:
    """The manifest entry: where the tensor came from (the plan), what was computed (the
    recipe's own description of its element, block and scales) and what is on disk."""
    return ModuleEntry(
        module=t.module, source_name=t.name, source_dtype=t.dtype, logical_shape=t.logical_shape,
        recipe=recipe.name, transposed_from_source=t.transpose, fused_group=t.fused_group, tensors=disk,
        **recipe.manifest_fields())
