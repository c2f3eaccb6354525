"""`quantcli verify`: decode a quantized checkpoint tensor by tensor and prove it is right.

Structural checks need no reference. With `--reference`, every quantized tensor is compared with
the reference, and fails when its error exceeds quantcli's own quantization of the same reference
tensor (same recipe, same global amax rule) by more than real producers' arithmetic ever does
(measured, see TOLERANCE_FLOOR): that catches a scale one step off or a scrambled block that an
absolute threshold would let through. Unquantized tensors must be bit-identical. `--exact`
re-quantizes and compares bytes. Each check's status comes from the faults filed under it.

A quantized reference (the source of a re-layout or re-quantization) is decoded module by module
through its own layout: a module of the same recipe must decode identically, another recipe is
judged against quantcli's quantization of the decoded reference. A module convert re-quantized
from a quantized source, checked against the original dense model, may carry both errors (the
manifest records the second). A checkpoint with no quantized modules is checked for identity.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .convert import resolve_device
from .decode import decode_module
from .detect import all_names, config_with_extras, detect
from .errors import QuantcliError, RecipeError
from .facts import ModuleFacts
from .inspect import exclusion_list, fused_mismatches, is_excluded, linear_modules, describe_module
from .layouts import layouts_for
from .plan import TRANSPOSED_EXPERTS, fused_group_of, matches
from .recipes import RECIPES, get_recipe
from .source import open_source
from .tensors import CheckpointTensors

METRICS = ("rel_err", "sqnr_db", "cosine", "margin")
ABS_FLOOR = 1e-6  # slack for tensors whose own error is ~0 (exactly representable weights)

# How much worse (relative L2 error) than quantcli's own quantization of the same reference tensor
# a decoded tensor may be. Real producers round differently (BF16 intermediates, scales stored in
# BF16, other element tie rules); corruptions land far off. Measured with the producers' own code
# (tests/test_faults_verify.py builds the same checkpoints) on 300 tensors per producer: normal,
# Student-t(3), outlier rows/columns, amax > 2688 (s2 > 1), FP16 and FP32 sources; shapes [1, 32]
# to [512, 128]. Ratio = rel err / quantcli's own; corruptions: min over all sizes / over tensors of
# >= 16k elements. ModelOpt's NVFP4 and FP8 arithmetic is quantcli's own (ratio 1, bit-exact).
#
#   recipe (producer)     producers max   corruption min ratio (all / >= 16k elements)
#   nvfp4 (CT)            1.033 [2,256]   nibbles swapped 12/14.8, scales transposed 2.3/3.5,
#                                         scales shifted 1.01*/3.5, scale x2 1.14*/8.6, global
#                                         inverted 1.17*/5.3, codes of another tensor 12.7/14.1,
#                                         E4M3 scale byte -1 0.91*/1.29 (+1: 1.02*/1.44)
#   nvfp4 (CT, fused)     1.021 [2,256]   nibbles 13.7, transposed 2.9, shifted 1.8, x2 9.4,
#                                         global inverted 9.0, other codes 11.9
#   mxfp4 (CT, even)      1.000           nibbles 8.3, transposed 2.9, shifted 3.1, exponent +1 5.9,
#                                         exponent -1 2.7, other codes 9.0
#   mxfp4 (ModelOpt)      1.000           nibbles 5.7, transposed 2.2, shifted 1.9, exponent +1 3.6,
#                                         exponent -1 2.7, other codes 8.7
#   mxfp8 (CT)            1.000           transposed 11.3, shifted 12, exponent +1 23.6, -1 13.3
#   fp8-block (CT, BF16)  1.060 [2,256]   transposed 1.01*/1.01*, shifted 1.26, scale x2 36,
#                                         x1.125 4.6, other codes 37.5
#   fp8-channel (CT,BF16) 1.160 [1,32]    shifted 3.4, x2 33, x1.125 4.0, other codes 36
#   fp8-channel (ModelOpt)1.000           shifted 1.04*/4.5, x2 34, x1.125 4.4, other codes 37
#
# * below the bound only where the corruption barely changes the decoded weights: permuting
#   near-equal block scales (2-block tensors, i.i.d. random blocks), inverting a global with s2 ~ 1,
#   or one E4M3 mantissa step on tensors under ~1k elements; such a tensor decodes within the
#   producers' own spread, which no error comparison can tell from a correct one.
#
# Producers' excess shrinks with tensor size (a few blocks rounded differently weigh more in a small
# tensor), so the allowed margin is a floor plus a term that fades with size:
#     margin = TOLERANCE_FLOOR + TOLERANCE_NOISE / sqrt(max(1, numel / 128))
# 10 % for large tensors, 35 % at [2, 256], 60 % at [1, 32]: above every producer with room
# (x3 or more their excess), below every corruption that changes the decoded weights.
TOLERANCE_FLOOR = 0.10
TOLERANCE_NOISE = 0.5


def allowed_margin(numel: int) -> float:
    return TOLERANCE_FLOOR + TOLERANCE_NOISE / math.sqrt(max(1.0, numel / 128))


ROW_PARALLEL = re.compile(r"(o_proj|down_proj|w2|dense|out_proj|fc2|wo)$")


@dataclass
class Limits:
    margin: float | None = None  # per recipe (TOLERANCE) unless --threshold margin=... sets one for all
    rel_err: float | None = None  # absolute cap, if given
    sqnr_db: float | None = None  # minimum
    cosine: float | None = None  # minimum


def parse_thresholds(items: list[str]) -> Limits:
    limits = Limits()
    for item in items:
        key, _, value = item.partition("=")
        if key not in METRICS or not value:
            raise QuantcliError(f"--threshold {item!r}: write METRIC=VALUE with METRIC one of {', '.join(METRICS)}")
        try:
            setattr(limits, key, float(value))
        except ValueError:
            raise QuantcliError(f"--threshold {item!r}: {value!r} is not a number") from None
    return limits


def metrics(decoded: torch.Tensor, ref: torch.Tensor) -> dict:
    d, r = decoded.double().flatten(), ref.double().flatten()
    err = (d - r).norm()
    rn = r.norm()
    rel = float(err / rn) if rn > 0 else float(err)
    sqnr = float(20 * torch.log10(rn / err)) if err > 0 and rn > 0 else math.inf
    cos = float(torch.nn.functional.cosine_similarity(d, r, dim=0)) if rn > 0 and d.norm() > 0 else 1.0
    return {"rel_err": rel, "sqnr_db": sqnr, "cosine": cos, "max_abs": float((d - r).abs().max()) if d.numel() else 0.0}


def _layer_of(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def config_problems(layout_name: str, config: dict, extras: dict) -> list[str]:
    qc = config.get("quantization_config") or {}
    problems = []
    if layout_name == "modelopt":
        section = (extras.get("hf_quant_config.json") or {}).get("quantization") or qc
        for key in ("quant_algo", "exclude_modules" if "quantization" in (extras.get("hf_quant_config.json") or {})
                    else "ignore"):
            if not section.get(key):
                problems.append(f"modelopt config lacks a non-empty {key!r} (vLLM/SGLang need it)")
        if "NVFP4" in str(section.get("quant_algo", "")).upper():
            if "group_size" not in section:
                problems.append("modelopt NVFP4 config lacks 'group_size' (vLLM requires it)")
            if "kv_cache_quant_algo" not in section and "kv_cache_scheme" not in section:
                problems.append("modelopt NVFP4 config lacks 'kv_cache_quant_algo' (vLLM requires the key)")
    elif layout_name == "compressed-tensors":
        for key in ("config_groups", "format"):
            if not qc.get(key):
                problems.append(f"compressed-tensors quantization_config lacks {key!r}")
    elif layout_name == "fp8":
        if qc.get("quant_method") == "fp8" and qc.get("activation_scheme") not in ("static", "dynamic"):
            problems.append("fp8 quantization_config lacks 'activation_scheme' (vLLM requires it)")
    return problems


# Every check verify runs, in report order. Each gets its status from the faults filed under it,
# so the report never says "checked" before the result is known.
MANIFEST = "manifest agrees with the safetensors headers"
CONFIG = "config keys the consumer needs are present"
SERVABLE = "a serving engine loads each (recipe, layout) pair"
TENSORS = "quantized tensors have the dtypes and shapes the layout reads"
FUSED = "fused groups share one global scale"
COVERAGE = "every Linear is quantized or excluded"
SCALES = "scales finite, positive, no E8M0 255"
FINITE = "every quantized module decodes to finite values"
DIRECTION = "global scales agree in direction with the rest of the checkpoint"
TP = "quantized dims split into whole blocks across {tp} ranks"
REF_MODULES = "every quantized module has a reference tensor of the same shape"
REF_ERROR = "decoded weights within the producers' tolerance of the reference"
REF_SAME = "modules of the same recipe identical to the decoded reference (lossless re-layout)"
REF_PRESENT = "every reference tensor present in the checkpoint"
REF_IDENTICAL = "unquantized tensors bit-identical to the reference"


class Findings:
    """Faults filed under the check that found them, and the checks run, in order."""

    def __init__(self) -> None:
        self.faults: list[dict] = []
        self.checks: list[str] = []

    def fault(self, check: str, tensor: str, what: str) -> None:
        self.faults.append({"check": check, "tensor": tensor, "fault": what})

    def ran(self, check: str) -> None:
        if check not in self.checks:
            self.checks.append(check)

    def summary(self) -> list[dict]:
        counts = {c: 0 for c in self.checks}
        for f in self.faults:
            counts[f["check"]] = counts.get(f["check"], 0) + 1
        return [{"check": c, "passed": n == 0, "faults": n} for c, n in counts.items()]


def verify_checkpoint(quant: str, reference: str | None = None, revision: str | None = None,
                      pattern: str | None = None, exact: bool = False, tp: int | None = None,
                      limits: Limits | None = None, device: str = "auto") -> dict:
    limits = limits or Limits()
    dev = resolve_device(device)
    source = open_source(quant)
    det = detect(source)
    if det is None or not det.modules:
        if reference is None:
            raise QuantcliError(f"{quant}: no quantized modules found (no modelopt, compressed-tensors, fp8 or gpt-oss "
                                f"layout detected); an unquantized (e.g. dequantized) checkpoint is checked for "
                                f"identity with the one it came from: pass --reference SRC")
        if pattern is not None:
            _require_selection(pattern, source, None)
        return _verify_unquantized(source, reference, revision, pattern, dev)
    if pattern is not None:
        _require_selection(pattern, source, det)
    layout = det.layout
    config = config_with_extras(source, det.extra_files)
    found = Findings()
    rows: list[dict] = []
    reference_kind = None
    with CheckpointTensors(source) as qt:
        modules = _structure_checks(source, det, config, qt, pattern, found)
        decoded_cache = _read_modules(det, modules, qt, tp, found, decode=reference is None, dev=dev)
        _direction_check(decoded_cache, qt, det, found)
        if reference is not None:
            rows, reference_kind = _reference_checks(reference, revision, det, decoded_cache, qt, pattern, exact,
                                                     limits, dev, found)
    return _report(source, layout.name, reference, reference_kind, len(modules), found, rows)


def _report(source, layout_name: str, reference: str | None, reference_kind: str | None, modules: int,
            found: Findings, rows: list[dict], notes: tuple[str, ...] = ()) -> dict:
    rows.sort(key=lambda r: -r["rel_err"])
    layers: dict[str, float] = {}
    for r in rows:
        layer = _layer_of(r["tensor"])
        key = "other" if layer is None else str(layer)
        layers[key] = max(layers.get(key, 0.0), r["rel_err"])
    return {"checkpoint": source.label, "layout": layout_name, "reference": reference,
            "reference_kind": reference_kind, "modules": modules, "notes": list(notes),
            "checks": found.summary(), "faults": found.faults, "tensors": rows, "layers": layers,
            "warnings": list(source.warnings), "passed": not found.faults}


def _require_selection(pattern: str, source, det) -> None:
    """A --tensors filter that selects nothing would make every check pass vacuously."""
    modules = det.modules if det is not None else {}
    if any(matches(pattern, m) for m in modules) or any(matches(pattern, n) for n in all_names(source)):
        return
    raise QuantcliError(f"--tensors {pattern!r}: matches no tensor or module in {source.label}; try a module name "
                        f"or prefix (model.layers.0), a glob ('*q_proj') or re:REGEX")


def _structure_checks(source, det, config: dict, qt: CheckpointTensors, pattern: str | None, found: Findings) -> dict:
    """Manifest, config, servability, tensor dtypes/shapes, fused globals, coverage; returns the
    described modules (those `pattern` selects)."""
    layout = det.layout
    if det.manifest is not None:
        for p in det.manifest.check_headers(source.headers):
            found.fault(MANIFEST, p.split(":")[0], "manifest/header mismatch: " + p.split(": ", 1)[1])
        found.ran(MANIFEST)
    for p in config_problems(layout.name, source.config, det.extra_files):
        found.fault(CONFIG, "config.json", p)
    found.ran(CONFIG)
    for recipe_name in sorted(set(det.modules.values()) & set(layout.unservable)):
        users = sorted(m for m, r in det.modules.items() if r == recipe_name)
        found.fault(SERVABLE, users[0] if len(users) == 1 else f"{len(users)} modules ({users[0]}, ...)",
                    f"{recipe_name} in the {layout.name} layout: no serving engine loads that (recipe, layout) pair; "
                    f"layouts that do: {', '.join(layouts_for(recipe_name))}; re-layout losslessly with "
                    f"`quantcli convert SRC DST --recipe {recipe_name} --layout {layouts_for(recipe_name)[0]}`")
    found.ran(SERVABLE)
    modules = {}
    for module, recipe_name in sorted(det.modules.items()):
        if pattern and not matches(pattern, module):
            continue
        desc = describe_module(layout, module, recipe_name, qt, config)
        modules[module] = desc
        for p in desc["problems"]:
            found.fault(TENSORS, module, p)
    found.ran(TENSORS)
    for f in fused_mismatches(list(modules.values())):
        found.fault(FUSED, f["group"], f"fused group has different global scales {f['global_scales']}; engines need one")
    found.ran(FUSED)
    excluded = exclusion_list(layout, config)
    for module in linear_modules(all_names(source), qt):
        if module not in det.modules and not is_excluded(module, excluded):
            found.fault(COVERAGE, module, "Linear is neither quantized nor in the exclusion list")
    found.ran(COVERAGE)
    return modules


def _read_modules(det, modules: dict, qt: CheckpointTensors, tp: int | None, found: Findings, *, decode: bool,
                  dev) -> dict:
    """Read each well-formed module back; scale checks, TP split, and (without a reference, which
    decodes them anyway) the finiteness of the decoded weights. Returns module -> (recipe, q)."""
    layout = det.layout
    rules = {m.module: m.scale_rule for m in det.manifest.modules} if det.manifest else {}
    out: dict[str, tuple] = {}
    for module, desc in modules.items():
        if desc["problems"]:
            continue
        recipe = layout.recipe_for(desc["recipe"], _rule(rules.get(module)))
        try:
            q = layout.from_disk(module, recipe, qt.get, qt.where)
        except (QuantcliError, RuntimeError, ValueError) as exc:  # a malformed module is a finding
            found.fault(TENSORS, module, f"cannot be read back: {exc}")
            continue
        _scale_checks(module, recipe, q, lambda t, w: found.fault(SCALES, t, w))
        if tp:
            _tp_check(module, recipe, q.shape, tp, lambda t, w: found.fault(TP.format(tp=tp), t, w))
        if decode:
            _finite_check(module, decode_module(layout, module, recipe, q, device=dev), found)
            for d in layout.describe(module, recipe):
                qt.release(d.name)
        out[module] = (recipe, q)
    found.ran(SCALES)
    if decode:
        found.ran(FINITE)
    if tp:
        found.ran(TP.format(tp=tp))
    return out


def _finite_check(module: str, decoded: torch.Tensor, found: Findings) -> bool:
    bad = int((~torch.isfinite(decoded)).sum())
    if bad:
        found.fault(FINITE, module, f"decodes to {bad} non-finite value(s) (a block scale times its codes overflows "
                                    f"FP32): the checkpoint is corrupt; re-quantize it from the source weights")
    return not bad


class Reference:
    """The --reference checkpoint. Dense weights are read as stored; when the reference is itself
    quantized (the source of a re-layout, re-quantization or dequantization), each of its modules
    is read through its own layout (detected as inspect and convert do) and decoded, so
    comparisons are against the values it stands for, never its packed codes."""

    def __init__(self, label: str, source, rt: CheckpointTensors, dev):
        self.label, self.source, self.rt, self.dev = label, source, rt, dev
        found = detect(source)
        self.det = found if found is not None and found.modules else None
        manifest = self.det.manifest if self.det is not None else None
        self.rules = {m.module: m.scale_rule for m in manifest.modules} if manifest else {}

    @property
    def kind(self) -> str:
        return f"quantized ({self.det.layout.name})" if self.det is not None else "dense"

    def recipe_name(self, module: str) -> str | None:
        return self.det.modules.get(module) if self.det is not None else None

    def recipe(self, module: str):
        layout = self.det.layout
        return layout.recipe_for(self.det.modules[module], _rule(self.rules.get(module)))

    def names(self, module: str) -> list[str]:
        """The reference's stored tensors of a quantized module."""
        return [d.name for d in self.det.layout.describe(module, self.recipe(module))]

    def read(self, module: str):
        """The quantized module in canonical form (QuantizedTensor); QuantcliError when unreadable."""
        try:
            return self.det.layout.from_disk(module, self.recipe(module), self.rt.get, self.rt.where)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise QuantcliError(f"{self.label}: reference module {module} cannot be read back "
                                f"({self.det.layout.name} {self.det.modules[module]}): {exc}") from None

    def decoded(self, module: str, q=None) -> torch.Tensor:
        """The reference module's FP32 weight in its logical [..., N, K] orientation, on the CPU."""
        q = self.read(module) if q is None else q
        return decode_module(self.det.layout, module, self.recipe(module), q, device=self.dev).cpu()

    def release(self, module: str) -> None:
        for name in self.names(module):
            if name in self.rt:
                self.rt.release(name)

    def weight(self, module: str, transpose_hint: bool | None) -> tuple[torch.Tensor, bool] | None:
        """(reference weight of `module` as FP32, whether the checkpoint's decode must be transposed
        to match it), or None when the reference has no such module."""
        if self.recipe_name(module) is not None:
            return self.decoded(module), False  # both sides in the quantized [..., N, K] orientation
        name = _source_name(module, self.rt)
        if name is None:
            return None
        transpose = transpose_hint if transpose_hint is not None else bool(TRANSPOSED_EXPERTS.search(name))
        w = self.rt.get(name).to(torch.float32)
        self.rt.release(name)  # memory tracks the tensor in flight, not the model
        return w, transpose


