"""Passes over the source before any shard is written: each learns facts about modules
(quantcli/facts.py). Today one pass: the shared amax of each fused group. A new pass (activation
or KV-cache amax, a scale search) is one function here, added to PASSES, plus a ModuleFacts field."""

from __future__ import annotations

from typing import Callable

import torch

from ..facts import ModuleFacts
from .reading import ModuleReader

# A pass: what it learned, as {module: {ModuleFacts field: value}}.
Pass = Callable[[ModuleReader], dict[str, dict[str, object]]]


def fused_group_amax(reader: ModuleReader) -> dict[str, dict[str, object]]:
    """The max |w| over each fused group's members, streaming (one tensor at a time): one NVFP4
    global scale per group, as the engines that fuse the GEMM require (FORMATS A.3)."""
    from ..kernels import tensor_amax

    out: dict[str, dict[str, object]] = {}
    for members in reader.plan.fused_groups().values():
        amaxes = []
        for t in members:  # NaN/Inf is refused naming the tensor (not only its group)
            amaxes.append(tensor_amax(reader.weight(t), backend=reader.backend, name=t.name).cpu())
            reader.release(t)
        group_amax = torch.stack(amaxes).amax()
        out.update({t.module: {"group_amax": group_amax} for t in members})
    return out


def calibrated_scales(reader: ModuleReader) -> dict[str, dict[str, object]]:
    """With --calibration: static activation scales and KV-cache scales from running the source
    model layer by layer over the calibration data (quantcli/calibrate)."""
    from ..calibrate.run import calibrate

    return calibrate(reader.plan, reader.tensors, reader.device)


PASSES: tuple[Pass, ...] = (fused_group_amax, calibrated_scales)


def learn_facts(reader: ModuleReader, passes: tuple[Pass, ...] = PASSES) -> dict[str, ModuleFacts]:
    """Run every pass; a module no pass learned anything about has no entry (NO_FACTS)."""
    fields: dict[str, dict[str, object]] = {}
    for run_pass in passes:
        for module, found in run_pass(reader).items():
            fields.setdefault(module, {}).update(found)
    return {module: ModuleFacts(**found) for module, found in fields.items()}
