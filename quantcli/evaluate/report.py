"""The eval report as data (serialized by quantcli.reports.to_json; schema quantcli/schemas/eval.json)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from quantcli.evaluate.metrics import CausalMetrics, EncoderMetrics
from quantcli.reports import OMITTED


@dataclass
class ModuleError:
    module: str
    rel_err: float  # the module's own output error (quantcli/evaluate/emulate.py)


@dataclass
class LayerError:
    layer: int
    hidden_rel_err: float  # ||h_q - h_ref|| / ||h_ref|| of the block's output, over every token
    worst_modules: list[ModuleError]


@dataclass
class ModuleSensitivity:
    module: str
    layer: int
    own_rel_err: float  # the module's own output error (as in worst_modules)
    output_error: float  # the model output error with this module alone quantized: causal LM KL mean,
    #                      encoder 1 - cosine
    top1_agreement: float | None  # causal LM: next-token top-1 agreement with the reference; encoder: None


@dataclass
class Emulated:
    scheme: str
    modules: int


@dataclass
class EvalReport:
    checkpoint: str
    reference: str  # --reference SRC, or DST itself where a recipe is emulated on it (`emulating`)
    model_kind: str  # causal-lm | encoder
    layout: str | None
    recipes: dict[str, int]  # recipe -> quantized modules
    activations: list[Emulated]  # activation quantization emulated, per scheme
    kv_cache: str
    samples: int
    samples_in_data: int | None  # the data's samples, of which --samples keeps the first; None: a Hub dataset
    tokens: int
    tokens_in_data: int | None  # those of every sample in the data, uncut (--samples and --seq-len drop the rest)
    seq_len: int
    device: str
    layers: list[LayerError]
    worst_modules: list[ModuleError]  # over the whole model, largest own error first
    causal: CausalMetrics = OMITTED
    encoder: EncoderMetrics = OMITTED
    sensitivity: list[ModuleSensitivity] = field(default_factory=list)  # largest output_error first
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # eval --auto: the choice (convert --dry-run's record), its predicted error and the measured one
    auto: dict = OMITTED
    emulating: bool = False  # a recipe emulated on the dense DST, measured against DST itself


def module_rows(errors: dict, top: int) -> list[ModuleError]:
    """The `top` modules by own error; a module with none (left dense: the same weights on the
    same input) is not listed."""
    ranked = sorted(((m, e) for m, e in errors.items() if e.rel > 0), key=lambda kv: (-kv[1].rel, kv[0]))
    return [ModuleError(m, e.rel) for m, e in ranked[:top]]


def layer_rows(walked, top: int) -> list[LayerError]:
    return [LayerError(i, h.rel, module_rows(mods, top)) for i, (h, mods) in enumerate(zip(walked.layers,
                                                                                           walked.modules))]


def overall_worst(walked, top: int) -> list[ModuleError]:
    merged = {m: e for mods in walked.modules for m, e in mods.items()}
    return module_rows(merged, top)


def emulated(steps: dict) -> list[Emulated]:
    return [Emulated(label, n) for label, n in sorted(Counter(s.label for s in steps.values()).items())]


def recipes(modules: dict[str, str]) -> dict[str, int]:
    return dict(sorted(Counter(modules.values()).items()))


def sensitivity_candidates(walked, count: int) -> dict[str, tuple[int, float]]:
    """The `count` modules (all: count < 0) with the largest nonzero own error: {module: (layer, own error)}."""
    merged = [(m, i, e.rel) for i, mods in enumerate(walked.modules) for m, e in mods.items() if e.rel > 0]
    merged.sort(key=lambda t: (-t[2], t[0]))
    return {m: (i, rel) for m, i, rel in (merged if count < 0 else merged[:count])}


def sensitivity_rows(candidates: dict[str, tuple[int, float]], scores: dict) -> list[ModuleSensitivity]:
    rows = [ModuleSensitivity(m, i, rel, scores[m].output_error, scores[m].top1_agreement)
            for m, (i, rel) in candidates.items()]
    return sorted(rows, key=lambda r: (-r.output_error, r.module))
