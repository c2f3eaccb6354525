"""The --reference checkpoint, and the checks that compare a quantized checkpoint with it."""

from __future__ import annotations

import torch

from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors, same_bytes
from quantcli.errors import QuantcliError
from quantcli.formats.decode import decode_module
from quantcli.formats.detect import detect
from quantcli.formats.fused import fused_group_of
from quantcli.kernels import tensor_amax
from quantcli.planning.plan import TRANSPOSED_EXPERTS, matches
from quantcli.planning.transforms import ops_of
from quantcli.recipes import RECIPES
from quantcli.reports import OMITTED
from quantcli.verify.compare import (
    IDENTICAL,
    Comparison,
    compare_identical,
    exact_match,
    requantized_prior,
)
from quantcli.verify.findings import (
    FINITE,
    REF_ERROR,
    REF_IDENTICAL,
    REF_MODULES,
    REF_OUTPUT,
    REF_PRESENT,
    REF_SAME,
    Findings,
    GptqRerun,
    TensorRow,
)
from quantcli.verify.gptq_exact import is_gptq, rerun_reason
from quantcli.verify.judge import OutputReason
from quantcli.verify.limits import Limits
from quantcli.verify.structure import Progress, finite_check, no_progress, nonfinite_fault, scale_rule_of


def source_name(module: str, rt: CheckpointTensors) -> str | None:
    for name in (f"{module}.weight", module):
        if name in rt:
            return name
    return None


class Reference:
    """The --reference checkpoint. Dense weights are read as stored; when the reference is itself
    quantized (the source of a re-layout, re-quantization or dequantization), each of its modules
    is read through its own layout (detected as inspect and convert do) and decoded, so
    comparisons are against the values it stands for, never its packed codes. Where the checkpoint
    under test records exact transforms (`convert --rotate`: the manifest's `transforms`), a dense
    reference tensor they changed is read transformed alike, recomputed from the record."""

    def __init__(self, label: str, source, rt: CheckpointTensors, dev, transforms: dict | None = None):
        self.label, self.source, self.rt, self.dev = label, source, rt, dev
        self.transforms = transforms or {}  # reference tensor name -> TransformOp
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
        return layout.recipe_for(self.det.modules[module], scale_rule_of(self.rules.get(module)))

    def names(self, module: str) -> list[str]:
        """The reference's stored tensors of a quantized module."""
        return [d.name for d in self.det.layout.describe(module, self.recipe(module))]

    def read(self, module: str):
        """The quantized module in canonical form (QuantizedTensor); QuantcliError when unreadable."""
        try:
            return self.det.layout.from_disk(module, self.recipe(module), self.rt.get, self.rt.where)
        except (KeyError, RuntimeError, ValueError) as exc:  # a missing or misshapen tensor of the reference
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
        """(reference weight of `module`, whether the checkpoint's decode must be transposed to
        match it), or None when the reference has no such module. A dense weight comes as stored
        (its pages read as the comparison streams through it; release_weight drops them), a
        quantized reference's module decoded to FP32."""
        if self.recipe_name(module) is not None:
            return self.decoded(module), False  # both sides in the quantized [..., N, K] orientation
        name = source_name(module, self.rt)
        if name is None:
            return None
        transpose = transpose_hint if transpose_hint is not None else bool(TRANSPOSED_EXPERTS.search(name))
        return self.dense(name), transpose

    def dense(self, name: str) -> torch.Tensor:
        """A dense reference tensor as the checkpoint's producer started from: transformed (FP32)
        where the checkpoint records a transform of it, else as stored."""
        op = self.transforms.get(name)
        return self.rt.get(name) if op is None else op.apply(self.rt.get(name))

    def release_weight(self, module: str) -> None:
        """Memory tracks the tensor in flight, not the model."""
        if self.recipe_name(module) is not None:
            self.release(module)
        else:
            name = source_name(module, self.rt)
            if name is not None:
                self.rt.release(name)