def _reference_checks(reference: str, revision: str | None, det, decoded_cache: dict, qt: CheckpointTensors,
                      pattern: str | None, exact: bool, limits: Limits, dev, found: Findings
                      ) -> tuple[list[dict], str]:
    layout = det.layout
    entries = {m.module: m for m in det.manifest.modules} if det.manifest else {}
    rows = []
    ref_source = open_source(reference, revision)
    with CheckpointTensors(ref_source) as rt:
        ref = Reference(reference, ref_source, rt, dev)
        group_amax = _reference_group_amax(decoded_cache, ref, entries, dev)
        consumed = set()
        for module, (recipe, q) in decoded_cache.items():
            consumed.update(d.name for d in layout.describe(module, recipe))
            entry = entries.get(module)
            if ref.recipe_name(module) is not None:
                consumed.update(ref.names(module))
            else:
                name = _source_name(module, rt)
                consumed.update([name] if name else [])
            try:
                got = ref.weight(module, entry.transposed_from_source if entry else None)
            except QuantcliError as exc:
                found.fault(REF_MODULES, module, str(exc))
                continue
            if got is None:
                found.fault(REF_MODULES, module, "the reference has no tensor for this module: a different model?")
                continue
            w, transpose = got
            decoded = decode_module(layout, module, recipe, q, transpose=transpose, device=dev).cpu()
            if tuple(decoded.shape) != tuple(w.shape):
                found.fault(REF_MODULES, module, f"decodes to {list(decoded.shape)} but the reference is "
                                                 f"{list(w.shape)}: a different model or a transposed tensor")
                continue
            if not _finite_check(module, decoded, found):
                continue
            if ref.recipe_name(module) == recipe.name:  # a re-layout: the same values, or corrupt
                row = _compare_identical(module, recipe, decoded, w, q, ref, limits, found)
            else:
                prior = _requantized_prior(entry) if ref.det is None or ref.recipe_name(module) is None else None
                row = _compare(module, recipe, layout, decoded, w, transpose, group_amax, limits, dev, found, prior)
                if exact:
                    wq = w.to(dev).transpose(-1, -2) if transpose else w.to(dev)
                    row.update(_exact(layout, module, recipe, wq, row["_ours"].to("cpu"), q, qt))
            row.pop("_ours", None)
            rows.append(row)
            if ref.recipe_name(module) is not None:
                ref.release(module)
            for d in layout.describe(module, recipe):
                qt.release(d.name)
        found.ran(REF_MODULES)
        found.ran(FINITE)
        if any(r.get("limit_basis") == IDENTICAL for r in rows):
            found.ran(REF_SAME)
        if any(r.get("limit_basis") != IDENTICAL for r in rows) or not rows:
            found.ran(REF_ERROR)
        _unquantized_identical(rt, qt, consumed, pattern, det.modules, found)
    return rows, ref.kind


