"""Planning rules for fused projections (formats/fused.py names the groups): one precision per
group, and no group of one member."""

from __future__ import annotations

from dataclasses import replace

from quantcli.checkpoint.safetensors_io import OutSpec
from quantcli.errors import QuantcliError
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import module_of
from quantcli.formats.patterns import FUSED_SHARDS
from quantcli.planning.actions import Action


def one_precision_per_fused_group(tensors: list, exclude, warnings: list[str],
                                  reasons: dict[str, str] | None = None) -> None:
    """Engines run q/k/v, gate/up, w1/w3 as one GEMM of one precision (vLLM refuses a fused layer
    whose parts differ). A group with a member left dense is left dense whole, said in a warning
    that gives the member's reason (`reasons`: module -> why it is dense, e.g. '--ignore');
    a group given two recipes has no right answer and is refused. `exclude(module, reason)`
    records a member taken back out of quantization."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        module = t.module or (module_of(t.name) if t.name.endswith(".weight") and len(t.shape) == 2 else None)
        group = fused_group_of(module) if module else None
        if group is not None:
            groups.setdefault(group, []).append(i)
    for group, members in sorted(groups.items()):
        recipes = {tensors[i].recipe for i in members}
        if len(recipes) == 1:
            continue
        if None not in recipes:
            raise QuantcliError(f"{group}: engines fuse these into one GEMM of one precision, but the options give "
                                f"them {', '.join(sorted(recipes))}; give the whole group one recipe")
        dense_modules = sorted(module_of(tensors[i].name) for i in members if tensors[i].recipe is None)
        dense = [m.rsplit(".", 1)[-1] for m in dense_modules]  # named in the members' exclusion reason
        for i in members:
            t = tensors[i]
            if t.recipe is not None:
                tensors[i] = replace(t, recipe=None, module=None, transpose=False, fused_group=None, action=Action.COPY,
                                     outputs=(OutSpec(t.name, t.dtype, t.shape),))
                exclude(t.module, f"fused with {', '.join(dense)}, which stay dense")
        warnings.append(f"{group}: left dense as a whole because {_why_dense(dense_modules, reasons or {})}, "
                        f"and engines run the group as one GEMM of one precision")


def _why_dense(modules: list[str], reasons: dict[str, str]) -> str:
    """'you asked to ignore q_proj (--ignore; ...)', or 'q_proj cannot be quantized (its reason)'."""
    leaves = [m.rsplit(".", 1)[-1] for m in modules]
    given = sorted({reasons.get(m, "") for m in modules} - {""})
    if given == ["--ignore"]:
        fused = next((f for f, shards in FUSED_SHARDS.items() if leaves[0] in shards), None)
        whole = f"; --ignore {fused} names the whole group" if fused else ""
        return f"you asked to ignore {', '.join(leaves)} (--ignore{whole})"
    return f"{', '.join(leaves)} cannot be quantized" + (f" ({'; '.join(given)})" if given else "")


def drop_single_member_groups(tensors: list) -> list:
    """Fused groups only matter when they have two or more quantized members."""
    counts: dict[str, int] = {}
    for t in tensors:
        if t.fused_group:
            counts[t.fused_group] = counts.get(t.fused_group, 0) + 1
    return [t if not t.fused_group or counts[t.fused_group] > 1 else replace(t, fused_group=None) for t in tensors]
