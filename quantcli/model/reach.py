"""What a layer walk of a checkpoint will reach, known before any work from the model built on
the meta device (model/stack.py): the planner's view of the walk (which checkpoint tensors each
layer is built from, the output head, the attention of each layer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from quantcli.formats.fused import FUSED_QKV
from quantcli.model.stack import CAUSAL, attention_path, build_stack, cache_kwarg


@dataclass(frozen=True)
class Reach:
    kind: str  # stack.CAUSAL | stack.ENCODER
    model_class: str
    layers: int
    layer_path: str  # the model's path of its layers (model.language_model.layers, transformer.h, ...)
    tensors: dict[str, int] = field(default_factory=dict)  # checkpoint tensor -> the layer it is in
    head: tuple[str, ...] = ()  # checkpoint tensors of the output head (a causal LM's), tied ones included
    attentions: dict[str, int] = field(default_factory=dict)  # checkpoint attention module -> its layer
    # checkpoint attention module -> the modules its KV-cache scales sit by: (k_proj, v_proj), or the
    # fused q/k/v Linear twice; absent for an attention that has neither (MLA's compressed latent)
    kv_modules: dict[str, tuple[str, str]] = field(default_factory=dict)
    latent_attentions: frozenset[str] = frozenset()  # MLA attentions (kv_a_proj_with_mqa + kv_b_proj)
    vocab_size: int | None = None
    model_config: object = None  # transformers' config of the model (its text config's limits)

    def layer_of(self, name: str) -> int | None:
        return self.tensors.get(name)


def walk_reach(config: dict, names, shape: Callable[[str], tuple[int, ...]], label: str) -> Reach:
    """The Reach of the model of `config` with checkpoint tensors `names`; a one-line refusal
    for a model no walk can run (model/stack.py, model/build.py)."""
    stack = build_stack(config, names, shape, label)
    tensors: dict[str, int] = {}
    attentions: dict[str, int] = {}
    kv_modules: dict[str, tuple[str, str]] = {}
    latent: set[str] = set()
    for i, layer in enumerate(stack.layers):
        prefix = stack.layer_prefix(i)
        for n in layer.state_dict():
            for src in stack.names.sources(prefix + n):
                tensors.setdefault(src, i)
        attention = attention_path(layer, prefix) if stack.kind == CAUSAL and cache_kwarg(layer) else None
        if attention is not None:
            attentions[stack.names.module(attention)] = i
            module = layer.get_submodule(attention[len(prefix):])
            kv = _kv_modules(stack, module, attention)
            if kv is not None:
                kv_modules[stack.names.module(attention)] = kv
            if hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj"):
                latent.add(stack.names.module(attention))
    head = stack.head()
    head_tensors = tuple(src for n in (stack.model.get_submodule(head).state_dict() if head else {})
                         for src in stack.names.sources(f"{head}.{n}"))
    return Reach(stack.kind, type(stack.model).__name__, len(stack.layers), stack.layer_path, tensors, head_tensors,
                 attentions, kv_modules, frozenset(latent), stack.vocab_size, stack.config)


def _kv_modules(stack, attention, path: str) -> tuple[str, str] | None:
    """The checkpoint modules an attention's KV-cache scales go by (Reach.kv_modules)."""
    linears = {sub: stack.names.linear_modules(f"{path}.{sub}") for sub, m in attention.named_children()
               if isinstance(m, torch.nn.Linear)}
    if linears.get("k_proj") and linears.get("v_proj"):
        return linears["k_proj"][0], linears["v_proj"][0]
    fused = next((mods[0] for sub, mods in linears.items() if sub in FUSED_QKV and mods), None)
    return (fused, fused) if fused else None