def _unquantized_identical(rt: CheckpointTensors, qt: CheckpointTensors, consumed: set, pattern: str | None,
                           quantized: dict, found: Findings) -> None:
    """Tensors neither side quantizes: present and bit-identical."""
    for name in sorted(rt.where):
        if name in consumed or (pattern and not matches(pattern, name)):
            continue
        if name not in qt:
            if not any(name.startswith(mod) for mod in quantized):
                found.fault(REF_PRESENT, name, "missing from the quantized checkpoint (dropped)")
            continue
        ri, qi = rt.info(name), qt.info(name)
        if ri.dtype != qi.dtype or ri.shape != qi.shape:
            found.fault(REF_IDENTICAL, name, f"changed from {ri.dtype}{list(ri.shape)} to {qi.dtype}"
                                             f"{list(qi.shape)} (a lossy cast or a different model)")
        elif rt.raw(name) != qt.raw(name):
            found.fault(REF_IDENTICAL, name, "unquantized tensor differs from the reference (not bit-identical)")
        rt.release(name)
        qt.release(name)
    found.ran(REF_PRESENT)
    found.ran(REF_IDENTICAL)


IDENTICAL = "identical to the decoded reference"


def _compare_identical(module, recipe, decoded, ref_w, q, ref: Reference, limits: Limits, found) -> dict:
    """The same recipe on both sides (a re-layout): codes and block scales carry over unchanged, so
    the decoded values must be identical. The one exception is a global scale whose FP32 reciprocal
    does not invert back exactly (multiply <-> divide layouts; convert names it): every value then
    scales by exactly that ratio, and nothing more is allowed."""
    m = metrics(decoded, ref_w)
    rq = ref.read(module)
    limit = 0.0
    if q.global_scale is not None and rq.global_scale is not None:
        ratio = float(q.global_scale.double().cpu() / rq.global_scale.double().cpu())
        if ratio != 1.0:  # one FP32 rounding of each product on top of the ratio itself
            limit = abs(ratio - 1.0) + 2 * torch.finfo(torch.float32).eps
    m.update(tensor=module, recipe=recipe.name, baseline_rel_err=0.0, limit_rel_err=limit, limit_basis=IDENTICAL)
    m.update(_exact_relayout(q, rq))
    reasons = []
    if m["rel_err"] > limit:
        reasons.append(f"relative error {m['rel_err']:.4g} against the decoded reference ({ref.kind}, the same "
                       f"recipe {recipe.name}): a re-layout must be identical to the decoded reference; "
                       f"{100 - 100 * m['exact_identical_fraction']:.3g}% of code/scale bytes differ, so codes or "
                       f"scales were changed")
    reasons += _absolute_limits(m, limits)
    m["passed"] = not reasons
    for r in reasons:
        found.fault(REF_SAME, module, r)
    return m


