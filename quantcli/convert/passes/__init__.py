"""Passes over the source before any shard is written (kinds.py): fact passes (`PASSES`,
fact_passes.py) learn small per-module values, ModuleFacts fields such as a fused group's amax
and calibrated activation / KV-cache scales; ranks combine them by max (kinds.combined_max)."""

from __future__ import annotations

from quantcli.convert.passes.fact_passes import CALIBRATION_CACHE, calibrated_scales, fused_group_amax
from quantcli.convert.passes.kinds import FactPass, Facts, combined_max
from quantcli.convert.reading import ModuleReader
from quantcli.convert.world import World
from quantcli.formats.facts import ModuleFacts

PASSES: tuple[FactPass, ...] = (fused_group_amax, calibrated_scales)

__all__ = ["CALIBRATION_CACHE", "PASSES", "FactPass", "Facts", "combined_max", "learn_facts"]


def learn_facts(reader: ModuleReader, passes: tuple[FactPass, ...] = PASSES,
                world: World | None = None) -> dict[str, ModuleFacts]:
    """Run every fact pass; a module no pass learned anything about has no entry (NO_FACTS)."""
    world = world or World()
    fields: dict[str, dict[str, object]] = {}
    for run_pass in passes:
        for module, found in run_pass(reader, world).items():
            fields.setdefault(module, {}).update(found)
    return {module: ModuleFacts(**found) for module, found in fields.items()}
