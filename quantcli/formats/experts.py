"""3-D MoE expert stacks (gpt-oss's `mlp.experts.gate_up_proj`): which MoE layer a stack belongs
to, the name the engines look up in an exclusion list for a fused MoE layer."""

from __future__ import annotations

import re

from quantcli.formats.layouts import module_of

EXPERTS_MODULE = re.compile(r"^(.*\.experts)\.")


def every_layers_experts(name: str) -> str:
    """`model.layers.0.mlp.experts.down_proj` -> `model.layers.*.mlp.experts`, the --ignore that
    keeps every layer's expert stacks dense."""
    return re.sub(r"\.\d+\.", ".*.", experts_module(name))


def experts_module(name: str) -> str:
    """The MoE layer a 3-D expert tensor belongs to (`model.layers.0.mlp.experts.gate_up_proj` ->
    `model.layers.0.mlp.experts`): the name vLLM and SGLang check an exclusion list for."""
    match = EXPERTS_MODULE.match(name)
    return match.group(1) if match else module_of(name)
