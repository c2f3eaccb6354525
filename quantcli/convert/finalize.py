"""After the shards: the index, config.json (with the layout's quantization_config), the
layout's extra files, copied files, the model card, and the manifest, from the plan and what
the shards learned."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from .. import __version__
from ..calibrate.record import calibrated_entries, calibration_record
from ..layouts.base import stored_value
from ..manifest import MANIFEST_NAME, DiskEntry, Manifest, ModuleEntry
from ..plan import Plan, TensorPlan
from ..source import INDEX
from .progress import write_json_atomic
from .records import Findings


def write_side_files(plan: Plan, stage: Path) -> None:
    """Everything but the shards and the manifest."""
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
    readme = stage / "README.md"
    readme.write_text(with_model_card(readme.read_text() if readme.exists() else "", model_card(plan)))


CARD_HEADING = "## Quantization (quantcli)"


def with_model_card(text: str, card: str) -> str:
    """`text` (the source's README) with `card` appended, or in place of the quantcli section a
    quantized source already carries (from its heading to the next '## ' heading or the end)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == CARD_HEADING), None)
    if start is None:
        return text + ("\n" if text and not text.endswith("\n") else "") + card
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while start > 0 and not lines[start - 1].strip():  # the card brings its own blank line
        start -= 1
    head, tail = "".join(lines[:start]), "".join(lines[end:])
    if tail:
        card = card.rstrip("\n") + "\n\n"
    return head + card + tail


def _write_configs(plan: Plan, stage: Path) -> dict:
    """The layout's extra files; returns config.json: the source's, with the layout's
    quantization_config (none for a dense output)."""
    groups, excluded = plan.modules_by_recipe(), plan.excluded_names()
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


def model_card(plan: Plan) -> str:
    lines = ["", "## Quantization (quantcli)", ""]
    if plan.layout is None:
        lines += [f"Dequantized to {plan.dense_dtype} from the {plan.source_layout.name} checkpoint "
                  f"`{plan.source.label}` with quantcli {__version__}: a plain checkpoint, no quantization_config.", ""]
        return "\n".join(lines)
    what = {"relayout": "carried over byte for byte", "requantize": "decoded and re-quantized",
            "quantize": "quantized"}
    lines += [f"Converted from `{plan.source.label}` with quantcli {__version__}, layout `{plan.layout.name}` "
              f"(loads in {plan.layout.consumers}).", "",
              "| recipe | modules | scale rule | how |", "|---|---|---|---|"]
    for name, mods in sorted(plan.modules_by_recipe().items()):
        actions = sorted({what[t.action] for t in plan.tensors if t.recipe == name})
        lines.append(f"| {name} | {len(mods)} | {plan.recipes[name].scale_rule or '-'} | {', '.join(actions)} |")
    lines += ["", f"Left unquantized ({plan.layout.exclusion_key}): "
              + ", ".join(f"`{n}`" for n in plan.excluded_names()), "",
              f"Every quantized tensor, its scales and their direction are listed in `{MANIFEST_NAME}`.", ""]
    return "\n".join(lines)


def build_manifest(plan: Plan, fp: str, found: Findings) -> Manifest:
    modules = [_manifest_module(plan, t, found) for t in plan.tensors if t.quantized]
    excluded = tuple(plan.excluded_names()) if plan.layout is not None else ()
    return Manifest(__version__, plan.target, plan.options.recipe, plan.source.describe(), fp, tuple(modules),
                    excluded, lossless=plan.lossless, notes=tuple(found.note_list()),
                    calibration=calibration_record(plan))


def _manifest_module(plan: Plan, t: TensorPlan, found: Findings) -> ModuleEntry:
    recipe = plan.recipes[t.recipe]
    specs = {o.name: o for o in t.outputs}
    disk = []
    for d in plan.layout.describe(t.module, recipe):
        o = specs[d.name]
        value = None
        if d.role == "global_scale":
            value = stored_value(found.globals[t.module], d.direction)
        disk.append(DiskEntry(d.name, d.role, o.dtype, o.shape, d.encoding, d.direction, value))
    disk += calibrated_entries(plan.layout, t, recipe, {d.name for d in disk})
    entry = module_entry(t, recipe, tuple(disk))
    if t.action == "relayout" and recipe.scale_rules:  # the bytes are the source producer's
        entry = replace(entry, scale_rule=f"as in the {plan.source_layout.name} source")
    if t.action == "requantize":  # verify against the original model adds this error to its yardstick
        entry = replace(entry, requantized_from=t.source_recipe, requantize_rel_err=found.errors.get(t.module))
    return entry


def module_entry(t: TensorPlan, recipe, disk: tuple[DiskEntry, ...]) -> ModuleEntry:
    """The manifest entry: where the tensor came from (the plan), what was computed (the
    recipe's own description of its element, block and scales) and what is on disk."""
    return ModuleEntry(
        module=t.module, source_name=t.name, source_dtype=t.dtype, logical_shape=t.logical_shape,
        recipe=recipe.name, transposed_from_source=t.transpose, fused_group=t.fused_group, tensors=disk,
        **recipe.manifest_fields())
