"""One decoded module against its reference weight: judged against quantcli's own quantization
of the same reference (the yardstick, see limits.py), or required identical where the recipe is
the same on both sides (a re-layout). Each comparison returns a TensorRow and its fault reasons."""

from __future__ import annotations

import math

import torch

from quantcli.errors import RecipeError
from quantcli.formats.decode import decode_module
from quantcli.formats.facts import ModuleFacts
from quantcli.formats.fused import fused_group_of
from quantcli.recipes import get_recipe
from quantcli.verify.findings import TensorRow
from quantcli.verify.limits import ABS_FLOOR, Limits, absolute_limits, allowed_margin, metrics

IDENTICAL = "identical to the decoded reference"


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as uint8 (a view, never a value cast)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def exact_match(layout, module, recipe, w, ours, on_disk, qt) -> dict:
    """Byte identity of quantcli's quantization `ours` of the reference `w` with what is on disk;
    for MX recipes, which scale rule reproduces the stored scales."""
    same = total = 0
    for name, t in layout.to_disk(module, ours).items():
        a, b = raw_bytes(t), raw_bytes(qt.get(name))
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


def _exact_relayout(q, rq) -> float:
    """Fraction of identical bytes of codes, block scales and global scale, both read through their
    layout's from_disk into quantcli's canonical form (so names, scalar shapes and directions drop out)."""
    same = total = 0
    pairs = [(q.codes, rq.codes), (q.scale, rq.scale)]
    if q.global_scale is not None and rq.global_scale is not None:
        pairs.append((q.global_scale.to(torch.float32), rq.global_scale.to(torch.float32)))
    for a, b in pairs:
        a, b = raw_bytes(a.cpu()), raw_bytes(b.cpu())
        if a.numel() == b.numel():
            same += int((a == b).sum())
        total += max(a.numel(), b.numel())
    return same / total if total else 1.0


def compare_identical(module, recipe, decoded, ref_w, q, rq, ref_kind: str, limits: Limits
                      ) -> tuple[TensorRow, list[str]]:
    """The same recipe on both sides (a re-layout): codes and block scales carry over unchanged, so
    the decoded values must be identical. The one exception is a global scale whose FP32 reciprocal
    does not invert back exactly (multiply <-> divide layouts; convert names it): every value then
    scales by exactly that ratio, and nothing more is allowed."""
    limit = 0.0
    if q.global_scale is not None and rq.global_scale is not None:
        ratio = float(q.global_scale.double().cpu() / rq.global_scale.double().cpu())
        if ratio != 1.0:  # one FP32 rounding of each product on top of the ratio itself
            limit = abs(ratio - 1.0) + 2 * torch.finfo(torch.float32).eps
    row = TensorRow(**metrics(decoded, ref_w), tensor=module, recipe=recipe.name, baseline_rel_err=0.0,
                    limit_rel_err=limit, limit_basis=IDENTICAL, exact_identical_fraction=_exact_relayout(q, rq))
    reasons = []
    if row.rel_err > limit:
        reasons.append(f"relative error {row.rel_err:.4g} against the decoded reference ({ref_kind}, the same "
                       f"recipe {recipe.name}): a re-layout must be identical to the decoded reference; "
                       f"{100 - 100 * row.exact_identical_fraction:.3g}% of code/scale bytes differ, so codes or "
                       f"scales were changed")
    reasons += absolute_limits(row, limits)
    row.passed = not reasons
    return row, reasons


def requantized_prior(entry) -> tuple[str, float] | None:
    """(source recipe, recorded error vs the decoded source) of a module convert re-quantized from
    a quantized source; None for other modules and for manifests written without it."""
    if entry is None or not entry.requantized_from:
        return None
    err = entry.requantize_rel_err
    if isinstance(err, bool) or not isinstance(err, (int, float)) or not math.isfinite(err) or err < 0:
        return None
    return entry.requantized_from, float(err)