def reference_group_amax(decoded_cache: dict, ref: Reference, entries: dict, dev) -> dict:
    """Fused group -> amax of the reference weights of its members (dense or decoded), for the
    recipes with a global scale that the yardstick quantizes with (the module's own, or the source
    recipe of a re-quantized module)."""
    out: dict[str, torch.Tensor] = {}
    for module, (recipe, _) in decoded_cache.items():
        group = fused_group_of(module)
        prior = requantized_prior(entries.get(module))
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
        ref.release_weight(module)
        out[group] = amax if group not in out else torch.maximum(out[group], amax)
    # A "group" with one member behaves like a plain tensor: its own amax, as convert does.
    return out


class _Comparison:
    """What every module's comparison against the reference shares."""

    def __init__(self, det, ref: Reference, qt: CheckpointTensors, exact: bool, limits: Limits, dev, found: Findings):
        self.layout, self.ref, self.qt, self.exact, self.limits, self.dev, self.found = (
            det.layout, ref, qt, exact, limits, dev, found)
        self.entries = {m.module: m for m in det.manifest.modules} if det.manifest else {}
        self.group_amax: dict = {}
        self.channel_ms = None  # module -> mean squared input per channel, from --calibration
        self.outputs: dict = {}  # module -> outputs.OutputError, from --calibration
        self.rerun: GptqRerun | None = None  # --exact --calibration: GPTQ rerun by quantcli's own conversion

    def consumed_names(self, module: str, recipe) -> list[str]:
        """Names of both sides' tensors that this module's comparison accounts for."""
        names = [d.name for d in self.layout.describe(module, recipe)]
        if self.ref.recipe_name(module) is not None:
            return names + self.ref.names(module)
        name = source_name(module, self.ref.rt)
        return names + ([name] if name else [])

    def reference_weight(self, module: str) -> tuple[torch.Tensor, bool] | None:
        entry = self.entries.get(module)
        try:
            got = self.ref.weight(module, entry.transposed_from_source if entry else None)
        except QuantcliError as exc:
            self.found.fault(REF_MODULES, module, str(exc))
            return None
        if got is None:
            self.found.fault(REF_MODULES, module, "the reference has no tensor for this module: a different model?")
        return got

    def row(self, module: str, recipe, q) -> TensorRow | None:
        got = self.reference_weight(module)
        if got is None:
            return None
        try:
            return self._judged(module, recipe, q, *got)
        finally:
            self.ref.release_weight(module)

    def _judged(self, module: str, recipe, q, w: torch.Tensor, transpose: bool) -> TensorRow | None:
        logical = tuple(q.shape[:-2]) + (tuple(q.shape[-2:])[::-1] if transpose else tuple(q.shape[-2:]))
        if logical != tuple(w.shape):
            self.found.fault(REF_MODULES, module, f"decodes to {list(logical)} but the reference is "
                                                  f"{list(w.shape)}: a different model or a transposed tensor")
            return None
        w = w.to(self.dev).transpose(-1, -2) if transpose else w.to(self.dev)  # the decode's [..., N, K]
        if self.ref.recipe_name(module) == recipe.name:  # a re-layout: the same values, or corrupt
            decoded = decode_module(self.layout, module, recipe, q, device=self.dev).cpu()
            if not finite_check(module, decoded, self.found):
                return None
            row, reasons = compare_identical(module, recipe, decoded, w.cpu(), q, self.ref.read(module),
                                             self.ref.kind, self.limits)
            check = REF_SAME
        else:
            got = self._against_source(module, recipe, q, w)
            if got is None:
                return None
            (row, reasons), check = got, REF_ERROR
        for r in reasons:
            self.found.fault(REF_OUTPUT if isinstance(r, OutputReason) else check, module, r)
        return row

    def _against_source(self, module, recipe, q, w) -> tuple[TensorRow, list[str]] | None:
        """The module judged as a quantization of `w` (judge.py); None when it decodes to non-finite
        values (filed under FINITE)."""
        entry = self.entries.get(module)
        prior = requantized_prior(entry) if self.ref.det is None or self.ref.recipe_name(module) is None else None
        ms = self._search_weights(entry, module)
        # int4's stored scales carry the dtype it was quantized in (convert casts a decoded source to the
        # model's): quantcli's own quantization is made in it too
        dtype = q.scale.dtype if recipe.scale_codec.dtype is None else None
        out = self.outputs.get(module)
        output = (out.rel(out.checkpoint), out.rel(out.rounded)) if out is not None else None
        job = Comparison(module, recipe, q, w, self.limits, prior, ms, self.exact, dtype, output)
        row, reasons, nonfinite = job.run(self.group_amax)
        if nonfinite:
            self.found.fault(FINITE, module, nonfinite_fault(nonfinite))
            return None
        if is_gptq(entry) and row.baseline_rel_err is not OMITTED:
            row.baseline_rounding = "nearest"  # quantize_like rounds to nearest; the report must not pass it as GPTQ's
        if self.exact and is_gptq(entry):
            reasons += self._rerun_bytes(module, row)
        elif self.exact:
            match = exact_match(self.layout, module, recipe, w, job.ours.to("cpu"), q, self.qt)
            row.exact_identical_fraction = match["exact_identical_fraction"]
            if "scale_rule_matches" in match:
                row.scale_rule_matches = match["scale_rule_matches"]
            reasons += self._searched_bytes(entry, recipe, row.exact_identical_fraction, ms is not None)
        return row, reasons

    def _rerun_bytes(self, module: str, row: TensorRow) -> list[str]:
        """A GPTQ module's bytes against the rerun of GPTQ (gptq_exact.py); without the rerun
        (no --calibration) listed as not byte-checked."""
        fraction = self.rerun.fractions.get(module) if self.rerun is not None else None
        if fraction is None:
            self.found.gptq_unchecked.append(module)
            return []
        row.exact_identical_fraction = fraction
        return [rerun_reason(fraction)] if fraction < 1.0 else []

    def _search_weights(self, entry, module: str):
        """The per-channel weights an activation-weighted search used, from --calibration's rerun;
        None for a data-free search, or when the weights are not at hand (then noted, once)."""
        if entry is None or not entry.scale_search_weights:
            return None
        ms = self.channel_ms(module) if self.channel_ms is not None else None
        if ms is None and self.exact and not is_gptq(entry):  # a GPTQ module is listed as such
            self.found.not_byte_checked.append(module)
        return ms

    def _searched_bytes(self, entry, recipe, fraction: float, weights_known: bool) -> list[str]:
        """A module quantcli wrote with a scale search is reproduced byte for byte by re-quantizing
        with the recorded method (an activation-weighted one with the rerun calibration's
        weights); the absmax path only reports the fraction (other producers round differently)."""
        if entry is None or entry.requantized_from or recipe.scale_search == "none" or fraction >= 1.0:
            return []
        if entry.scale_search_weights and not weights_known:
            return []  # noted: needs --calibration
        how = "the rerun calibration's channel weights" if weights_known else "no weights (data-free)"
        return [f"--exact: {100 * (1 - fraction):.3g}% of code/scale bytes differ from quantcli's own quantization "
                f"with the recorded scale search ({recipe.scale_search}, {how}): the bytes were changed after convert"]