def _exact_relayout(q, rq) -> dict:
    """Byte identity of codes, block scales and global scale, both read through their layout's
    from_disk into quantcli's canonical form (so names, scalar shapes and directions drop out)."""
    same = total = 0
    pairs = [(q.codes, rq.codes), (q.scale, rq.scale)]
    if q.global_scale is not None and rq.global_scale is not None:
        pairs.append((q.global_scale.to(torch.float32), rq.global_scale.to(torch.float32)))
    for a, b in pairs:
        a, b = _raw_bytes(a.cpu()), _raw_bytes(b.cpu())
        if a.numel() == b.numel():
            same += int((a == b).sum())
        total += max(a.numel(), b.numel())
    return {"exact_identical_fraction": same / total if total else 1.0}


def _requantized_prior(entry) -> tuple[str, float] | None:
    """(source recipe, recorded error vs the decoded source) of a module convert re-quantized from
    a quantized source; None for other modules and for manifests written without it."""
    if entry is None or not entry.requantized_from:
        return None
    err = entry.requantize_rel_err
    if isinstance(err, bool) or not isinstance(err, (int, float)) or not math.isfinite(err) or err < 0:
        return None
    return entry.requantized_from, float(err)


def _compare(module, recipe, layout, decoded, ref, transpose, group_amax, limits: Limits, dev, found,
             prior: tuple[str, float] | None = None) -> dict:
    """Error of the decoded module against the reference, judged against quantcli's own
    quantization of the same reference tensor (the yardstick, see TOLERANCE).

    `prior` (source recipe, recorded error): the module was re-quantized from a quantized source
    and the reference is the dense model that source was made from. Its error is then both
    quantizations: by the triangle inequality at most the source's error (estimated by quantcli's
    own quantization of the reference with the source recipe) plus the re-quantization error that
    convert measured against the decoded source; the margin applies to that sum."""
    m = metrics(decoded, ref)
    w = ref.to(dev).transpose(-1, -2) if transpose else ref.to(dev)
    ours = _quantize_like(recipe, module, w, group_amax)
    base = metrics(decode_module(layout, module, recipe, ours, transpose=transpose).cpu(), ref)
    m.update(tensor=module, recipe=recipe.name, baseline_rel_err=base["rel_err"], _ours=ours)
    margin = limits.margin if limits.margin is not None else allowed_margin(ref.numel())
    bound, basis = base["rel_err"], "quantcli's own"
    source_estimate = _source_estimate(prior, module, layout, w, ref, transpose, group_amax)
    if source_estimate is not None:
        src_recipe, src_err, requant_err = source_estimate
        bound, basis = max(bound, src_err + requant_err), f"{src_recipe} {src_err:.3g} + re-quantize {requant_err:.3g}"
        m.update(source_recipe=src_recipe, source_baseline_rel_err=src_err, requantize_rel_err=requant_err)
    limit = bound * (1 + margin) + ABS_FLOOR
    m["limit_rel_err"] = limit
    m["limit_basis"] = f"({basis}) x {1 + margin:.2f}"
    reasons = []
    if m["rel_err"] > limit:
        if source_estimate is not None:
            reasons.append(f"relative error {m['rel_err']:.4g} exceeds the re-quantized bound {bound:.4g} (quantcli's "
                           f"own {src_recipe} {src_err:.4g} + recorded re-quantization {requant_err:.4g}) by more than "
                           f"{margin:.0%}: scales or codes are wrong")
        else:
            reasons.append(f"relative error {m['rel_err']:.4g} exceeds quantcli's own {base['rel_err']:.4g} by more "
                           f"than {margin:.0%} (the allowance for real producers' rounding at this size): "
                           f"scales or codes are wrong")
    reasons += _absolute_limits(m, limits)
    m["passed"] = not reasons
    for r in reasons:
        found.fault(REF_ERROR, module, r)
    return m


