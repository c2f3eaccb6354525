"""Passes over the source before any shard is written, of two kinds (kinds.py):

- fact passes (`PASSES`, fact_passes.py) learn small per-module values, ModuleFacts fields such
  as a fused group's amax and calibrated activation / KV-cache scales; ranks combine by max;
- weight passes (`WEIGHT_PASSES`, run by weight_walk.py) produce the quantized tensors
  themselves, layer by layer on the calibration data, from per-layer statistics summed in a
  fixed order (ordered_sum.py); the shard job writes their staged products as they are.

The job runs every fact pass, then the one weight pass that takes any planned tensor, if any.
"""

from __future__ import annotations

from quantcli.convert.passes.fact_passes import CALIBRATION_CACHE, calibrated_scales, fused_group_amax
from quantcli.convert.passes.gptq_pass import GPTQ_PASS
from quantcli.convert.passes.kinds import FactPass, Facts, ModuleWork, WeightPass, combined_max
from quantcli.convert.passes.weight_walk import run_weight_pass
from quantcli.convert.reading import ModuleReader
from quantcli.convert.staged import StagedWeights, staged_by
from quantcli.convert.world import World
from quantcli.errors import CheckpointError, QuantcliError
from quantcli.formats.facts import ModuleFacts

PASSES: tuple[FactPass, ...] = (fused_group_amax, calibrated_scales)

# The weight passes a conversion may run; the one whose `takes` accepts a planned tensor runs:
# data-aware rounding (`--rounding gptq`), its `takes` reading the plan's options.
WEIGHT_PASSES: tuple[WeightPass, ...] = (GPTQ_PASS,)

__all__ = ["CALIBRATION_CACHE", "PASSES", "WEIGHT_PASSES", "FactPass", "Facts", "ModuleWork", "WeightPass",
           "combined_max", "learn_facts", "learn_weights"]


def learn_facts(reader: ModuleReader, passes: tuple[FactPass, ...] = PASSES,
                world: World | None = None) -> dict[str, ModuleFacts]:
    """Run every fact pass; a module no pass learned anything about has no entry (NO_FACTS)."""
    world = world or World()
    fields: dict[str, dict[str, object]] = {}
    for run_pass in passes:
        for module, learned in run_pass(reader, world).items():
            fields.setdefault(module, {}).update(learned)
    return {module: ModuleFacts(**values) for module, values in fields.items()}


def learn_weights(reader: ModuleReader, facts: dict[str, ModuleFacts], world: World | None = None,
                  passes: tuple[WeightPass, ...] | None = None) -> StagedWeights | None:
    """Run the weight pass that takes any planned tensor (None: no tensor is taken; the shard job
    quantizes every one itself). `facts` are the fact passes' findings, which it rounds with."""
    world = world or World()
    plan = reader.plan
    passes = WEIGHT_PASSES if passes is None else passes
    chosen = [p for p in passes if any(t.action == "quantize" and p.takes(plan, t) for t in plan.tensors)]
    if len(chosen) > 1:
        raise QuantcliError(f"weight passes {', '.join(p.name for p in chosen)} would each round the same "
                            f"checkpoint; choose one")
    if reader.stage is not None:  # a resumed folder holds another pass's products (or none is chosen now)
        world.lead_alone(lambda: _check_staged_by(reader, chosen[0].name if chosen else None))
    return run_weight_pass(chosen[0], reader, facts, world) if chosen else None


def _check_staged_by(reader: ModuleReader, name: str | None) -> None:
    staged_pass = staged_by(reader.stage)
    if staged_pass is not None and staged_pass != name:
        now = f"weight pass {name!r}" if name else "no weight pass"
        raise CheckpointError(f"{reader.stage}: holds layers rounded by weight pass {staged_pass!r}, but this run uses "
                              f"{now}; rerun with --overwrite to start over")
