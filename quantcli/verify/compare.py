"""One decoded module against its reference weight: judged as a quantization of it (judge.py:
are its codes a rounding of the reference to its stored scales?), or required identical where the
recipe is the same on both sides (a re-layout). A module convert re-quantized from a quantized
source, checked against the dense model behind that source, rounds the decoded source instead:
it is held to both quantizations' errors (requantized_bound, the producers' margin of limits.py).
Each comparison returns a TensorRow and its fault reasons."""

from __future__ import annotations

import math

import torch

from quantcli.errors import RecipeError
from quantcli.formats.facts import ModuleFacts
from quantcli.formats.fused import fused_group_of
from quantcli.kernels import tensor_amax
from quantcli.kernels.blockstats import Yardstick, block_stats
from quantcli.kernels.spec import TENSOR
from quantcli.recipes import get_recipe
from quantcli.verify.findings import TensorRow
from quantcli.verify.judge import ERROR_FACTOR, judge
from quantcli.verify.limits import ABS_FLOOR, Limits, absolute_limits, allowed_margin, metrics

IDENTICAL = "identical to the decoded reference"
ROUNDING_BASIS = f"{ERROR_FACTOR:g} x rounding's most"


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


def _yardstick(recipe, module: str, w: torch.Tensor, group_amax: dict, channel_ms=None, result=None,
               dtype: torch.dtype | None = None) -> Yardstick:
    """`recipe` applied to the reference as convert applies it, band by band in the comparison
    pass: a global scale from the fused group's (or the whole tensor's) amax, a per-tensor scale
    from the whole tensor (quantized up front: a band sees only its own amax), in `dtype`."""
    if result is None and recipe.spec.geometry == TENSOR:
        result = quantize_like(recipe, module, w if dtype is None else w.to(dtype), group_amax, channel_ms).result
    amax = None
    if recipe.has_global_scale and result is None:
        amax = group_amax.get(fused_group_of(module))
        amax = tensor_amax(w, name=module) if amax is None else amax.to(w.device)
    weight = channel_ms.to(w.device) if channel_ms is not None and recipe.scale_search != "none" else None
    return Yardstick(recipe.spec, amax, weight, result, dtype)


def _source_recipe(prior) -> tuple[str, object] | None:
    """(source recipe name, its Recipe) of a re-quantized module; None when there is none or this
    quantcli lacks it (then the module is judged plainly)."""
    if prior is None:
        return None
    try:
        return prior[0], get_recipe(prior[0])
    except RecipeError:
        return None