def _absolute_limits(m: dict, limits: Limits) -> list[str]:
    reasons = []
    if limits.rel_err is not None and m["rel_err"] > limits.rel_err:
        reasons.append(f"relative error {m['rel_err']:.4g} > {limits.rel_err}")
    if limits.sqnr_db is not None and m["sqnr_db"] < limits.sqnr_db:
        reasons.append(f"SQNR {m['sqnr_db']:.2f} dB < {limits.sqnr_db}")
    if limits.cosine is not None and m["cosine"] < limits.cosine:
        reasons.append(f"cosine {m['cosine']:.6f} < {limits.cosine}")
    return reasons


def _quantize_like(recipe, module: str, w: torch.Tensor, group_amax: dict):
    """quantcli's own quantization of `w` as convert does it (a fused group shares one global amax)."""
    amax = group_amax.get(fused_group_of(module)) if recipe.has_global_scale else None
    return recipe.quantize(module, w, facts=ModuleFacts(group_amax=amax))


def _source_estimate(prior, module, layout, w, ref, transpose, group_amax) -> tuple[str, float, float] | None:
    """(source recipe, quantcli's own error with it on the reference, recorded re-quantize error)."""
    if prior is None:
        return None
    name, requant_err = prior
    try:
        src_recipe = get_recipe(name)
    except RecipeError:
        return None  # a manifest naming a recipe this quantcli lacks: judge by the plain yardstick
    q = _quantize_like(src_recipe, module, w, group_amax)
    src_err = metrics(decode_module(layout, module, src_recipe, q, transpose=transpose).cpu(), ref)["rel_err"]
    return name, src_err, requant_err


