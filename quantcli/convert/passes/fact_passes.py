"""The fact passes (kinds.py): each returns {module: {ModuleFacts field: value}}, the same on
every rank, its ranks' partials combined by max. A new one is a function here, added to `PASSES`
in passes/__init__.py, plus its ModuleFacts field."""

from __future__ import annotations

import torch

from quantcli.calibrate.scales import needs_walk, scale_facts
from quantcli.convert.passes.kinds import Facts, combined_max
from quantcli.convert.reading import ModuleReader
from quantcli.convert.world import World
from quantcli.kernels import tensor_amax
from quantcli.planning.plan import TensorPlan

# calibrate/run.py imports convert/passes/kinds.py: it is imported where the calibration pass runs,
# which breaks the import cycle (the only import inside a function here).


def fused_group_amax(reader: ModuleReader, world: World) -> Facts:
    """The max |w| over each fused group's members, streaming (one tensor at a time): one NVFP4
    global scale per group, as the engines that fuse the GEMM require (docs/formats.md,
    "Fused groups share one global scale"). With
    several ranks each reads the members in its own shards and the partial maxima are combined
    by max (exact, so the result is the one-process value bit for bit)."""
    groups = reader.plan.fused_groups()
    sizes: dict[str, int] = {}
    for t in reader.plan.tensors:
        sizes[t.shard] = sizes.get(t.shard, 0) + t.bytes_in
    mine = world.mine(sizes)
    partial = world.settle(lambda: _partial_group_amax(reader, groups, mine))
    total = combined_max(partial, lambda value: world.settle_all(lambda: value), world.all_max)
    # FP32 -> FP64 (the combination) -> FP32 is exact: the amax of the weights, bit for bit
    return {t.module: {"group_amax": torch.tensor(total[g], dtype=torch.float32)}
            for g, members in groups.items() for t in members}


def _partial_group_amax(reader: ModuleReader, groups: dict[str, list[TensorPlan]],
                        shards: set[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for g, members in groups.items():
        amaxes = []
        for t in members:  # NaN/Inf is refused naming the tensor (not only its group)
            if t.shard in shards:
                amaxes.append(tensor_amax(reader.weight(t), backend=reader.backend, name=t.name).cpu())
                reader.release(t)
        if amaxes:
            out[g] = float(torch.stack(amaxes).amax())
    return out


# What the calibration pass learned, kept in the staging folder so that --resume does not
# calibrate again (removed by finalize, never part of the output).
CALIBRATION_CACHE = ".quantcli-calibration.safetensors"


def calibrated_scales(reader: ModuleReader, world: World) -> Facts:
    """With --calibration: static activation scales and KV-cache scales from running the source
    model layer by layer over the calibration data (quantcli/calibrate).

    Several ranks split the batches (each runs every layer on its share) and combine their maxima
    as every fact pass does (kinds.combined_max: all_reduce(MAX)), which is exact: the one-process
    values bit for bit wherever a batch is computed as one process computes it. On the CPU the
    ranks get fewer threads each, and torch's CPU matmul rounding depends on the thread count:
    small batches run on one thread in every process (model/threads.py), so they agree; above
    that size the last bits can differ. An activation-weighted scale search also needs FP64 sums
    whose rounding a split would change, so there rank 0 calibrates alone.
    Either way rank 0 keeps the result in the staging folder, which --resume reads on any rank.
    (The walk and its observer, model/layers.py and model/inputs.py, are the ones weight passes
    run on.)"""
    plan, cache = reader.plan, _cache(reader)
    if not needs_walk(plan):  # --rounding gptq alone: its weight pass walks the layers itself
        return {}
    from quantcli.calibrate.run import calibrate, collect_stats, load_facts, merged_stats, save_facts, splits_exactly


    if world.size == 1:
        return calibrate(plan, reader.tensors, reader.device, cache, reader.progress)
    if cache is None:
        raise RuntimeError("internal: calibration on several ranks needs the staging folder")
    if world.from_lead(cache.is_file):
        return load_facts(cache)  # the staging folder is shared (checked before any shard)
    if not splits_exactly(plan):
        world.lead_alone(lambda: calibrate(plan, reader.tensors, reader.device, cache, reader.progress))
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