class Comparison:
    """One module decoded against its reference weight `w` (as stored, [..., N, K] once
    transposed): the block statistics and the judgement; `ours` is quantcli's own quantization
    when --exact asked for its bytes."""

    def __init__(self, module, recipe, q, w, limits: Limits, prior=None, channel_ms=None, exact: bool = False,
                 dtype: torch.dtype | None = None, output: tuple[float, float] | None = None):
        self.module, self.recipe, self.q, self.w, self.limits = module, recipe, q, w, limits
        self.prior, self.channel_ms, self.exact, self.ours = prior, channel_ms, exact, None
        self.dtype = dtype  # what quantcli's own quantization is made in (int4: its scales' dtype)
        self.output = output  # --calibration: (layer-output error, that of rounding to the stored scales)

    def run(self, group_amax: dict) -> tuple[TensorRow, list[str], int]:
        """(row, fault reasons, decoded values that are not finite)."""
        module, recipe, w = self.module, self.recipe, self.w
        source = _source_recipe(self.prior)
        yards = []
        # quantcli's own quantization costs as much as the rest of the pass: made only where it is
        # asked for (--exact compares its bytes, --threshold margin= its error) or needed (the
        # bound of a module re-quantized from a quantized source)
        if self.exact or self.limits.margin is not None or source is not None:
            if self.exact:
                self.ours = quantize_like(recipe, module, w if self.dtype is None else w.to(self.dtype), group_amax,
                                          self.channel_ms)
            yards.append(_yardstick(recipe, module, w, group_amax, self.channel_ms,
                                    self.ours.result if self.ours is not None else None, self.dtype))
            if recipe.scale_search != "none":  # the search's gain, visible per tensor
                yards.append(_yardstick(recipe.with_scale_search("none"), module, w, group_amax))
        if source is not None:
            yards.append(_yardstick(source[1], module, w, group_amax))
        st = block_stats(w, self.q.to(w.device).result, recipe.spec, tuple(yards))
        verdict = judge(st, recipe, tuple(w.shape), self.output)
        row, reasons = self._row(st, verdict, source)
        return row, reasons, st.nonfinite

    def _row(self, st, verdict, source) -> tuple[TensorRow, list[str]]:
        ss = float(st.ss.double().sum())

        def rel(sse: float) -> float:
            return math.sqrt(sse / ss) if ss > 0 else math.sqrt(sse)

        row = TensorRow(rel_err=verdict.rel_err, sqnr_db=verdict.sqnr_db, cosine=verdict.cosine, max_abs=st.max_abs,
                        tensor=self.module, recipe=self.recipe.name, limit_rel_err=verdict.error_limit,
                        limit_basis=ROUNDING_BASIS, gain=verdict.gain, gain_allowed=verdict.gain_allowed,
                        blocks=verdict.blocks, blocks_off=verdict.blocks_off)
        if verdict.output_rel_err is not None:
            row.output_rel_err, row.output_rounded_rel_err = verdict.output_rel_err, verdict.output_rounded_rel_err
        if st.yard:
            row.baseline_rel_err = rel(st.yard[0])
            if self.recipe.scale_search != "none" and len(st.yard) > 1 + (source is not None):
                row.absmax_rel_err = rel(st.yard[1])
        if source is not None:  # both quantizations' errors: the old bound (see requantized_bound)
            return row, requantized_bound(row, self.w.numel(), source[0], rel(st.yard[-1]),
                                          self.prior[1], self.limits)
        reasons = list(verdict.reasons)
        if self.limits.margin is not None:  # --threshold margin=: also hold it to quantcli's own error
            bound = row.baseline_rel_err * (1 + self.limits.margin) + ABS_FLOOR
            if row.rel_err > bound:
                reasons.append(f"relative error {row.rel_err:.4g} exceeds quantcli's own {row.baseline_rel_err:.4g} "
                               f"by more than {self.limits.margin:.0%} (--threshold margin)")
        reasons += absolute_limits(row, self.limits)
        row.passed = not reasons
        return row, reasons


def requantized_bound(row: TensorRow, numel: int, src_recipe: str, src_err: float, requant_err: float,
                      limits: Limits) -> list[str]:
    """A module convert re-quantized from a quantized source, checked against the dense model that
    source was made from: its codes round the decoded source, not this reference, so its error is
    both quantizations; by the triangle inequality at most the source's (estimated by quantcli's
    own quantization of the reference with the source recipe) plus the re-quantization error that
    convert measured against the decoded source, with the producers' margin on the sum."""
    margin = limits.margin if limits.margin is not None else allowed_margin(numel)
    bound = max(row.baseline_rel_err, src_err + requant_err)
    row.source_recipe, row.source_baseline_rel_err, row.requantize_rel_err = src_recipe, src_err, requant_err
    row.limit_rel_err = bound * (1 + margin) + ABS_FLOOR
    row.limit_basis = f"({src_recipe} {src_err:.3g} + re-quantize {requant_err:.3g}) x {1 + margin:.2f}"
    reasons = []
    if row.rel_err > row.limit_rel_err:
        reasons.append(f"relative error {row.rel_err:.4g} exceeds the re-quantized bound {bound:.4g} (quantcli's own "
                       f"{src_recipe} {src_err:.4g} + recorded re-quantization {requant_err:.4g}) by more than "
                       f"{margin:.0%}: scales or codes are wrong")
    reasons += absolute_limits(row, limits)
    row.passed = not reasons
    return reasons