def _rule(rule: str | None) -> str | None:
    return rule if rule in ("floor", "even", "rceil") else None


def _source_name(module: str, rt: CheckpointTensors) -> str | None:
    for name in (f"{module}.weight", module):
        if name in rt:
            return name
    return None


def _reference_group_amax(decoded_cache: dict, ref: Reference, entries: dict, dev) -> dict:
    """Fused group -> amax of the reference weights of its members (dense or decoded), for the
    recipes with a global scale that the yardstick quantizes with (the module's own, or the source
    recipe of a re-quantized module)."""
    from .kernels import tensor_amax

    out: dict[str, torch.Tensor] = {}
    for module, (recipe, _) in decoded_cache.items():
        group = fused_group_of(module)
        prior = _requantized_prior(entries.get(module))
        uses_global = recipe.has_global_scale or (prior is not None and prior[0] in RECIPES
                                                  and RECIPES[prior[0]].has_global_scale)
        if group is None or not uses_global or ref.recipe_name(module) == recipe.name:
            continue
        try:
            got = ref.weight(module, None)
        except QuantcliError:
            continue  # reported when the module itself is compared
        if got is None:
            continue
        amax = tensor_amax(got[0].to(dev), name=f"{ref.label}: {module}").cpu()
        if ref.recipe_name(module) is not None:
            ref.release(module)
        out[group] = amax if group not in out else torch.maximum(out[group], amax)
    # A "group" with one member behaves like a plain tensor: its own amax, as convert does.
    return out


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as uint8 (a view, never a value cast)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _exact(layout, module, recipe, w, ours, on_disk, qt: CheckpointTensors) -> dict:
    """Byte identity of quantcli's quantization `ours` of the reference `w` with what is on disk;
    for MX recipes, which scale rule reproduces the stored scales."""
    same = total = 0
    for name, t in layout.to_disk(module, ours).items():
        a, b = _raw_bytes(t), _raw_bytes(qt.get(name))
        if a.numel() == b.numel():
            same += int((a == b).sum())
        total += a.numel()
    result = {"exact_identical_fraction": same / total if total else 1.0}
    if recipe.scale_rules:
        for rule in recipe.scale_rules:
            if torch.equal(recipe.with_scale_rule(rule).quantize(module, w).scale.cpu(), on_disk.scale):
                result["scale_rule_matches"] = rule
                break
    return result


def _scale_checks(module: str, recipe, q, fault) -> None:
    if recipe.scale_encoding == "f32":
        s = q.scale.to(torch.float32)
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            fault(module, "block scales are not all finite and positive")
    elif recipe.scale_encoding == "e8m0_bias127":
        if bool((q.scale == 255).any()):
            fault(module, "E8M0 scale byte 255 (NaN) present")
    else:
        b = q.scale.view(torch.uint8)
        if bool(((b & 0x7F) == 0x7F).any()) or bool((b & 0x80).any()):
            fault(module, "E4M3 block scales hold NaN or negative values")
    if q.global_scale is not None:
        g = float(q.global_scale)
        if not math.isfinite(g) or g <= 0:
            fault(module, f"global scale {g} is not finite and positive")


# A global scale read the wrong way round (s2 for 1/s2) scales the whole tensor by 1/s2^2. Block
# scales and codes cannot tell (they were computed relative to s2 either way), and s2 > 1 is
# legitimate (tensor amax > 2688), so no bound on s2 alone can decide. What can: the decoded
# amax 6 * max(block scale) * s2 of one module against the magnitudes of the rest of the checkpoint
# (other modules, dense weights). A module is called inverted when reading its global the other way
# round brings it closer to them by more than INVERSION_EVIDENCE (x100): a correct module with
# s2 < 10 (amax < 26880) can never be flagged; an inverted global of any tensor with amax < 270 is.
INVERSION_EVIDENCE = math.log(100.0)