def reference_checks(reference: str, revision: str | None, det, decoded_cache: dict, qt: CheckpointTensors,
                     pattern: str | None, exact: bool, limits: Limits, dev, found: Findings,
                     progress: Progress = no_progress, channel_ms=None, outputs: dict | None = None,
                     rerun: GptqRerun | None = None) -> tuple[list[TensorRow], str]:
    """Every read-back module against the reference, then the tensors neither side quantizes.
    `channel_ms(module)`: a calibration rerun's mean squared input per channel, for modules whose
    scale search it weighted (None: no --calibration); `outputs`: its layer-output errors per
    module (outputs.py), which judge those modules; `rerun`: --exact's GPTQ rerun (gptq_exact.py)."""
    rows = []
    ref_source = open_source(reference, revision)
    with CheckpointTensors(ref_source) as rt:
        ref = Reference(reference, ref_source, rt, dev, ops_of(det.manifest.transforms) if det.manifest else None)
        job = _Comparison(det, ref, qt, exact, limits, dev, found)
        job.channel_ms, job.outputs, job.rerun = channel_ms, outputs or {}, rerun
        progress("comparing", 0, len(decoded_cache), "(fused groups' amax)")
        job.group_amax = reference_group_amax(decoded_cache, ref, job.entries, dev)
        consumed = set()
        for done, (module, (recipe, q)) in enumerate(decoded_cache.items()):
            progress("comparing", done, len(decoded_cache), module)
            consumed.update(job.consumed_names(module, recipe))
            row = job.row(module, recipe, q)
            if row is None:
                continue
            rows.append(row)
            if ref.recipe_name(module) is not None:
                ref.release(module)
            for d in det.layout.describe(module, recipe):
                qt.release(d.name)
        progress("comparing", len(decoded_cache), len(decoded_cache), "")
        found.ran(REF_MODULES)
        found.ran(FINITE)
        if any(r.limit_basis == IDENTICAL for r in rows):
            found.ran(REF_SAME)
        if any(r.limit_basis != IDENTICAL for r in rows) or not rows:
            found.ran(REF_ERROR)
        if any(r.output_rel_err is not OMITTED for r in rows):
            found.ran(REF_OUTPUT)
        _unquantized_identical(ref, qt, consumed, pattern, det.modules, found)
    return rows, ref.kind


