"""`quantcli verify`: decode a quantized checkpoint tensor by tensor and prove it is right.

Structural checks need no reference. With `--reference`, every quantized tensor is compared with
the reference, and fails when its error exceeds quantcli's own quantization of the same reference
tensor (same recipe, same global amax rule) by more than a small margin: that catches a scale one
step off or a scrambled block that an absolute threshold would let through. Unquantized tensors
must be bit-identical. `--exact` re-quantizes and compares bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .convert import resolve_device
from .decode import decode_module
from .detect import all_names, config_with_extras, detect
from .errors import QuantcliError
from .inspect import exclusion_list, fused_mismatches, is_excluded, linear_modules, describe_module
from .plan import TRANSPOSED_EXPERTS, fused_group_of, matches
from .source import open_source
from .tensors import CheckpointTensors

METRICS = ("rel_err", "sqnr_db", "cosine", "margin")
DEFAULT_MARGIN = 0.02  # a tensor may be 2 % worse (relative L2 error) than quantcli's own quantization
ABS_FLOOR = 1e-6  # slack for tensors whose own error is ~0 (exactly representable weights)
ROW_PARALLEL = re.compile(r"(o_proj|down_proj|w2|dense|out_proj|fc2|wo)$")


@dataclass
class Limits:
    margin: float = DEFAULT_MARGIN
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


def verify_checkpoint(quant: str, reference: str | None = None, revision: str | None = None,
                      pattern: str | None = None, exact: bool = False, tp: int | None = None,
                      limits: Limits | None = None, device: str = "auto") -> dict:
    limits = limits or Limits()
    dev = resolve_device(device)
    source = open_source(quant)
    det = detect(source)
    if det is None or not det.modules:
        raise QuantcliError(f"{quant}: no quantized modules found (no modelopt, compressed-tensors, fp8 or gpt-oss "
                            f"layout detected); nothing to verify")
    layout = det.layout
    config = config_with_extras(source, det.extra_files)
    faults: list[dict] = []
    checks: list[str] = []

    def fault(tensor: str, what: str) -> None:
        faults.append({"tensor": tensor, "fault": what})

    manifest_transposed = {m.module: m.transposed_from_source for m in det.manifest.modules} if det.manifest else {}
    manifest_rules = {m.module: m.scale_rule for m in det.manifest.modules} if det.manifest else {}
    names = all_names(source)
    rows: list[dict] = []
    with CheckpointTensors(source) as qt:
        # ---- structure
        if det.manifest is not None:
            for p in det.manifest.check_headers(source.headers):
                fault(p.split(":")[0], "manifest/header mismatch: " + p.split(": ", 1)[1])
            checks.append("manifest agrees with the safetensors headers")
        for p in config_problems(layout.name, source.config, det.extra_files):
            fault("config.json", p)
        checks.append("config keys the consumer needs are present")
        modules = {}
        for module, recipe_name in sorted(det.modules.items()):
            if pattern and not matches(pattern, module):
                continue
            desc = describe_module(layout, module, recipe_name, qt, config)
            modules[module] = desc
            for p in desc["problems"]:
                fault(module, p)
        for f in fused_mismatches(list(modules.values())):
            fault(f["group"], f"fused group has different global scales {f['global_scales']}; engines need one")
        checks.append("fused groups share one global scale")
        excluded = exclusion_list(layout, config)
        for module in linear_modules(names, qt):
            if module not in det.modules and not is_excluded(module, excluded):
                fault(module, "Linear is neither quantized nor in the exclusion list")
        checks.append("every Linear is quantized or excluded")
        decoded_cache: dict[str, object] = {}
        for module, desc in modules.items():
            if desc["problems"]:
                continue
            recipe = layout.recipe_for(desc["recipe"], _rule(manifest_rules.get(module)))
            try:
                q = layout.from_disk(module, recipe, qt.get, qt.where)
            except Exception as exc:
                fault(module, f"cannot be read back: {exc}")
                continue
            _scale_checks(module, layout.name, recipe, q, fault)
            if tp:
                _tp_check(module, recipe, q.shape, tp, fault)
            decoded_cache[module] = (recipe, q)
        checks.append("scales finite, positive, no E8M0 255; global scale direction")
        if tp:
            checks.append(f"quantized dims split into whole blocks across {tp} ranks")

        # ---- against the reference
        if reference is not None:
            ref_source = open_source(reference, revision)
            with CheckpointTensors(ref_source) as rt:
                group_amax = _reference_group_amax(decoded_cache, rt, dev)
                consumed = set()
                for module, (recipe, q) in decoded_cache.items():
                    src_name = _source_name(module, rt)
                    for d in layout.describe(module, recipe):
                        consumed.add(d.name)
                    if src_name is None:
                        fault(module, "the reference has no tensor for this module: a different model?")
                        continue
                    consumed.add(src_name)
                    transpose = manifest_transposed.get(module, bool(TRANSPOSED_EXPERTS.search(src_name)))
                    ref = rt.get(src_name).to(torch.float32)
                    decoded = decode_module(layout, module, recipe, q, transpose=transpose, device=dev).cpu()
                    if tuple(decoded.shape) != tuple(ref.shape):
                        fault(module, f"decodes to {list(decoded.shape)} but the reference is {list(ref.shape)}: "
                                      f"a different model or a transposed tensor")
                        continue
                    m = metrics(decoded, ref)
                    # quantcli's own quantization of the reference: the yardstick, and --exact's bytes
                    w = ref.to(dev).transpose(-1, -2) if transpose else ref.to(dev)
                    ours = recipe.quantize(module, w, global_amax=group_amax.get(fused_group_of(module)))
                    base = metrics(decode_module(layout, module, recipe, ours, transpose=transpose).cpu(), ref)
                    m.update(tensor=module, recipe=recipe.name, baseline_rel_err=base["rel_err"])
                    limit = base["rel_err"] * (1 + limits.margin) + ABS_FLOOR
                    reasons = []
                    if m["rel_err"] > limit:
                        reasons.append(f"relative error {m['rel_err']:.4g} exceeds quantcli's own {base['rel_err']:.4g} "
                                       f"by more than {limits.margin:.0%}: scales or codes are wrong")
                    if limits.rel_err is not None and m["rel_err"] > limits.rel_err:
                        reasons.append(f"relative error {m['rel_err']:.4g} > {limits.rel_err}")
                    if limits.sqnr_db is not None and m["sqnr_db"] < limits.sqnr_db:
                        reasons.append(f"SQNR {m['sqnr_db']:.2f} dB < {limits.sqnr_db}")
                    if limits.cosine is not None and m["cosine"] < limits.cosine:
                        reasons.append(f"cosine {m['cosine']:.6f} < {limits.cosine}")
                    m["passed"] = not reasons
                    for r in reasons:
                        fault(module, r)
                    if exact:
                        m.update(_exact(layout, module, recipe, w, ours.to("cpu"), q, qt))
                    rows.append(m)
                    rt.release(src_name)  # memory tracks the tensor in flight, not the model
                    for d in layout.describe(module, recipe):
                        qt.release(d.name)
                # Unquantized tensors: present and bit-identical.
                for name in sorted(rt.where):
                    if name in consumed or (pattern and not matches(pattern, name)):
                        continue
                    if name not in qt:
                        if not any(name.startswith(mod) for mod in det.modules):
                            fault(name, "missing from the quantized checkpoint (dropped)")
                        continue
                    ri, qi = rt.info(name), qt.info(name)
                    if ri.dtype != qi.dtype or ri.shape != qi.shape:
                        fault(name, f"changed from {ri.dtype}{list(ri.shape)} to {qi.dtype}{list(qi.shape)} "
                                    f"(a lossy cast or a different model)")
                    elif rt.raw(name) != qt.raw(name):
                        fault(name, "unquantized tensor differs from the reference (not bit-identical)")
                    rt.release(name)
                    qt.release(name)
                checks.append("every reference tensor present; unquantized tensors bit-identical")
    rows.sort(key=lambda r: -r["rel_err"])
    layers: dict[str, float] = {}
    for r in rows:
        layer = _layer_of(r["tensor"])
        key = "other" if layer is None else str(layer)
        layers[key] = max(layers.get(key, 0.0), r["rel_err"])
    return {"checkpoint": source.label, "layout": layout.name, "reference": reference, "modules": len(modules),
            "checks": checks, "faults": faults, "tensors": rows, "layers": layers, "passed": not faults}


def _rule(rule: str | None) -> str | None:
    return rule if rule in ("floor", "even", "rceil") else None


def _source_name(module: str, rt: CheckpointTensors) -> str | None:
    for name in (f"{module}.weight", module):
        if name in rt:
            return name
    return None


def _reference_group_amax(decoded_cache: dict, rt: CheckpointTensors, dev) -> dict:
    from .kernels import tensor_amax

    out: dict[str, torch.Tensor] = {}
    for module, (recipe, _) in decoded_cache.items():
        group = fused_group_of(module)
        if not recipe.has_global_scale or group is None:
            continue
        name = _source_name(module, rt)
        if name is None:
            continue
        amax = tensor_amax(rt.get(name).to(dev)).cpu()
        rt.release(name)
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


def _scale_checks(module: str, layout_name: str, recipe, q, fault) -> None:
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
        elif g > 1.0:
            # s2 = amax/2688 is < 1 for any weight with amax < 2688; an inverted global (2688/amax) is > 1.
            direction = "weight_global_scale is stored as 1/s2 (divide)" if layout_name == "compressed-tensors" \
                else "weight_scale_2 is a multiplier amax/2688"
            fault(module, f"global scale decodes to s2={g:.6g} > 1: looks inverted ({direction})")


def _tp_check(module: str, recipe, shape, tp: int, fault) -> None:
    n, k = shape[-2], shape[-1]
    if ROW_PARALLEL.search(module):
        dim, size, block = "input dim K", k, recipe.block[1] or k
    else:
        dim, size, block = "output dim N", n, recipe.block[0] if recipe.block[0] > 1 else 1
    if size % tp or (size // tp) % block:
        fault(module, f"{dim}={size} does not split into whole {block}-blocks across --tp {tp} ranks "
                      f"({size}/{tp} = {size / tp:g}); vLLM and SGLang refuse to load it at TP={tp}")


def render_verify(report: dict, con, top: int) -> None:
    from rich.table import Table

    con.print(f"{report['checkpoint']}: layout {report['layout']}, {report['modules']} quantized modules"
              + (f", reference {report['reference']}" if report["reference"] else ""))
    for c in report["checks"]:
        con.print(f"  checked: {c}")
    if report["tensors"]:
        t = Table(title=f"worst {min(top, len(report['tensors']))} tensors")
        for col in ("tensor", "recipe", "rel err", "ours", "SQNR dB", "cosine", "max abs", "exact"):
            t.add_column(col)
        for r in report["tensors"][:top]:
            exact = r.get("exact_identical_fraction")
            t.add_row(r["tensor"], r["recipe"], f"{r['rel_err']:.4g}", f"{r['baseline_rel_err']:.4g}",
                      f"{r['sqnr_db']:.2f}", f"{r['cosine']:.6f}", f"{r['max_abs']:.3g}",
                      "-" if exact is None else f"{exact:.2%}")
        con.print(t)
        worst = max(report["layers"].values()) or 1.0
        con.print("relative error by layer (worst tensor):")
        for layer, v in sorted(report["layers"].items(), key=lambda kv: (kv[0] == "other", int(kv[0]) if kv[0].isdigit() else 0)):
            con.print(f"  {layer:>5} {'█' * max(1, int(40 * v / worst))} {v:.4g}")
    for f in report["faults"]:
        con.print(f"[red]FAIL[/red] {f['tensor']}: {f['fault']}")
    con.print("[green]PASS[/green]" if report["passed"] else f"[red]FAIL[/red]: {len(report['faults'])} fault(s)")


__all__ = ["Limits", "parse_thresholds", "render_verify", "verify_checkpoint"]
