"""quantcli eval: what a quantized checkpoint costs its model, measured end to end on any machine.

The reference and the quantized checkpoint run over the same held-out samples in one layer
loop (engine.py): the quantized side with weights decoded from codes and scales (sides.py),
activations and the KV cache quantized as the checkpoint declares (declared.py, fake_quant.py),
each module's own error measured on the way (emulate.py); then perplexity, KL and top-1 of a
causal LM or the pooled-embedding cosine of an encoder (metrics.py). Nothing is written.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert.device import resolve_device
from quantcli.convert.world import assign_largest_first
from quantcli.errors import QuantcliError
from quantcli.evaluate import report as rep
from quantcli.evaluate.declared import activation_steps, kv_steps
from quantcli.evaluate.engine import Emulation, Walked, side_map, walk
from quantcli.evaluate.metrics import Causal, CausalSums, Encoder, EncoderSums, pooling_config
from quantcli.evaluate.sensitivity import ScoreSums, walk_sensitivity
from quantcli.evaluate.sides import RecipeSide, Side, check_same_model, reference_mismatch
from quantcli.formats.facts import Calibration
from quantcli.model.data_used import tokens_held
from quantcli.model.layers import batches
from quantcli.model.samples import check_token_ids, data_digest, read_samples, samples_held, token_ids
from quantcli.model.stack import (
    CAUSAL,
    ENCODER,
    attention_path,
    build_stack,
    cache_kwarg,
    encoder_positions,
    text_config,
)
from quantcli.planning.conversion import plan_conversion
from quantcli.planning.options_file import conversion_options


@dataclass
class EvalOptions:
    checkpoint: str
    reference: str
    data: str
    samples: int = 32
    seq_len: int = 256
    batch: int = 1
    device: str = "auto"
    kv_cache: str = "auto"  # auto | scale-one | none (declared.KV_MODES)
    revision: str | None = None  # of a Hub --reference
    top: int = 3  # worst modules listed per layer
    recipe: str | None = None  # emulate this recipe on `checkpoint` (dense) in memory; then no reference
    layout: str | None = None
    scale_rule: str | None = None
    scale_search: str | None = None
    ignore: list[str] = field(default_factory=list)  # with recipe / config: as convert --ignore
    config: Path | None = None  # a convert TOML recipe file to emulate (the options above override it)
    sensitivity: int = 0  # modules ranked by the model output error with each alone quantized; ALL: every one
    planned: object | None = None  # conversion Options to emulate as they are (eval --auto: convert's choice)

    @property
    def emulating(self) -> bool:
        """A recipe (a recipe file, --auto's choice) emulated on a dense DST, its own reference."""
        return bool(self.recipe or self.config or self.planned)


ALL = -1  # EvalOptions.sensitivity: every quantized module


@contextmanager
def _as_eval() -> Iterator[None]:
    """The shared model code names --calibration in its messages; here the option is --data."""
    try:
        yield
    except QuantcliError as exc:
        text = re.sub(r"--calibration needs", "quantcli eval needs", str(exc))
        text = re.sub(r"--calibration:", "eval:", text)
        raise type(exc)(re.sub(r"--calibration\b", "--data", text)) from None


def evaluate(opts: EvalOptions, progress: Callable[..., None] | None = None, world=None):
    """The EvalReport of `opts.checkpoint` against `opts.reference` on `opts.data`. `world`: the
    ranks of a split run (quantcli.convert.world.World; None: this process alone), each of which
    walks its share of the batches; every rank returns the whole report."""
    start = time.monotonic()
    with _as_eval():
        device = resolve_device(opts.device)
        if opts.emulating:
            ref_src = quant_src = open_source(opts.checkpoint, opts.revision)
        else:
            ref_src, quant_src = open_source(opts.reference, opts.revision), open_source(opts.checkpoint)
        with CheckpointTensors(ref_src) as rt, CheckpointTensors(quant_src) as qt:
            ref = Side(f"--reference {ref_src.label}", ref_src, rt, device)
            quant = _recipe_side(opts, quant_src, qt, device) if opts.emulating else Side(quant_src.label, quant_src,
                                                                                          qt, device)
            check_same_model(ref, quant)
            report = _run(opts, ref, quant, device, progress, world)
    report.seconds = round(time.monotonic() - start, 3)
    return report


def _recipe_side(opts: EvalOptions, source, tensors, device: torch.device):
    """`source` with `opts.recipe` (or `opts.planned`) applied in memory, planned exactly as convert plans it."""
    if opts.planned is not None:  # a mix: exact-name overrides and ignores (planning/auto.chosen_options)
        options, given = opts.planned, f"--auto {','.join(opts.planned.auto_choice.request.candidates)}"
    else:
        options = conversion_options(recipe=opts.recipe, layout=opts.layout, ignore=opts.ignore, config=opts.config,
                                     scale_rule=opts.scale_rule, scale_search=opts.scale_search)
        given = f"--recipe {opts.recipe}" if opts.recipe else f"--config {opts.config}"
    plan = plan_conversion(source, options)
    if plan.layout is None:
        raise QuantcliError(f"{given}: a dequantizing recipe; eval emulates a quantization recipe")
    return RecipeSide(f"{source.label} ({given}, emulated)", source, tensors, device, plan)


def share(input_batches: list[torch.Tensor], rank: int, size: int) -> list[torch.Tensor]:
    """Rank `rank`'s batches out of `size` ranks, split by tokens as convert splits shards
    (largest first, each to the least loaded rank), kept in their order."""
    owner = assign_largest_first({i: b.numel() for i, b in enumerate(input_batches)}, size)
    return [b for i, b in enumerate(input_batches) if owner[i] == rank]


def _merged_over_ranks(world, work: Callable[[], object], to_json: Callable, from_json: Callable, merge: Callable):
    """`work()` on this rank, merged with every other rank's (sent as JSON: nothing unpickled)."""
    if world is None or world.size == 1:
        return work()
    return merge([from_json(doc) for doc in world.settle_all(lambda: to_json(work()))])


def _run(opts: EvalOptions, ref, quant, device: torch.device, progress, world=None):
    stack = build_stack(ref.source.config, ref.names, ref.shape, ref.label)
    scales = quant.calibrated()
    steps = activation_steps(quant.layout, quant.config, quant.modules, scales, quant.label) if scales else {}
    kv, kv_said = _kv(opts, stack, quant, scales)
    ids, in_data, tokens_in_data, notes = _samples(opts, ref, quant, stack)
    mismatch = None if opts.emulating else reference_mismatch(ref, quant, stack)
    if mismatch:
        notes.insert(0, mismatch)
    input_batches = batches(ids, opts.batch)
    if world is not None and world.size > 1:
        if world.size > len(input_batches):
            notes.append(f"--workers {world.size}: the samples make {len(input_batches)} batch(es), so "
                         f"{world.size - len(input_batches)} worker(s) had none; at most {len(input_batches)} pay")
        input_batches = share(input_batches, world.rank, world.size)
    sums = CausalSums if stack.kind == CAUSAL else EncoderSums
    if stack.kind == CAUSAL:
        head = stack.names.linear_modules(stack.head()) if stack.head() else []
        finish = Causal(ref, quant, input_batches, steps.get(head[0]) if head else None)
    else:
        finish = Encoder(*pooling_config([ref.source.root, quant.source.root]), sides=(ref, quant))

    def walk_mine():
        if not input_batches:  # more ranks than batches
            return Walked.empty(len(stack.layers), sums.empty())
        return walk(stack, ref, quant, input_batches, device, Emulation(steps, kv, quant.transforms()), finish,
                    progress)

    walked = _merged_over_ranks(world, walk_mine, Walked.to_json, lambda doc: Walked.from_json(doc, sums), Walked.merge)
    ranked = _sensitivity(opts, stack, (ref, quant), input_batches, device, steps, walked,
                          None if stack.kind == CAUSAL else finish, progress, world)
    if not quant.quantized:
        notes.append(f"{quant.label} holds no quantized module: both sides run the same kind of weights")
    final = walked.final.metrics() if stack.kind == CAUSAL else finish.metrics(walked.final)
    metrics = {"causal" if stack.kind == CAUSAL else "encoder": final}
    return rep.EvalReport(
        checkpoint=quant.label, reference=ref.source.label, model_kind=stack.kind,
        layout=quant.layout.name if quant.layout else None, recipes=rep.recipes(quant.modules),
        activations=rep.emulated(steps), kv_cache=kv_said, samples=len(ids), samples_in_data=in_data,
        tokens=sum(len(s) for s in ids), tokens_in_data=tokens_in_data,
        seq_len=opts.seq_len, device=str(device), layers=rep.layer_rows(walked, opts.top),
        worst_modules=rep.overall_worst(walked, max(opts.top, 10)), sensitivity=ranked, notes=notes,
        emulating=opts.emulating,
        **metrics)


def _sensitivity(opts: EvalOptions, stack, sides: tuple, input_batches: list, device: torch.device, steps: dict,
                 walked, pooled, progress, world=None) -> list:
    """The chosen modules ranked by the model output error with each alone quantized (sensitivity.py);
    every rank chooses the same ones (from the merged walk) and measures them on its batches."""
    if not opts.sensitivity:
        return []
    candidates = rep.sensitivity_candidates(walked, opts.sensitivity)
    if not candidates:
        return []
    chosen: dict[int, list[str]] = {}
    for module, (layer, _) in candidates.items():
        chosen.setdefault(layer, []).append(module)
    causal = pooled is None

    def mine() -> dict:
        if not input_batches:
            return {m: ScoreSums(0.0, 0 if causal else None, 0) for m in candidates}
        return walk_sensitivity(stack, *sides, input_batches, device, steps, chosen, pooled, progress)

    def merge(parts: list[dict]) -> dict:
        return {m: ScoreSums.merge([p[m] for p in parts]) for m in candidates}

    sums = _merged_over_ranks(world, mine, lambda d: {m: [s.error, s.agree, s.count] for m, s in d.items()},
                     lambda doc: {m: ScoreSums(*v) for m, v in doc.items()}, merge)
    return rep.sensitivity_rows(candidates, {m: s.score() for m, s in sums.items()})


def _kv(opts: EvalOptions, stack, quant, scales) -> tuple[dict, str]:
    if stack.kind != CAUSAL and opts.kv_cache == "scale-one":
        raise QuantcliError("--kv-cache scale-one: an encoder keeps no KV cache; drop the option")
    names = side_map(stack, quant)
    paths = [attention_path(layer, stack.layer_prefix(i)) if cache_kwarg(layer) else None
             for i, layer in enumerate(stack.layers)]
    attentions = [names.module(p) for p in paths if p is not None]
    kv = kv_steps(scales, opts.kv_cache, attentions, quant.label) if stack.kind == CAUSAL else {}
    if not kv:
        return {}, "not quantized" + (" (--kv-cache none)" if opts.kv_cache == "none" else
                                      " (the checkpoint declares no FP8 KV cache)")
    if opts.kv_cache == "scale-one":
        return kv, f"FP8 E4M3, scale 1.0 ({len(kv)} attention layers)"
    return kv, f"FP8 E4M3, the checkpoint's k/v scales ({scales.kv_cache}; {len(kv)} attention layers)"


def _samples(opts: EvalOptions, ref, quant, stack) -> tuple[list[list[int]], int | None, int | None, list[str]]:
    """The token ids run, how many samples and tokens (uncut) the data holds (None: a Hub dataset
    read only as far as --samples) and the notes about them."""
    notes, seq_len = [], opts.seq_len
    limit = encoder_positions(text_config(ref.source.config)) if stack.kind == ENCODER else None
    if limit is not None and seq_len > limit:
        notes.append(f"--seq-len {seq_len}: the encoder has position embeddings for {limit} tokens; each sample "
                     f"is cut to {limit}")
        seq_len = limit
    cal = Calibration(opts.data, opts.samples, seq_len, opts.batch)
    check_token_ids(read_samples(cal), cal, stack.vocab_size)
    ids = token_ids(cal, ref.source.root)
    if not ids:
        raise QuantcliError(f"--data {opts.data}: every sample tokenized to nothing")
    manifest = quant.detected.manifest if quant.detected else None
    recorded = (manifest.calibration or {}) if manifest else {}
    if recorded.get("data_sha256") and recorded["data_sha256"] == data_digest(cal):
        notes.append(f"--data {opts.data} is the data {quant.label} was calibrated on (its manifest's "
                     f"data_sha256): evaluating on calibration data flatters the result")
    held = samples_held(cal)
    return ids, held, tokens_held(cal, ref.source.root, held), notes
