"""Passes over the source before any shard is written: each learns facts about modules
(quantcli/formats/facts.py). Two passes: the shared amax of each fused group, and with --calibration the
calibrated activation and KV-cache scales (calibrated_scales). A new pass is one function here, added to
PASSES, plus a ModuleFacts field."""

from __future__ import annotations

from typing import Callable

import torch

from quantcli.convert.reading import ModuleReader
from quantcli.convert.world import World
from quantcli.formats.facts import ModuleFacts
from quantcli.planning.plan import TensorPlan

# A pass: what it learned, as {module: {ModuleFacts field: value}}, the same on every rank.
Pass = Callable[[ModuleReader, World], dict[str, dict[str, object]]]


def fused_group_amax(reader: ModuleReader, world: World) -> dict[str, dict[str, object]]:
    """The max |w| over each fused group's members, streaming (one tensor at a time): one NVFP4
    global scale per group, as the engines that fuse the GEMM require (docs/formats.md,
    "Fused groups share one global scale"). With several
    ranks each reads the members in its own shards and the partial maxima meet in all_reduce(MAX)
    (a max is exact, so the result is the one-process value bit for bit)."""
    groups = list(reader.plan.fused_groups().values())
    sizes: dict[str, int] = {}
    for t in reader.plan.tensors:
        sizes[t.shard] = sizes.get(t.shard, 0) + t.bytes_in
    mine = world.mine(sizes)
    partial = world.settle(lambda: _partial_group_amax(reader, groups, mine))
    total = world.all_max(partial)
    return {t.module: {"group_amax": total[i].clone()} for i, members in enumerate(groups) for t in members}


def _partial_group_amax(reader: ModuleReader, groups: list[list[TensorPlan]], shards: set[str]) -> torch.Tensor:
    from quantcli.kernels import tensor_amax

    out = torch.zeros(len(groups), dtype=torch.float32)
    for i, members in enumerate(groups):
        amaxes = []
        for t in members:  # NaN/Inf is refused naming the tensor (not only its group)
            if t.shard in shards:
                amaxes.append(tensor_amax(reader.weight(t), backend=reader.backend, name=t.name).cpu())
                reader.release(t)
        if amaxes:
            out[i] = torch.stack(amaxes).amax()
    return out


# What the calibration pass learned, kept in the staging folder so that --resume does not
# calibrate again (removed by finalize, never part of the output).
CALIBRATION_CACHE = ".quantcli-calibration.safetensors"


def calibrated_scales(reader: ModuleReader, world: World) -> dict[str, dict[str, object]]:
    """With --calibration: static activation scales and KV-cache scales from running the source
    model layer by layer over the calibration data (quantcli/calibrate).

    Several ranks split the batches (each runs every layer on its share) and combine their maxima
    with all_reduce(MAX), which is exact: the one-process values bit for bit wherever a batch is
    computed as one process computes it. On the CPU the ranks get fewer threads each, and torch's
    CPU matmul rounding depends on the thread count, so there the last bits can differ (as they
    did when rank 0 calibrated alone with its share of the cores). An activation-weighted scale search
    also needs FP64 sums whose rounding a split would change, so there rank 0 calibrates alone.
    Either way rank 0 keeps the result in the staging folder, which --resume reads on any rank."""
    plan, cache = reader.plan, _cache(reader)
    if plan.options.calibration is None:
        return {}
    from quantcli.calibrate.run import calibrate, collect_stats, load_facts, merged_stats, save_facts, splits_exactly
    from quantcli.calibrate.scales import scale_facts

    if world.size == 1:
        return calibrate(plan, reader.tensors, reader.device, cache, reader.progress)
    if cache is None:
        raise RuntimeError("internal: calibration on several ranks needs the staging folder")
    if world.settle_all(lambda: cache.is_file() if world.lead else None)[0]:
        return load_facts(cache)  # the staging folder is shared (checked before any shard)
    if not splits_exactly(plan):
        world.settle(lambda: calibrate(plan, reader.tensors, reader.device, cache, reader.progress)
                     if world.lead else None)
        return load_facts(cache)
    stats = world.settle(lambda: collect_stats(plan, reader.tensors, reader.device, reader.progress,
                                               part=(world.rank, world.size)))
    merged = merged_stats(stats, lambda value: world.settle_all(lambda: value), world.all_max)
    facts = world.settle(lambda: scale_facts(plan, merged))
    if world.lead:
        save_facts(cache, facts)
    return facts


def _cache(reader: ModuleReader):
    return reader.stage / CALIBRATION_CACHE if reader.stage is not None else None


PASSES: tuple[Pass, ...] = (fused_group_amax, calibrated_scales)


def learn_facts(reader: ModuleReader, passes: tuple[Pass, ...] = PASSES,
                world: World | None = None) -> dict[str, ModuleFacts]:
    """Run every pass; a module no pass learned anything about has no entry (NO_FACTS)."""
    world = world or World()
    fields: dict[str, dict[str, object]] = {}
    for run_pass in passes:
        for module, found in run_pass(reader, world).items():
            fields.setdefault(module, {}).update(found)
    return {module: ModuleFacts(**found) for module, found in fields.items()}
