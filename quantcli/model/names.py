"""Which checkpoint tensors each parameter of the transformers model is built from, by
transformers' own loading rules.

A checkpoint names its tensors as its producer saved them; transformers 5 renames and converts
them on load (`conversion_mapping.py`): VLM prefixes (`model.layers` -> `model.language_model.layers`),
Mixtral's `block_sparse_moe` -> `mlp`, and per-expert Linears merged into 3-D parameters
(`experts.{e}.gate_proj` + `up_proj` -> `experts.gate_up_proj` [E, 2I, H]). quantcli quantizes,
calibrates and names scales by the checkpoint's modules, and runs the model's, so it maps the
two with the same functions `from_pretrained` uses (`get_model_conversion_mapping`,
`rename_source_key`, the converters' own `convert`), applied to headers only: no hand-written
table per architecture. A parameter no checkpoint tensor maps to is either tied to one that does
(`all_tied_weights_keys`: a tied `lm_head`) or missing.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import Callable, Collection

import torch

from quantcli.errors import QuantcliError

# transformers (optional: the calibrate extra) is imported inside the functions that call it.
Get = Callable[[str], torch.Tensor]
_ROW_ID = 2.0 ** 32  # marker value of row r of source i: i * _ROW_ID + r (exact in FP64)


@dataclass(frozen=True)
class Built:
    """How one model parameter is made: from `keys` (checkpoint tensors, in transformers' order),
    renamed (converter None) or through `converter`, whose run yields `group`'s parameters."""

    group: str  # the converter's first target: the name transformers collects the sources under
    keys: tuple[str, ...]
    patterns: tuple[str | None, ...]
    converter: object | None


def _transforms(model) -> tuple[list, list]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    conversions = get_model_conversion_mapping(model)
    return ([c for c in conversions if isinstance(c, WeightRenaming)],
            [c for c in conversions if isinstance(c, WeightConverter)])


class CheckpointMap:
    """Model parameter (and persistent buffer) names <-> checkpoint tensor names. `shape(name)`
    gives a checkpoint tensor's (logical) shape, for running converters on the meta device."""

    def __init__(self, model, names: Collection[str], shape: Callable[[str], tuple[int, ...]]):
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        self.model, self.names, self.shape = model, set(names), shape
        meta = model.state_dict()
        self.meta_shapes = {n: tuple(t.shape) for n, t in meta.items()}
        renamings, converters = _transforms(model)
        self._converters = {p: c for c in converters for p in c.source_patterns}
        collected: dict[str, list[tuple[str, str | None]]] = {}
        prefix = model.base_model_prefix
        for key in sorted(self.names, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if target not in meta and key in meta:  # transformers' own fallback: the name as it is
                target, pattern = rename_source_key(key, [], [], prefix, meta)
            if target in meta:
                collected.setdefault(target, []).append((key, pattern))
        self.built: dict[str, Built] = {}
        for group, sources in collected.items():
            keys, patterns = tuple(k for k, _ in sources), tuple(p for _, p in sources)
            converter = self._converters.get(patterns[0]) if patterns[0] is not None else None
            built = Built(group, keys, patterns, converter)
            for param in self._targets(built):
                self.built.setdefault(param, built)
        self.tied = {t: s for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items()
                     if t not in self.built}
        self.users: dict[str, list[str]] = {}  # checkpoint tensor -> the model parameters built from it
        for param, built in self.built.items():
            for key in built.keys:
                self.users.setdefault(key, []).append(param)

    def _targets(self, built: Built) -> list[str]:
        """The parameters `built` yields: itself when renamed, else what its converter returns
        when run on meta tensors of the sources' shapes."""
        if built.converter is None:
            return [built.group]
        try:
            out = self._convert(built, lambda k: torch.empty(self.shape(k), device="meta"))
        except Exception:  # an op that reads values: the first target is all that is known
            return [built.group]
        return [name for name in out if name in self.meta_shapes] or [built.group]

    def _convert(self, built: Built, get: Get) -> dict[str, torch.Tensor]:
        converter = deepcopy(built.converter)
        for key, pattern in zip(built.keys, built.patterns):
            converter.add_tensor(built.group, key, pattern, get(key))
        out = converter.convert(built.group, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def source_of(self, param: str) -> Built | None:
        """How `param` is built (a tied parameter: as the one it is tied to), or None."""
        return self.built.get(self.tied.get(param, param))

    def sources(self, param: str) -> list[str]:
        """The checkpoint tensors `param` is built from (empty: none)."""
        built = self.source_of(param)
        return list(built.keys) if built is not None else []

    def tensor(self, param: str, get: Get) -> torch.Tensor:
        """The model parameter `param` built from checkpoint tensors `get(name)` (dtype as stored)."""
        built = self.source_of(param)
        if built is None:
            raise QuantcliError(f"the checkpoint has no tensor for the model's {param} (nor one transformers "
                                f"renames or converts into it); it does not match its config.json architecture")
        if built.converter is None:
            return get(built.keys[0])
        return self._convert(built, get)[self.tied.get(param, param)]

    def linear_modules(self, path: str) -> list[str]:
        """The checkpoint modules whose input is the input of the model's Linear at `path`: the
        module its weight is stored as, or every one transformers fuses into it."""
        return [k[: -len(".weight")] if k.endswith(".weight") else k for k in self.sources(f"{path}.weight")]

    def module(self, path: str) -> str:
        """The checkpoint's name of the model module at `path` (an attention block, a Linear): where
        a checkpoint tensor of one of its parameters sits under the same relative name, else `path`."""
        for param in self.meta_shapes:
            if param.startswith(path + "."):
                rel = param[len(path):]
                for key in self.sources(param):
                    if key.endswith(rel):
                        return key[: -len(rel)]
        return path

    def expert_owner(self, param: str):
        """For a 3-D experts parameter: owner(e, start, count) -> [(checkpoint module, first,
        count)] over the rows (output features) start .. start + count of expert e; None when
        its converter cannot be traced (the experts' inputs then go unrecorded)."""
        built = self.source_of(param)
        if built is None:
            return None
        if built.converter is None:  # the checkpoint stores the stack itself: one module for every expert
            module = built.keys[0]

            def whole(e: int, start: int, count: int) -> list[tuple[str, int, int]]:
                return [(module, 0, count)]
            return whole
        owners = self._row_owners(built, param)
        if owners is None:
            return None
        modules = [k[: -len(".weight")] if k.endswith(".weight") else k for k in built.keys]

        def owner(e: int, start: int, count: int) -> list[tuple[str, int, int]]:
            ids = owners[e, start: start + count].tolist()
            runs: list[tuple[str, int, int]] = []
            for r, i in enumerate(ids):
                if runs and runs[-1][0] == modules[i] and runs[-1][1] + runs[-1][2] == r:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
                else:
                    runs.append((modules[i], r, 1))
            return runs
        return owner

    def _row_owners(self, built: Built, param: str) -> torch.Tensor | None:
        """[E, out]: the index into built.keys of the source of each output row of each expert,
        found by running the converter on markers (source i's row r holds i * 2^32 + r, its input
        dimension cut to 1, so the run costs one value per output row)."""
        shapes = {k: self.shape(k) for k in built.keys}
        if any(len(s) != 2 for s in shapes.values()):
            return None
        index = {k: i for i, k in enumerate(built.keys)}

        def marker(key: str) -> torch.Tensor:
            rows = torch.arange(shapes[key][0], dtype=torch.float64) + index[key] * _ROW_ID
            return rows[:, None]
        try:
            out = self._convert(built, marker)[param]
        except Exception:
            return None
        if out.dim() != 3 or 1 not in out.shape[1:]:
            return None
        ids = out.squeeze(2) if out.shape[2] == 1 else out.squeeze(1)
        return torch.div(ids, _ROW_ID, rounding_mode="floor").long()
