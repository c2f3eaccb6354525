"""fp8 layout (`quant_method: fp8`, DeepSeek-V3 style): vLLM, SGLang, transformers FineGrainedFP8.

    fp8        weight F8_E4M3 [N, K], weight_scale F32 [] (per tensor, multiply)
    fp8-block  weight F8_E4M3 [N, K], weight_scale_inv F32 [ceil(N/128), ceil(K/128)]
               (multiply, despite the name: "inv" is the inverse of the 448/amax multiplier)
    mxfp8      weight F8_E4M3 [N, K], weight_scale_inv U8 E8M0 [N, K/32]
               (SGLang's `quant_method: mxfp8`, `weight_block_size: [1, 32]`)
Config: {quant_method, activation_scheme: dynamic, fmt: e4m3, weight_block_size,
ignored_layers, modules_to_not_convert} (vLLM reads the first list, transformers the second).
"""

from __future__ import annotations

from typing import Mapping

import torch

from quantcli.errors import LayoutError
from quantcli.recipes import QuantizedTensor, Recipe, get_recipe

from .base import DiskTensor, GetTensor, Layout, as_codes, require_8bit

SCALE_NAME = {"fp8": "weight_scale", "fp8-block": "weight_scale_inv", "mxfp8": "weight_scale_inv"}


class Fp8Layout(Layout):
    name = "fp8"
    consumers = "vLLM, SGLang, transformers (FineGrainedFP8)"
    recipes = ("fp8", "fp8-block", "mxfp8")
    default_scale_rule = "rceil"
    exclusion_key = "ignored_layers"

    def to_disk(self, module: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        recipe = get_recipe(q.recipe)
        scale = q.scale.to(torch.float32).reshape(()) if q.recipe == "fp8" else q.scale.contiguous()
        return {f"{module}.weight": as_codes(q.codes, recipe), f"{module}.{SCALE_NAME[q.recipe]}": scale}

    def from_disk(self, module: str, recipe: Recipe, get: GetTensor, names: Mapping[str, object]) -> QuantizedTensor:
        codes = require_8bit(f"{module}.weight", get(f"{module}.weight"))
        name = f"{module}.{SCALE_NAME[recipe.name]}"
        scale = get(name)
        if recipe.name == "mxfp8":
            scale = require_8bit(name, scale)
        elif recipe.name == "fp8":
            scale = scale.to(torch.float32).reshape(())
        else:
            scale = scale.to(torch.float32)
        return QuantizedTensor(recipe.name, tuple(codes.shape), codes, scale, None, recipe.scale_rule)

    def describe(self, module: str, recipe: Recipe) -> list[DiskTensor]:
        enc = "e8m0_bias127" if recipe.name == "mxfp8" else "f32"
        return [DiskTensor(f"{module}.weight", "codes", "e4m3fn", None),
                DiskTensor(f"{module}.{SCALE_NAME[recipe.name]}", "block_scale", enc, "multiply")]

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        qc = config.get("quantization_config") or {}
        return qc.get("quant_method") in ("fp8", "mxfp8")

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        qc = config.get("quantization_config") or {}
        if f"{module}.weight_scale_inv" in names:
            return "mxfp8" if qc.get("quant_method") == "mxfp8" else "fp8-block"
        if f"{module}.weight_scale" in names:
            return "fp8"
        return None

    def quantization_config(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        used = [r for r, mods in groups.items() if mods]
        if len(used) > 1:
            raise LayoutError(f"--layout fp8 holds one recipe per checkpoint, got {', '.join(used)}; "
                              f"use --layout compressed-tensors for mixed precision")
        recipe = used[0] if used else "fp8-block"
        cfg = {"quant_method": "mxfp8" if recipe == "mxfp8" else "fp8", "activation_scheme": "dynamic",
               "fmt": "e4m3", "ignored_layers": excluded, "modules_to_not_convert": excluded}
        if recipe == "fp8-block":
            cfg["weight_block_size"] = [128, 128]
        elif recipe == "mxfp8":
            cfg["weight_block_size"] = [1, 32]
        return cfg