def quantize_like(recipe, module: str, w: torch.Tensor, group_amax: dict, channel_ms=None):
    """quantcli's own quantization of `w` as convert does it (a fused group shares one global amax;
    `channel_ms` weights an activation-weighted scale search)."""
    amax = group_amax.get(fused_group_of(module)) if recipe.has_global_scale else None
    return recipe.quantize(module, w, facts=ModuleFacts(group_amax=amax, input_channel_ms=channel_ms))


def _source_estimate(prior, module, layout, w, ref, transpose, group_amax) -> tuple[str, float, float] | None:
    """(source recipe, quantcli's own error with it on the reference, recorded re-quantize error)."""
    if prior is None:
        return None
    name, requant_err = prior
    try:
        src_recipe = get_recipe(name)
    except RecipeError:
        return None  # a manifest naming a recipe this quantcli lacks: judge by the plain yardstick
    q = quantize_like(src_recipe, module, w, group_amax)
    src_err = metrics(decode_module(layout, module, src_recipe, q, transpose=transpose).cpu(), ref)["rel_err"]
    return name, src_err, requant_err


def compare(module, recipe, layout, decoded, ref, transpose, group_amax, limits: Limits, dev,
            prior: tuple[str, float] | None = None, channel_ms=None,
            dtype: torch.dtype | None = None) -> tuple[TensorRow, object, list[str]]:
    """Error of the decoded module against the reference, judged against quantcli's own
    quantization `ours` of the same reference tensor; returns (row, ours, fault reasons).

    `prior` (source recipe, recorded error): the module was re-quantized from a quantized source
    and the reference is the dense model that source was made from. Its error is then both
    quantizations: by the triangle inequality at most the source's error (estimated by quantcli's
    own quantization of the reference with the source recipe) plus the re-quantization error that
    convert measured against the decoded source; the margin applies to that sum. `dtype`: what
    the yardstick quantizes in (int4's scales carry the weight dtype the module was made in)."""
    w = ref.to(dev).transpose(-1, -2) if transpose else ref.to(dev)
    w = w if dtype is None else w.to(dtype)
    ours = quantize_like(recipe, module, w, group_amax, channel_ms)
    base = metrics(decode_module(layout, module, recipe, ours, transpose=transpose).cpu(), ref)
    row = TensorRow(**metrics(decoded, ref), tensor=module, recipe=recipe.name, baseline_rel_err=base["rel_err"])
    if recipe.scale_search != "none":  # the search's gain, visible per tensor
        plain = quantize_like(recipe.with_scale_search("none"), module, w, group_amax)
        row.absmax_rel_err = metrics(decode_module(layout, module, recipe, plain, transpose=transpose).cpu(), ref)["rel_err"]
    margin = limits.margin if limits.margin is not None else allowed_margin(ref.numel())
    bound, basis = base["rel_err"], "quantcli's own"
    source_estimate = _source_estimate(prior, module, layout, w, ref, transpose, group_amax)
    if source_estimate is not None:
        src_recipe, src_err, requant_err = source_estimate
        bound, basis = max(bound, src_err + requant_err), f"{src_recipe} {src_err:.3g} + re-quantize {requant_err:.3g}"
        row.source_recipe, row.source_baseline_rel_err, row.requantize_rel_err = src_recipe, src_err, requant_err
    row.limit_rel_err = bound * (1 + margin) + ABS_FLOOR
    row.limit_basis = f"({basis}) x {1 + margin:.2f}"
    reasons = []
    if row.rel_err > row.limit_rel_err:
        if source_estimate is not None:
            reasons.append(f"relative error {row.rel_err:.4g} exceeds the re-quantized bound {bound:.4g} (quantcli's "
                           f"own {src_recipe} {src_err:.4g} + recorded re-quantization {requant_err:.4g}) by more than "
                           f"{margin:.0%}: scales or codes are wrong")
        else:
            reasons.append(f"relative error {row.rel_err:.4g} exceeds quantcli's own {base['rel_err']:.4g} by more "
                           f"than {margin:.0%} (the allowance for real producers' rounding at this size): "
                           f"scales or codes are wrong")
    reasons += absolute_limits(row, limits)
    row.passed = not reasons
    return row, ours, reasons
