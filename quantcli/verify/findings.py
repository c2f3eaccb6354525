"""The verify report as data: the checks run, the faults filed under them, one row per compared
tensor. Serialized by quantcli.reports.to_json; rendered by quantcli.cli.render."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from quantcli.formats.engine_checks import IF, YES, loads_in_line
from quantcli.reports import NOT_IN_JSON, OMITTED

# Every check verify runs, in report order. Each gets its status from the faults filed under it,
# so the report never says "checked" before the result is known.
MANIFEST = "manifest agrees with the safetensors headers"
CONFIG = "config keys the consumer needs are present"
SERVABLE = "each (recipe, layout) pair is one a serving engine loads"
TENSORS = "quantized tensors have the dtypes and shapes the layout reads"
FUSED = "fused groups share one precision and one global scale"
COVERAGE = "every Linear is quantized or excluded"
SCALES = "scales finite, positive, no E8M0 255"
FINITE = "every quantized module decodes to finite values"
CALIBRATED = ("activation and KV-cache scales present where the config declares them, finite, positive, in the "
              "layout's direction, equal across fused groups")
DIRECTION = "global scales agree in direction with the rest of the checkpoint"
TP = "quantized dims split into whole blocks across {tp} ranks"
REF_MODULES = "every quantized module has a reference tensor of the same shape"
REF_ERROR = "decoded weights are a rounding of the reference to the stored scales (gain, error, blocks, scales)"
REF_OUTPUT = ("layer outputs on the calibration data no worse than rounding the reference to the stored scales "
              "(+25 %), in place of the weight-error rule")
REF_SAME = "modules of the same recipe identical to the decoded reference (lossless re-layout)"
REF_PRESENT = "every reference tensor present in the checkpoint"
REF_IDENTICAL = "unquantized tensors bit-identical to the reference"
REF_DEQUANT = "dequantized tensors bit-identical to the decoded reference cast to their dtype"


@dataclass
class Fault:
    check: str
    tensor: str
    fault: str


@dataclass
class CheckResult:
    check: str
    passed: bool
    faults: int


@dataclass
class TensorRow:
    """One compared tensor: its error against the reference, the yardstick and the limit."""

    rel_err: float
    sqnr_db: float
    cosine: float
    max_abs: float
    tensor: str
    recipe: str
    # quantcli's own quantization of the reference (0 where identity is required); computed only where
    # asked for (--exact, --threshold margin=) or needed (a re-quantized module's bound)
    baseline_rel_err: float = OMITTED
    # "nearest" on a module GPTQ rounded: baseline_rel_err is then round to nearest's error, not GPTQ's
    # (the GPTQ rerun, --exact --calibration, is compared by bytes: exact_identical_fraction)
    baseline_rounding: str = OMITTED
    # the module was re-quantized from a quantized source: that recipe, its estimated error, convert's record
    source_recipe: str = OMITTED
    source_baseline_rel_err: float = OMITTED
    requantize_rel_err: float = OMITTED
    limit_rel_err: float = 0.0
    limit_basis: str = ""
    exact_identical_fraction: float | None = OMITTED  # None: compared, not identical (a dequantized tensor)
    scale_rule_matches: str = OMITTED
    absmax_rel_err: float = OMITTED  # a searched module: what absmax scales would give (the search's gain)
    # judged as a quantization of the reference (verify/judge.py): decode = gain x reference + noise,
    # |gain - 1| allowed up to gain_allowed; judged blocks and those whose scale is wrong
    gain: float = OMITTED
    gain_allowed: float = OMITTED
    blocks: int = OMITTED
    blocks_off: int = OMITTED
    # --calibration: layer-output error on the calibration data, and that of the reference rounded to
    # nearest under the checkpoint's own scales (the bound, outputs.py)
    output_rel_err: float = OMITTED
    output_rounded_rel_err: float = OMITTED
    passed: bool = False


@dataclass
class GptqRerun:
    """--exact --calibration: quantcli's own conversion of the reference with the options and data
    the manifest records (gptq_exact.py), and how many of the checkpoint's GPTQ modules it
    reproduced byte for byte."""

    seconds: float
    modules: int
    identical: int
    fractions: dict[str, float] = field(default_factory=dict, metadata=NOT_IN_JSON)  # module -> identical bytes


@dataclass
class VerifyReport:
    checkpoint: str
    layout: str
    reference: str | None
    reference_kind: str | None
    modules: int
    notes: list[str]
    checks: list[CheckResult]
    faults: list[Fault]
    tensors: list[TensorRow]
    layers: dict[str, float]
    warnings: list[str]
    passed: bool
    # --exact: modules whose bytes need --calibration DATA to be reproduced, so were not checked:
    # written with an activation-weighted scale search (manifest scale_search_weights) or rounded by GPTQ
    not_byte_checked: list[str] = field(default_factory=list)
    gptq_rerun: GptqRerun = OMITTED  # --exact --calibration on GPTQ modules
    loads_in: str = OMITTED  # the engines that load this checkpoint, as convert and inspect say it


class Findings:
    """Faults filed under the check that found them, and the checks run, in order."""

    def __init__(self) -> None:
        self.faults: list[Fault] = []
        self.checks: list[str] = []
        self.notes: list[str] = []  # what the user must know about what was (not) checked
        self.not_byte_checked: list[str] = []  # --exact could not check these modules' bytes
        self.gptq_unchecked: list[str] = []  # ... these, rounded by GPTQ, for want of --calibration

    def fault(self, check: str, tensor: str, what: str) -> None:
        self.faults.append(Fault(check=check, tensor=tensor, fault=what))

    def ran(self, check: str) -> None:
        if check not in self.checks:
            self.checks.append(check)

    def record(self, check: str, faults: Iterable[tuple[str, str]]) -> None:
        """File a check's (tensor, fault) findings and mark it run."""
        for tensor, what in faults:
            self.fault(check, tensor, what)
        self.ran(check)

    def summary(self) -> list[CheckResult]:
        counts = {c: 0 for c in self.checks}
        for f in self.faults:
            counts[f.check] = counts.get(f.check, 0) + 1
        return [CheckResult(check=c, passed=n == 0, faults=n) for c, n in counts.items()]