def _direction_check(decoded_cache: dict, qt: CheckpointTensors, det, found: Findings) -> None:
    globals_ = {m: q for m, (r, q) in decoded_cache.items() if q.global_scale is not None}
    if not globals_:
        return
    peers = {m: _log_amax(r, q) for m, (r, q) in decoded_cache.items()}
    dense = _dense_log_amax(qt, det)
    for module, q in globals_.items():
        s2 = float(q.global_scale)
        if not math.isfinite(s2) or s2 <= 0:
            continue  # already a scale-check fault
        here = peers[module]
        flipped = here - 2 * math.log(s2)  # the same module with 1/s2
        for reference in (_median([v for m, v in peers.items() if m != module] + dense), _median(dense)):
            if reference is None:
                continue
            if abs(here - reference) - abs(flipped - reference) > INVERSION_EVIDENCE:
                direction = ("weight_global_scale is a divisor 2688/amax" if det.layout.name == "compressed-tensors"
                             else "weight_scale_2 is a multiplier amax/2688")
                found.fault(DIRECTION, module,
                            f"global scale looks inverted: it decodes to amax {math.exp(here):.4g}, "
                            f"{math.exp(abs(here - reference)):.3g}x off the rest of the checkpoint, and "
                            f"{math.exp(flipped):.4g} read the other way round ({direction})")
                break
    found.ran(DIRECTION)


def _log_amax(recipe, q) -> float:
    """log of the module's decoded amax, from its scales alone (within a factor ~2 of the true one)."""
    elem_max = 6.0 if recipe.element_bits == 4 else 448.0
    if recipe.scale_encoding == "e8m0_bias127":
        scale = 2.0 ** (int(q.scale.max()) - 127)
    elif recipe.scale_encoding == "e4m3fn":
        scale = float(q.scale.view(torch.float8_e4m3fn).to(torch.float32).max())
    else:
        scale = float(q.scale.to(torch.float32).max())
    g = float(q.global_scale) if q.global_scale is not None else 1.0
    value = elem_max * scale * g
    return math.log(value) if value > 0 and math.isfinite(value) else 0.0


