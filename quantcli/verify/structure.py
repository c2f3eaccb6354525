"""Checks that need no reference: manifest, config, servability, tensor dtypes and shapes, fused
global scales, coverage, and, per module read back, scales, TP split and finiteness. Each check
is a function that returns its (tensor, fault) findings; the caller files them (Findings.record)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

import torch

from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import QuantcliError
from quantcli.formats.analysis import (
    ModuleDescription,
    dense_expert_stacks,
    describe_module,
    exclusion_list,
    fused_mismatches,
    is_excluded,
    linear_modules,
)
from quantcli.formats.decode import decode_module
from quantcli.formats.detect import all_names, block_scale_fault, global_scale_fault
from quantcli.formats.engines import NO, SGLANG, VLLM, verdicts
from quantcli.formats.experts import experts_module
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import layouts_for, module_of
from quantcli.kernels.decode import scale_values
from quantcli.kernels.spec import SCALE_SEARCHES
from quantcli.planning.plan import matches
from quantcli.verify.findings import CONFIG, COVERAGE, FINITE, FUSED, MANIFEST, SCALES, SERVABLE, TENSORS, TP, Findings

ROW_PARALLEL = re.compile(r"(o_proj|down_proj|w2|dense|out_proj|fc2|wo)$")
Finding = tuple[str, str]  # (tensor or module, what is wrong)
# progress(phase, done, total, current): before each module (`current`), and once at the end with
# done == total and current "" (the command line draws it as a bar; the library prints nothing)
Progress = Callable[[str, int, int, str], None]


def no_progress(phase: str, done: int, total: int, current: str) -> None:
    return None


def scale_rule_of(rule: str | None) -> str | None:
    """A manifest's recorded MX scale rule, if it is one quantcli knows."""
    return rule if rule in ("floor", "even", "rceil") else None


def manifest_faults(source, det) -> Iterator[Finding]:
    for p in det.manifest.check_headers(source.headers):
        yield p.split(":")[0], "manifest/header mismatch: " + p.split(": ", 1)[1]


def servable_faults(det) -> Iterator[Finding]:
    layout = det.layout
    for recipe_name in sorted(set(det.modules.values()) & set(layout.unservable)):
        users = sorted(m for m, r in det.modules.items() if r == recipe_name)
        yield (users[0] if len(users) == 1 else f"{len(users)} modules ({users[0]}, ...)",
               f"{recipe_name} in the {layout.name} layout: no serving engine loads that (recipe, layout) pair; "
               f"layouts that do: {', '.join(layouts_for(recipe_name))}; re-layout losslessly with "
               f"`quantcli convert SRC DST --recipe {recipe_name} --layout {layouts_for(recipe_name)[0]}`")


def describe_selected(det, qt: CheckpointTensors, pattern: str | None) -> dict[str, ModuleDescription]:
    return {module: describe_module(det.layout, module, recipe_name, qt)
            for module, recipe_name in sorted(det.modules.items()) if not pattern or matches(pattern, module)}


def tensor_faults(modules: dict[str, ModuleDescription]) -> Iterator[Finding]:
    for module, desc in modules.items():
        for p in desc.problems:
            yield module, p


def fused_faults(modules: dict[str, ModuleDescription]) -> Iterator[Finding]:
    for f in fused_mismatches(list(modules.values())):
        yield f.group, f"fused group has different global scales {f.global_scales}; engines need one"


def fused_precision_faults(source, det, qt: CheckpointTensors) -> Iterator[Finding]:
    """Engines run a fused group (q/k/v, gate/up, w1/w3) as one GEMM of one precision: a group that
    mixes quantized and dense members, or two recipes, does not load (vLLM refuses the layer)."""
    groups: dict[str, dict[str, str]] = {}
    for module in set(linear_modules(all_names(source), qt)) | set(det.modules):
        group = fused_group_of(module)
        if group is not None:
            groups.setdefault(group, {})[module] = det.modules.get(module, "dense")
    for group, members in sorted(groups.items()):
        if len(set(members.values())) > 1:
            kinds = ", ".join(f"{m.rsplit('.', 1)[-1]} {r}" for m, r in sorted(members.items()))
            yield group, f"fused group mixes precisions ({kinds}); engines run it as one GEMM of one precision"


def coverage_faults(source, det, config: dict, qt: CheckpointTensors) -> Iterator[Finding]:
    excluded, names = exclusion_list(config), all_names(source)
    for module in linear_modules(names, qt):
        if module not in det.modules and not is_excluded(module, excluded):
            yield module, "Linear is neither quantized nor in the exclusion list"
    for experts, stacks in dense_expert_stacks(names, qt).items():
        if not is_excluded(experts, excluded) and any(module_of(n) not in det.modules for n in stacks):
            yield experts, ("MoE expert stack left dense is not in the exclusion list (an engine would load it as "
                            "quantized)")
    for module in det.modules:  # the reverse: a quantized expert whose whole MoE layer is listed as dense
        layer = experts_module(module)
        if layer != module_of(module) and is_excluded(layer, excluded):
            yield module, (f"quantized, but its MoE layer {layer} is in the exclusion list (an engine would load "
                           f"it as dense)")


def structure_checks(source, det, config: dict, qt: CheckpointTensors, pattern: str | None,
                     findings: Findings) -> dict[str, ModuleDescription]:
    """Manifest, config, servability, tensor dtypes/shapes, fused globals, coverage; returns the
    described modules (those `pattern` selects)."""
    if det.manifest is not None:
        findings.record(MANIFEST, manifest_faults(source, det))
    findings.record(CONFIG, (("config.json", p) for p in det.layout.config_problems(source.config, det.extra_files)))
    findings.record(SERVABLE, servable_faults(det))
    modules = describe_selected(det, qt, pattern)
    findings.record(TENSORS, tensor_faults(modules))
    findings.record(FUSED, fused_faults(modules))
    findings.record(FUSED, fused_precision_faults(source, det, qt))
    findings.record(COVERAGE, coverage_faults(source, det, config, qt))
    return modules


