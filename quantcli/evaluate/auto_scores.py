"""convert --auto's scores and the whole choice: candidates and budget (planning/auto.py), each
module scored per candidate on the calibration data, the exact solve, the options that spell it out.

A module's score for a candidate is the model output error with that module alone quantized in
that recipe, every other weight the source's: the one-walk sensitivity of `eval --sensitivity`
(sensitivity.walk_sensitivity), one walk per candidate over every module it can take, rounded
to nearest (with --rounding gptq the written modules are then GPTQ-rounded, in their chosen
format). KL(source || quantized) mean over the next-token distributions for a causal LM,
1 - the mean pooled-embedding cosine for an encoder. Input quantization the layout declares for
the recipe (dynamic activations) is applied as eval applies it; --activations static and the KV
cache are not part of the score."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert.device import resolve_device
from quantcli.errors import QuantcliError
from quantcli.evaluate.declared import activation_steps
from quantcli.evaluate.engine import side_map
from quantcli.evaluate.metrics import Encoder, pooling_config
from quantcli.evaluate.sensitivity import module_paths, walk_sensitivity
from quantcli.evaluate.sides import RecipeSide, Side
from quantcli.formats.detect import detect
from quantcli.formats.experts import every_layers_experts, experts_module
from quantcli.formats.patterns import matches_any
from quantcli.model.layers import batches
from quantcli.model.samples import token_ids
from quantcli.model.stack import CAUSAL, ENCODER, build_stack, encoder_positions, text_config
from quantcli.planning import auto
from quantcli.planning.conversion import plan_conversion
from quantcli.planning.plan import Options, make_plan
from quantcli.recipes import get_recipe

Say = Callable[[str], None]


def choose_formats(source, opts: Options, device: str = "auto", say: Say | None = None) -> Options:
    """`opts` with its --auto request replaced by the choice (exact-name overrides and ignores).
    Every refusal that needs no data (candidates, layout, budget) comes before the scoring walk."""
    request = opts.auto
    found = detect(source)
    if found is not None and found.modules:
        raise QuantcliError(f"--auto: {source.label} is already quantized ({found.layout.name}); --auto chooses "
                            f"formats for a dense source")
    layout = auto.auto_layout(request, opts.layout)
    recipes = auto.candidate_recipes(request, layout, opts)
    base = _base_plan(source, opts, layout)
    groups, left_dense = auto.auto_groups(base, request, layout, recipes)
    if not groups:
        raise QuantcliError(f"--auto {','.join(request.candidates)}: no module fits any candidate (see `--dry-run "
                            f"--recipe R` for each recipe's reasons)")
    budget = auto.budget_bits(request, groups, base, left_dense)
    auto.check_feasible(request, groups, budget)
    scores = score_modules(source, opts, groups, layout.name, device, say, left_dense)
    choice = auto.choose(request, layout.name, groups, scores, budget, left_dense)
    return auto.chosen_options(opts, choice)


def _base_plan(source, opts: Options, layout):
    """The plan listing the quantizable modules. A 3-D expert stack (gpt-oss, Llama 4) it cannot
    name is refused as --auto's limit, not as the internal base recipe's (which the user never named)."""
    try:
        return make_plan(source, auto.base_options(opts, layout))
    except QuantcliError:
        for shard in source.shards:
            for name, info in sorted(source.headers[shard].tensors.items()):
                if len(info.shape) == 3 and "experts" in name and not matches_any(opts.ignore, experts_module(name)):
                    raise QuantcliError(
                        f"--auto: {name} is a 3-D expert stack, and --auto chooses formats for 2-D Linears only; "
                        f"--ignore '{every_layers_experts(name)}' keeps the stacks dense, or convert with --recipe "
                        f"mxfp4 --layout gpt-oss") from None
        raise


def choose_once(world, opts: Options, choose: Callable[[Options], Options]) -> Options:
    """--auto's choice made once for all the ranks of a conversion: rank 0 keeps the one it made
    before the ranks started (one process, or the --workers launcher: it becomes rank 0), or
    makes it now (`choose`: under torchrun every rank starts alike); the other ranks receive it
    as JSON (world.settle_all: nothing pickled) and spell it out as rank 0 did, without scoring."""
    if opts.auto is None and opts.auto_choice is None:  # no --auto
        return opts
    if world.size == 1:
        return opts if opts.auto is None else choose(opts)
    mine: list[Options] = []

    def lead() -> dict:
        mine.append(opts if opts.auto is None else choose(opts))
        return auto.choice_json(mine[0].auto_choice)

    doc = world.settle_all(lambda: lead() if world.lead else None)[0]
    return mine[0] if world.lead else auto.chosen_options(opts, auto.choice_from_json(doc))


def score_modules(source, opts: Options, groups: list, layout: str, device: str = "auto",
                  say: Say | None = None, left_dense: list[str] = ()) -> dict[str, dict[str, float]]:
    """{module: {candidate: output error with it alone quantized}} for every group's options
    (`left_dense`: the modules of groups with none, kept dense in every walk)."""
    dev = resolve_device(device)
    cal = opts.calibration
    every = [m for g in groups for m in g.modules]
    scores: dict[str, dict[str, float]] = {m: {} for m in every}
    with CheckpointTensors(source) as rt:
        ref = Side(f"{source.label} (source)", source, rt, dev)
        stack = build_stack(source.config, ref.names, ref.shape, ref.label)
        limit = encoder_positions(text_config(source.config)) if stack.kind == ENCODER else None
        ids = token_ids(replace(cal, seq_len=min(cal.seq_len, limit)) if limit else cal, source.root)
        if not ids:
            raise QuantcliError(f"--calibration {cal.data}: every sample tokenized to nothing")
        input_batches = batches(ids, cal.batch)
        for candidate in (c for c in opts.auto.quantizing if any(c in dict(g.costs) for g in groups)):
            modules = [m for g in groups if candidate in dict(g.costs) for m in g.modules]
            if say is not None:
                say(f"auto: scoring {len(modules)} modules in {candidate} on {len(ids)} calibration samples")
            scored = set(modules)
            found = _score_one(source, opts, stack, ref, input_batches, dev, candidate, layout,
                               [*(m for m in every if m not in scored), *left_dense])
            for g in (g for g in groups if candidate in dict(g.costs)):
                for m in g.modules:
                    scores[m][candidate] = _score_of(m, g, found)
    return scores


def _score_of(module: str, group, found: dict[str, float]) -> float:
    """A module's own score; an MoE layer's experts run as one block, swapped whole: that block's
    score split evenly over the group's modules (their sum is the block's)."""
    if module in found:
        return found[module]
    if group.key in found:
        return found[group.key] / len(group.modules)
    raise QuantcliError(f"--auto: {module} is outside the model's layers, where the scoring walk runs; --ignore it")


def _score_one(source, opts: Options, stack, ref, input_batches: list, device: torch.device, candidate: str,
               layout: str, others: list[str]) -> dict[str, float]:
    """One sensitivity walk: every module `candidate` can take, each alone quantized in it."""
    recipe = get_recipe(candidate)
    plan = plan_conversion(source, Options(recipe=candidate, layout=layout, ignore=[*opts.ignore, *others],
                                           targets=list(opts.targets),
                                           scale_rule=opts.scale_rule if recipe.scale_rules else None,
                                           scale_search=opts.scale_search if recipe.searches else "none"))
    with CheckpointTensors(source) as qt:
        quant = RecipeSide(f"{source.label} ({candidate}, scored)", source, qt, device, plan)
        scales = quant.calibrated()
        steps = activation_steps(quant.layout, quant.config, quant.modules, scales, quant.label) if scales else {}
        names = side_map(stack, quant)
        chosen: dict[int, list[str]] = {}
        for i, layer in enumerate(stack.layers):
            inside = [m for m in module_paths(layer, stack.layer_prefix(i), names)  # a Linear, or an experts block
                      if m in quant.modules or any(q.startswith(m + ".") for q in quant.modules)]
            if inside:
                chosen[i] = sorted(inside)
        pooled = None if stack.kind == CAUSAL else Encoder(*pooling_config([source.root]), sides=(ref, quant))
        sums = walk_sensitivity(stack, ref, quant, input_batches, device, steps, chosen, pooled)
    return {m: s.score().output_error for m, s in sums.items()}