def _dense_log_amax(qt: CheckpointTensors, det, limit: int = 4) -> list[float]:
    """log amax of a few dense 2-D float weights (not norms), smallest first: the model's own scale."""
    quantized = set()
    for module, recipe in det.modules.items():
        quantized.update(d.name for d in det.layout.describe(module, det.layout.recipe_for(recipe)))
    names = [n for n in qt.where if n not in quantized and n.endswith(".weight") and "norm" not in n
             and qt.info(n).dtype in ("F32", "BF16", "F16") and len(qt.info(n).shape) == 2]
    out = []
    for name in sorted(names, key=lambda n: qt.info(n).nbytes)[:limit]:
        amax = float(qt.get(name).abs().max())
        qt.release(name)
        if amax > 0 and math.isfinite(amax):
            out.append(math.log(amax))
    return out


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _tp_check(module: str, recipe, shape, tp: int, fault) -> None:
    n, k = shape[-2], shape[-1]
    if ROW_PARALLEL.search(module):
        dim, size, block = "input dim K", k, recipe.block[1] or k
    else:
        dim, size, block = "output dim N", n, recipe.block[0] if recipe.block[0] > 1 else 1
    if size % tp or (size // tp) % block:
        fault(module, f"{dim}={size} does not split into whole {block}-blocks across --tp {tp} ranks "
                      f"({size}/{tp} = {size / tp:g}); vLLM and SGLang refuse to load it at TP={tp}")


# ---------------------------------------------------------------- an unquantized checkpoint

REF_DEQUANT = "dequantized tensors bit-identical to the decoded reference cast to their dtype"
UNQUANTIZED_NOTE = ("no quantized modules: an unquantized checkpoint is checked for identity with the reference, "
                    "tensor by tensor")


def _verify_unquantized(source, reference: str, revision: str | None, pattern: str | None, dev) -> dict:
    """A checkpoint without quantized modules (e.g. `convert QSRC DST --recipe bf16`): against a
    quantized reference each dequantized weight must equal the reference module decoded and cast
    to its dtype, bit for bit; every other tensor (all of them for a dense reference) must be
    bit-identical. Rows carry the error so a mismatch shows how far off it is."""
    found = Findings()
    rows: list[dict] = []
    ref_source = open_source(reference, revision)
    with CheckpointTensors(source) as qt, CheckpointTensors(ref_source) as rt:
        ref = Reference(reference, ref_source, rt, dev)
        consumed: set[str] = set()
        if ref.det is not None:
            for module in sorted(ref.det.modules):
                if pattern and not matches(pattern, module):
                    continue
                consumed.update(ref.names(module))
                row = _dequantized_row(module, ref, qt, found)
                if row is not None:
                    rows.append(row)
                ref.release(module)
            found.ran(REF_DEQUANT)
        quantized = ref.det.modules if ref.det is not None else {}
        for name in sorted(rt.where):
            if name in consumed or (pattern and not matches(pattern, name)):
                continue
            if name not in qt:
                if not any(name.startswith(mod) for mod in quantized):
                    found.fault(REF_PRESENT, name, "missing from the checkpoint (dropped)")
                continue
            row = _identity_row(name, rt, qt, ref, found)
            if row is not None:
                rows.append(row)
        found.ran(REF_PRESENT)
        found.ran(REF_IDENTICAL)
        kind = ref.kind
    return _report(source, "none", reference, kind, 0, found, rows, notes=(UNQUANTIZED_NOTE,))


def _dequantized_row(module: str, ref: Reference, qt: CheckpointTensors, found: Findings) -> dict | None:
    # convert writes a dequantized Linear as `<module>.weight`, a gpt-oss expert stack as `<module>`
    # in its dense [E, in, out] orientation.
    name, transpose = next(((n, t) for n, t in ((f"{module}.weight", False), (module, True)) if n in qt),
                           (None, False))
    if name is None:
        found.fault(REF_PRESENT, module, f"the reference quantizes this module but the checkpoint has no "
                                         f"{module}.weight: a different model?")
        return None
    try:
        w = ref.decoded(module)
    except QuantcliError as exc:
        found.fault(REF_DEQUANT, name, str(exc))
        return None
    w = w.transpose(-1, -2) if transpose else w
    info = qt.info(name)
    if tuple(info.shape) != tuple(w.shape) or info.dtype not in ("BF16", "F16", "F32"):
        found.fault(REF_DEQUANT, name, f"is {info.dtype}{list(info.shape)}, the reference module decodes to "
                                       f"{list(w.shape)}: expected a BF16, F16 or F32 tensor of that shape")
        return None
    got = qt.get(name)
    expected = w.to(got.dtype)  # what a faithful dequantization to this dtype writes
    m = metrics(got.to(torch.float32), expected.to(torch.float32))
    identical = torch.equal(_raw_bytes(expected), _raw_bytes(got))
    qt.release(name)
    m.update(tensor=name, recipe=ref.recipe_name(module), baseline_rel_err=0.0, limit_rel_err=0.0,
             limit_basis=f"identical, decoded and cast to {info.dtype}",
             exact_identical_fraction=1.0 if identical else None, passed=identical)
    if not identical:
        found.fault(REF_DEQUANT, name, f"differs from the reference module decoded and cast to {info.dtype} "
                                       f"(relative error {m['rel_err']:.4g}, max abs {m['max_abs']:.3g}): not a "
                                       f"faithful dequantization of {ref.label}")
    return m


def _identity_row(name: str, rt: CheckpointTensors, qt: CheckpointTensors, ref: Reference,
                  found: Findings) -> dict | None:
    ri, qi = rt.info(name), qt.info(name)
    row = None
    if ri.dtype != qi.dtype or ri.shape != qi.shape:
        found.fault(REF_IDENTICAL, name, f"changed from {ri.dtype}{list(ri.shape)} to {qi.dtype}{list(qi.shape)}: "
                                         f"an unquantized checkpoint is checked for identity with the reference")
    else:
        identical = rt.raw(name) == qt.raw(name)
        if ri.dtype in ("BF16", "F16", "F32") and len(ri.shape) >= 1:
            row = metrics(qt.get(name).to(torch.float32), rt.get(name).to(torch.float32))
            row.update(tensor=name, recipe="-", baseline_rel_err=0.0, limit_rel_err=0.0, limit_basis="identical",
                       passed=identical)
        if not identical:
            err = f" (relative error {row['rel_err']:.4g})" if row else ""
            hint = ("; if it was dequantized from a quantized checkpoint, pass that one as --reference"
                    if ref.det is None else "")
            found.fault(REF_IDENTICAL, name, f"not bit-identical to the reference{err}: an unquantized checkpoint "
                                             f"is checked for identity{hint}")
    rt.release(name)
    qt.release(name)
    return row


def render_verify(report: dict, con, top: int) -> None:
    from rich.table import Table

    reference = report["reference"]
    kind = report.get("reference_kind")
    con.print(f"{report['checkpoint']}: layout {report['layout']}, {report['modules']} quantized modules"
              + (f", reference {reference}" + (f" ({kind})" if kind else "") if reference else ""))
    for note in report.get("notes", []):
        con.print(f"  {note}")
    for c in report["checks"]:
        status = "[green]ok[/green]  " if c["passed"] else f"[red]FAIL[/red] ({c['faults']})"
        con.print(f"  {status} {c['check']}")
    if report["tensors"]:
        t = Table(title=f"worst {min(top, len(report['tensors']))} tensors")
        for col in ("tensor", "recipe", "rel err", "ours", "limit", "SQNR dB", "cosine", "max abs", "exact"):
            t.add_column(col)
        for r in report["tensors"][:top]:
            exact = r.get("exact_identical_fraction")
            t.add_row(r["tensor"], r["recipe"], f"{r['rel_err']:.4g}", f"{r['baseline_rel_err']:.4g}",
                      _limit_text(r), f"{r['sqnr_db']:.2f}", f"{r['cosine']:.6f}", f"{r['max_abs']:.3g}",
                      "-" if exact is None else f"{exact:.2%}")
        con.print(t)
        worst = max(report["layers"].values()) or 1.0
        con.print("relative error by layer (worst tensor):")
        for layer, v in sorted(report["layers"].items(), key=lambda kv: (kv[0] == "other", int(kv[0]) if kv[0].isdigit() else 0)):
            con.print(f"  {layer:>5} {'█' * max(1, int(40 * v / worst))} {v:.4g}")
    for w in report.get("warnings", []):
        con.print(f"[yellow]warning[/yellow]: {w}")
    for f in report["faults"]:
        con.print(f"[red]FAIL[/red] {f['tensor']}: {f['fault']}")
    con.print("[green]PASS[/green]" if report["passed"] else f"[red]FAIL[/red]: {len(report['faults'])} fault(s)")



def _limit_text(row: dict) -> str:
    """The limit and what it is made of: '0 (identical ...)', '0.1234 = (nvfp4 0.09 + re-quantize 0.02) x 1.19'."""
    basis = row.get("limit_basis")
    if not basis:
        return f"{row['limit_rel_err']:.4g}"
    if row["limit_rel_err"] == 0:
        return f"0 ({basis})"
    if basis.startswith("(quantcli's own)"):
        return f"{row['limit_rel_err']:.4g}"
    return f"{row['limit_rel_err']:.4g} = {basis}"


__all__ = ["Limits", "parse_thresholds", "render_verify", "verify_checkpoint"]