def scale_faults(module: str, recipe, q) -> Iterator[Finding]:
    """The values no correct producer writes, by the one rule convert also refuses a source by
    (quantcli/formats/detect.py): NaN or negative block scales, E8M0 255, a global scale not finite and > 0."""
    block = block_scale_fault(recipe.scale_encoding, q.scale)
    if block is not None:
        yield module, block
    if q.global_scale is not None:
        fault = global_scale_fault(float(q.global_scale))
        if fault is not None:
            yield module, fault


def tp_engines(recipe: str, layout: str) -> str:
    """`vLLM and SGLang refuse`: the tensor-parallel engines whose verdict on the pair
    (quantcli/formats/engines.py) is not `no` (a pair outside the table: both)."""
    by_engine = verdicts(recipe, layout)
    names = [e for e in (VLLM, SGLANG) if e not in by_engine or by_engine[e].status != NO]
    if not names:
        return "a tensor-parallel engine would refuse"
    return f"{' and '.join(names)} refuse{'s' if len(names) == 1 else ''}"


def tp_faults(module: str, recipe, shape, tp: int, layout: str = "") -> Iterator[Finding]:
    n, k = shape[-2], shape[-1]
    if ROW_PARALLEL.search(module):
        dim, size, block = "input dim K", k, recipe.block[1] or k
    else:
        dim, size, block = "output dim N", n, recipe.block[0] if recipe.block[0] > 1 else 1
    if size % tp or (size // tp) % block:
        whole = f"whole {block}-wide blocks" if block > 1 else "equal parts"
        yield module, (f"{dim}={size} does not split into {whole} across --tp {tp} ranks "
                       f"({size}/{tp} = {size / tp:g}); {tp_engines(recipe.name, layout)} to load it at TP={tp}")


def nonfinite_fault(bad: int) -> str:
    return (f"decodes to {bad} non-finite value(s) (a block scale times its codes overflows FP32): the "
            f"checkpoint is corrupt; re-quantize it from the source weights")


def finite_faults(module: str, decoded: torch.Tensor) -> list[Finding]:
    bad = int((~torch.isfinite(decoded)).sum())
    return [(module, nonfinite_fault(bad))] if bad else []


def surely_finite(recipe, q) -> bool:
    """Whether every value of `q` decodes finitely, from its scales and code bytes alone: no E4M3
    NaN code (0x7F, 0xFF) and the largest element times the largest effective scale stays below
    FP32's maximum. False means: decode it and count (a corrupt checkpoint, rare)."""
    if q.codes.numel() == 0:
        return True
    if recipe.element.name == "e4m3" and bool(((q.codes.view(torch.uint8) & 0x7F) == 0x7F).any()):
        return False
    scale = scale_values(q.scale, q.global_scale, recipe.spec).abs()
    top = float(scale.max()) if scale.numel() else 0.0
    return math.isfinite(top) and recipe.element_max * top < torch.finfo(torch.float32).max / 2


def finite_check(module: str, decoded: torch.Tensor, findings: Findings) -> bool:
    """File the module's non-finite values under FINITE; whether it decoded to finite values only."""
    faults = finite_faults(module, decoded)
    for tensor, what in faults:
        findings.fault(FINITE, tensor, what)
    return not faults


def read_modules(det, modules: dict[str, ModuleDescription], qt: CheckpointTensors, tp: int | None,
                 findings: Findings, *, decode: bool, dev, progress: Progress = no_progress) -> dict:
    """Read each well-formed module back; scale checks, TP split, and (without a reference, which
    decodes them anyway) the finiteness of the decoded weights. Returns module -> (recipe, q)."""
    layout = det.layout
    rules = {m.module: m.scale_rule for m in det.manifest.modules} if det.manifest else {}
    searches = {m.module: m.scale_search for m in det.manifest.modules} if det.manifest else {}
    out: dict[str, tuple] = {}
    for done, (module, desc) in enumerate(modules.items()):
        progress("reading", done, len(modules), module)
        if desc.problems:
            continue
        recipe = layout.recipe_for(desc.recipe, scale_rule_of(rules.get(module)))
        if searches.get(module) in SCALE_SEARCHES:  # --exact and the yardstick re-quantize as convert did
            recipe = recipe.with_scale_search(searches[module])
        try:
            q = layout.from_disk(module, recipe, qt.get, qt.where)
        except QuantcliError as exc:  # a malformed module is a finding; anything else is a bug
            findings.fault(TENSORS, module, f"cannot be read back: {exc}")
            continue
        for tensor, what in scale_faults(module, recipe, q):
            findings.fault(SCALES, tensor, what)
        for tensor, what in (tp_faults(module, recipe, q.shape, tp, layout.name) if tp else ()):
            findings.fault(TP.format(tp=tp), tensor, what)
        if decode:
            if not surely_finite(recipe, q):
                finite_check(module, decode_module(layout, module, recipe, q, device=dev), findings)
            for d in layout.describe(module, recipe):
                qt.release(d.name)
        out[module] = (recipe, q)
    progress("reading", len(modules), len(modules), "")
    findings.ran(SCALES)
    if decode:
        findings.ran(FINITE)
    if tp:
        findings.ran(TP.format(tp=tp))
    return out
