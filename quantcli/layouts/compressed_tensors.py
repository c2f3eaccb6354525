"""compressed-tensors layout (`quant_method: compressed-tensors`): vLLM, SGLang, transformers.

    nvfp4        weight_packed U8 [N, K/2], weight_scale F8_E4M3 [N, K/16],
                 weight_global_scale F32 [1] = 1 / weight_scale_2 (divide)   nvfp4-pack-quantized
    mxfp4        weight_packed U8 [N, K/2], weight_scale U8 E8M0 [N, K/32]     mxfp4-pack-quantized
    mxfp8        weight F8_E4M3 [N, K], weight_scale U8 E8M0 [N, K/32]         mxfp8-quantized
    fp8          weight F8_E4M3, weight_scale F32 [1]                           float-quantized
    fp8-channel  weight F8_E4M3, weight_scale F32 [N, 1]                        float-quantized
    fp8-block    weight F8_E4M3, weight_scale F32 [ceil(N/128), ceil(K/128)]    float-quantized
FP8-family scales are written in FP32 (the producer writes the dense dtype, usually BF16, which
would round the scale the codes were computed with); consumers cast on load. Activations of
the fp8 recipes are declared dynamic (per token / per 128-group), which needs no calibration.
"""

from __future__ import annotations

from typing import Mapping

import torch

from quantcli.recipes import QuantizedTensor, Recipe, get_recipe

from .base import DiskTensor, GetTensor, Layout, as_codes, logical_k, require_8bit

FORMAT = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "mxfp8": "mxfp8-quantized",
          "fp8": "float-quantized", "fp8-channel": "float-quantized", "fp8-block": "float-quantized"}
PACKED = ("nvfp4", "mxfp4")

_FLOAT = {"type": "float", "symmetric": True, "dynamic": False}
WEIGHTS = {
    "nvfp4": {"num_bits": 4, **_FLOAT, "strategy": "tensor_group", "group_size": 16,
              "scale_dtype": "torch.float8_e4m3fn"},
    "mxfp4": {"num_bits": 4, **_FLOAT, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
    "mxfp8": {"num_bits": 8, **_FLOAT, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
    "fp8": {"num_bits": 8, **_FLOAT, "strategy": "tensor"},
    "fp8-channel": {"num_bits": 8, **_FLOAT, "strategy": "channel"},
    "fp8-block": {"num_bits": 8, **_FLOAT, "strategy": "block", "block_structure": [128, 128]},
}
_DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
INPUTS = {
    "fp8": {**_DYNAMIC, "strategy": "token"},
    "fp8-channel": {**_DYNAMIC, "strategy": "token"},
    "fp8-block": {**_DYNAMIC, "strategy": "group", "group_size": 128},
}


class CompressedTensorsLayout(Layout):
    name = "compressed-tensors"
    consumers = "vLLM, SGLang, transformers"
    recipes = ("nvfp4", "mxfp4", "mxfp8", "fp8", "fp8-channel", "fp8-block")
    default_scale_rule = "even"
    exclusion_key = "ignore"

    def to_disk(self, module: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        recipe = get_recipe(q.recipe)
        codes_name = "weight_packed" if q.recipe in PACKED else "weight"
        out = {f"{module}.{codes_name}": as_codes(q.codes, recipe)}
        if q.recipe == "nvfp4":
            out[f"{module}.weight_scale"] = q.scale.contiguous().view(torch.float8_e4m3fn)
            # The divisor convention: 1 / weight_scale_2, one FP32 division.
            out[f"{module}.weight_global_scale"] = (1.0 / q.global_scale.to(torch.float32)).reshape(1)
        elif q.recipe == "fp8":
            out[f"{module}.weight_scale"] = q.scale.to(torch.float32).reshape(1)
        elif q.recipe == "fp8-channel":
            out[f"{module}.weight_scale"] = q.scale.to(torch.float32).reshape(*q.scale.shape, 1).contiguous()
        else:
            out[f"{module}.weight_scale"] = q.scale.contiguous()
        return out

    def from_disk(self, module: str, recipe: Recipe, get: GetTensor, names: Mapping[str, object]) -> QuantizedTensor:
        codes_name = f"{module}.weight_packed" if recipe.name in PACKED else f"{module}.weight"
        codes = require_8bit(codes_name, get(codes_name))
        shape = (*codes.shape[:-1], logical_k(codes, recipe))
        scale = get(f"{module}.weight_scale")
        s2 = None
        if recipe.name == "nvfp4":
            scale = require_8bit(f"{module}.weight_scale", scale)
            g = get(f"{module}.weight_global_scale").to(torch.float32).reshape(())
            s2 = 1.0 / g
        elif recipe.name in ("mxfp4", "mxfp8"):
            scale = require_8bit(f"{module}.weight_scale", scale)
        elif recipe.name == "fp8":
            scale = scale.to(torch.float32).reshape(())
        elif recipe.name == "fp8-channel":
            scale = scale.to(torch.float32).reshape(shape[:-1])
        else:
            scale = scale.to(torch.float32)
        return QuantizedTensor(recipe.name, shape, codes, scale, s2, recipe.scale_rule)

    def describe(self, module: str, recipe: Recipe) -> list[DiskTensor]:
        packed = recipe.name in PACKED
        out = [DiskTensor(f"{module}.weight_packed" if packed else f"{module}.weight", "codes",
                          "e2m1x2" if packed else "e4m3fn", None)]
        enc = {"nvfp4": "e4m3fn", "mxfp4": "e8m0_bias127", "mxfp8": "e8m0_bias127"}.get(recipe.name, "f32")
        out.append(DiskTensor(f"{module}.weight_scale", "block_scale", enc, "multiply"))
        if recipe.name == "nvfp4":
            out.append(DiskTensor(f"{module}.weight_global_scale", "global_scale", "f32", "divide"))
        return out

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        qc = config.get("quantization_config") or {}
        return qc.get("quant_method") == "compressed-tensors"

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        if f"{module}.weight_global_scale" in names:
            return "nvfp4"
        scheme = self.scheme_of(module, config)
        if scheme is None or f"{module}.weight_scale" not in names:
            return None
        w = scheme.get("weights") or {}
        bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
        if bits == 4 and group == 32:
            return "mxfp4"
        if bits == 8 and strategy == "group" and group == 32:
            return "mxfp8"
        if bits == 8 and w.get("type") == "float":
            return {"tensor": "fp8", "channel": "fp8-channel", "block": "fp8-block"}.get(strategy)
        return None

    @staticmethod
    def scheme_of(module: str, config: Mapping) -> dict | None:
        from quantcli.patterns import matches_target

        groups = (config.get("quantization_config") or {}).get("config_groups") or {}
        for group in groups.values():
            for target in group.get("targets", []):
                if matches_target(target, module):
                    return group
        return None

    def quantization_config(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        used = [r for r, mods in groups.items() if mods]
        config_groups = {}
        for i, recipe in enumerate(used):
            group = {"targets": ["Linear"] if len(used) == 1 else sorted(groups[recipe]),
                     "weights": dict(WEIGHTS[recipe]), "input_activations": INPUTS.get(recipe),
                     "output_activations": None, "format": FORMAT[recipe]}
            config_groups[f"group_{i}"] = group
        fmt = FORMAT[used[0]] if len({FORMAT[r] for r in used}) == 1 else "mixed-precision"
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "config_groups": config_groups, "ignore": excluded, "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}}