def _layer_of(name: str) -> int | None:
    """The block index: `model.layers.3.`, BERT's `encoder.layer.3.`, GPT-2's `transformer.h.3.`."""
    m = re.search(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


NOT_BYTE_CHECKED = ("--exact: {n} module(s) were quantized with an activation-weighted scale search (manifest "
                    "scale_search_weights) and their bytes were not checked: pass --calibration DATA (the data "
                    "convert used) to re-quantize them with the same weights and compare byte for byte")


def build_report(source, layout_name: str, reference: str | None, reference_kind: str | None, modules: int,
                 found: Findings, rows: list[TensorRow], notes: tuple[str, ...] = (),
                 gptq_rerun: GptqRerun = OMITTED, engines: list | None = None) -> VerifyReport:
    if found.not_byte_checked:
        notes = (*notes, NOT_BYTE_CHECKED.format(n=len(found.not_byte_checked)))
    rows.sort(key=lambda r: -r.rel_err)
    layers: dict[str, float] = {}
    for r in rows:
        layer = _layer_of(r.tensor)
        key = "other" if layer is None else str(layer)
        layers[key] = max(layers.get(key, 0.0), r.rel_err)
    return VerifyReport(checkpoint=source.label, layout=layout_name, reference=reference,
                        reference_kind=reference_kind, modules=modules, notes=list(notes), checks=found.summary(),
                        faults=found.faults, tensors=rows, layers=layers,
                        warnings=[*source.warnings, *_unloadable(engines)],
                        passed=not found.faults, not_byte_checked=[*found.not_byte_checked, *found.gptq_unchecked],
                        gptq_rerun=gptq_rerun, loads_in=OMITTED if engines is None else loads_in_line(engines))


def _unloadable(engines: list | None) -> list[str]:
    """A warning where no engine loads the checkpoint as it is (shapes, config: the engines table's
    checks settled on it), though every (recipe, layout) pair is one an engine loads."""
    if engines is None or any(j.loads in (YES, IF) for j in engines):
        return []
    why = "; ".join(f"{j.engine}: {j.reason}" for j in engines if j.reason)
    return [f"no serving engine loads this checkpoint as it is ({why}); `quantcli inspect` lists each engine's "
            f"conditions"]
