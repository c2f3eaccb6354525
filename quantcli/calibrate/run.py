"""The calibration pass: data -> layer-by-layer statistics -> ModuleFacts (a fact pass,
convert/passes/fact_passes.py), and the walk over the source on the calibration data that weight
passes run on too (`walk_source`).

What it learned is kept in the staging folder (`cache`) as safetensors (tensors, and notes in
the metadata; no pickle), so `--resume` of an interrupted conversion does not calibrate again:
the staging folder is only resumed by a run with the same fingerprint, which covers the data
and the calibration options."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from quantcli.atomic import write_atomic
from quantcli.calibrate.engine import Stats, collect
from quantcli.calibrate.scales import needs_walk, scale_facts
from quantcli.convert.passes.kinds import combined_max
from quantcli.model.layers import LayerPass, Weights, batches, walk_layers
from quantcli.model.samples import token_ids
from quantcli.model.stack import layer_count
from quantcli.model.threads import walk_threads
from quantcli.planning.plan import Plan

Facts = dict[str, dict[str, object]]


def calibrate(plan: Plan, tensors, device: torch.device, cache: Path | None = None,
              progress: Callable[[int, str], None] | None = None) -> Facts:
    """{module: {ModuleFacts field: value}} from running the source over the calibration data;
    {} without running it when the plan writes nothing it learns (needs_walk)."""
    if not needs_walk(plan):
        return {}
    if cache is not None and cache.is_file():
        return load_facts(cache)
    facts = scale_facts(plan, collect_stats(plan, tensors, device, progress))
    if cache is not None:
        save_facts(cache, facts)
    return facts


def collect_stats(plan: Plan, tensors, device: torch.device, progress: Callable[[int, str], None] | None = None,
                  part: tuple[int, int] = (0, 1)) -> Stats:
    """The statistics of the source over the calibration data (`part`: this rank's batches)."""
    cal = plan.options.calibration
    if progress is not None:  # the bar names the phase from the start: tokenizing takes seconds
        progress(0, "calibrating: tokenizing the data")
    ids = token_ids(cal, plan.source.root)
    if progress is not None:
        progress(0, f"calibrating: layer 0/{layer_count(plan.source.config)}, {len(ids)} samples")
    # The thread rule of every walk (model/threads.py): the bytes then follow the model and the
    # data, and --workers ranks (one thread each on 2 cores) compute what one process computes.
    with walk_threads(device, sum(map(len, ids)) / max(1, len(batches(ids, cal.batch))), plan.source.config):
        return collect(plan.source.config, Weights.of(tensors, plan.transforms), ids, cal.batch, device,
                       progress=_LayerProgress(progress) if progress is not None else None,
                       channel_stats=plan.options.scale_search == "mse", part=part,
                       quantized=frozenset(t.module for t in plan.tensors if t.quantized))


def walk_source(plan: Plan, tensors, device: torch.device, layer_pass: LayerPass, ids: list[list[int]],
                progress: Callable[[int, str], None] | None = None, part: tuple[int, int] = (0, 1),
                verb: str = "calibrating") -> None:
    """Run `layer_pass` over the source's layers on the calibration samples `ids`: the walk
    calibration runs on, for a weight pass (convert/passes/weight_walk.py)."""
    if progress is not None:  # the bar names the phase before the first layer is done
        progress(0, f"{verb}: layer 0/{layer_count(plan.source.config)}, {len(ids)} samples")
    walk_layers(plan.source.config, Weights.of(tensors, plan.transforms), ids, plan.options.calibration.batch,
                device, layer_pass, _LayerProgress(progress, verb) if progress is not None else None, part)


def splits_exactly(plan: Plan) -> bool:
    """Whether ranks may each calibrate on their share of the batches and combine the results
    bit for bit: yes for maxima (activation and KV scales); no when an activation-weighted scale
    search also needs each Linear's FP64 sum of squared inputs, whose rounding depends on the
    order the batches are added in."""
    return plan.options.scale_search != "mse"


def merged_stats(stats: Stats, share: Callable[[object], list],
                 all_max: Callable[[torch.Tensor], torch.Tensor]) -> Stats:
    """Every rank's maxima combined as every fact pass combines them (combined_max; maxima only:
    see splits_exactly). `share(value)` returns every rank's JSON `value`, `all_max(t)` the
    elementwise max of `t` over the ranks. A module no rank's tokens reached (an expert the router
    never chose) stays absent, as in one process."""
    parts = {"input": stats.inputs, "key": stats.keys, "value": stats.values}
    best = combined_max({f"{kind}:{m}": v for kind, found in parts.items() for m, v in found.items()}, share, all_max)
    merged: dict[str, dict[str, float]] = {kind: {} for kind in parts}
    for name, v in best.items():  # sorted by name, so each kind's modules in sorted order
        kind, _, module = name.partition(":")
        merged[kind][module] = v
    return Stats(inputs=merged["input"], keys=merged["key"], values=merged["value"],
                 expert_roles=dict(stats.expert_roles), channel_stats=False)


def save_facts(path: Path, facts: Facts) -> None:
    """Atomically: a run killed while writing leaves no cache, so --resume calibrates again."""
    tensors = {f"{m}:{k}": v.detach().cpu().contiguous() for m, found in facts.items() for k, v in found.items()
               if isinstance(v, torch.Tensor)}
    notes = {m: found["note"] for m, found in facts.items() if isinstance(found.get("note"), str)}
    write_atomic(path, save(tensors, metadata={"notes": json.dumps(notes, sort_keys=True)}))


def load_facts(path: Path) -> Facts:
    facts: Facts = {}
    for key, value in load_file(str(path)).items():
        module, _, field = key.rpartition(":")
        facts.setdefault(module, {})[field] = value
    with safe_open(str(path), "pt") as f:
        for module, note in json.loads((f.metadata() or {}).get("notes", "{}")).items():
            facts.setdefault(module, {})["note"] = note
    return facts


class _LayerProgress:
    """Reports each decoder layer to the job's progress: `calibrating: layer 3/32, 4.1 s/layer,
    128 samples, 31.2 samples/s`, most important first (a narrow bar keeps the head; a weight
    pass says `rounding (gptq): layer ...`)."""

    def __init__(self, report: Callable[[int, str], None], verb: str = "calibrating") -> None:
        self.report = report
        self.verb = verb
        self.start = time.monotonic()

    def __call__(self, done: int, total: int, samples: int) -> None:
        per_layer = (time.monotonic() - self.start) / done
        self.report(0, f"{self.verb}: layer {done}/{total}, {per_layer:.1f} s/layer, {samples} samples, "
                       f"{samples / max(per_layer, 1e-9):.1f} samples/s")