def remaining_reference_tensors(rt: CheckpointTensors, qt: CheckpointTensors, consumed: set, pattern: str | None,
                                quantized: dict, found: Findings, checked: str):
    """The reference's tensors not compared yet (not in `consumed`) that `pattern` selects and
    that `checked` (the checkpoint under test) also holds; one it lacks is a REF_PRESENT fault,
    unless it belongs to a module the reference quantized (those are compared as modules)."""
    for name in sorted(rt.where):
        if name in consumed or (pattern and not matches(pattern, name)):
            continue
        if name in qt:
            yield name
        elif any(name.startswith(mod) for mod in quantized):
            continue
        elif rebuilt_position_ids(rt, name):
            found.notes.append(f"{name}: absent from {checked}; it is 0, 1, 2, ... (a position_ids buffer, which "
                               f"transformers builds itself and no longer saves), so nothing is lost")
        else:
            found.fault(REF_PRESENT, name, f"missing from {checked} (dropped)")


def rebuilt_position_ids(rt: CheckpointTensors, name: str) -> bool:
    """Whether reference tensor `name` is a `position_ids` buffer holding 0..n-1 along its last dim:
    BERT-style embeddings register it non-persistent, so transformers saves a model without it and
    rebuilds it on load (older checkpoints, all-MiniLM-L6-v2's among them, still carry it). Its
    value is its shape: a checkpoint without it loses nothing."""
    if name.rpartition(".")[2] != "position_ids":
        return False
    t = rt.get(name)
    counts = (not t.is_floating_point() and not t.is_complex() and t.dim() > 0
              and bool(torch.equal(t, torch.arange(t.shape[-1], dtype=t.dtype).expand_as(t))))
    rt.release(name)
    return counts


def _unquantized_identical(ref: Reference, qt: CheckpointTensors, consumed: set, pattern: str | None,
                           quantized: dict, found: Findings) -> None:
    """Tensors neither side quantizes: present and bit-identical (a transformed one: to the
    reference transformed as recorded, in the checkpoint's dtype)."""
    rt = ref.rt
    for name in remaining_reference_tensors(rt, qt, consumed, pattern, quantized, found, "the quantized checkpoint"):
        ri, qi = rt.info(name), qt.info(name)
        if name in ref.transforms and ri.shape == qi.shape:
            expected = ref.dense(name).to(qt.get(name).dtype)
            if not torch.equal(expected.view(torch.uint8), qt.get(name).contiguous().view(torch.uint8)):
                found.fault(REF_IDENTICAL, name, "differs from the reference transformed as the manifest records "
                                                 "(transforms)")
        elif ri.dtype != qi.dtype or ri.shape != qi.shape:
            found.fault(REF_IDENTICAL, name, f"changed from {ri.dtype}{list(ri.shape)} to {qi.dtype}"
                                             f"{list(qi.shape)} (a lossy cast or a different model)")
        elif not same_bytes(rt.raw(name), qt.raw(name)):
            found.fault(REF_IDENTICAL, name, "unquantized tensor differs from the reference (not bit-identical)")
        rt.release(name)
        qt.release(name)
    found.ran(REF_PRESENT)
    found.ran(REF_IDENTICAL)
