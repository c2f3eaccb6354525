"""modelopt layout (`quant_method: modelopt`), loaded by vLLM, SGLang and TensorRT-LLM.

    nvfp4        weight U8 [N, K/2], weight_scale F8_E4M3 [N, K/16], weight_scale_2 F32 [] (multiply)
    fp8-channel  weight F8_E4M3 [N, K], weight_scale F32 [N]            FP8_PER_CHANNEL_PER_TOKEN
    fp8-block    weight F8_E4M3 [N, K], weight_scale F32 [N/128, 1, K/128, 1]   FP8_PB_WO
    mxfp8        weight F8_E4M3 [N, K], weight_scale U8 E8M0 [N, K/32]  MXFP8 (rule rceil)
    mxfp4        weight U8 [N, K/2], weight_scale U8 E8M0 [N, K/32]      MXFP4 (read only: ModelOpt's
                 own export, which no serving engine loads; FORMATS.md B 7.5)
Config: hf_quant_config.json {"producer", "quantization": {quant_algo, kv_cache_quant_algo,
group_size, exclude_modules}} plus config.json quantization_config in ModelOpt's flat form.
"""

from __future__ import annotations

from typing import Mapping

import torch

from quantcli import __version__
from quantcli.errors import LayoutError
from quantcli.recipes import QuantizedTensor, Recipe

from .base import DiskTensor, GetTensor, Layout, as_codes, logical_k, require_8bit, scalar_f32

QUANT_ALGO = {"nvfp4": "W4A16_NVFP4", "fp8-channel": "FP8_PER_CHANNEL_PER_TOKEN",
              "fp8-block": "FP8_PB_WO", "mxfp8": "MXFP8"}
ALGO_TO_RECIPE = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8_PER_CHANNEL_PER_TOKEN": "fp8-channel",
                  "FP8_PB_WO": "fp8-block", "MXFP8": "mxfp8", "FP8": "fp8",
                  "MXFP4": "mxfp4", "W4A8_MXFP4_FP8": "mxfp4"}
GROUP_SIZE = {"nvfp4": 16, "mxfp8": 32}


class ModelOptLayout(Layout):
    name = "modelopt"
    consumers = "vLLM, SGLang, TensorRT-LLM"
    recipes = ("nvfp4", "fp8-channel", "fp8-block", "mxfp8")
    unservable = ("mxfp4",)
    default_scale_rule = "rceil"
    exclusion_key = "exclude_modules"

    def check_shape(self, name: str, recipe: Recipe, shape: tuple[int, ...]) -> None:
        super().check_shape(name, recipe, shape)
        if recipe.name == "fp8-block" and (shape[0] % 128 or shape[1] % 128):
            raise LayoutError(
                f"{name}: shape {list(shape)} is not a multiple of 128 in both dims, which vLLM's "
                f"modelopt FP8_PB_WO loader requires; use --layout fp8 or compressed-tensors")

    def to_disk(self, module: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        from quantcli.recipes import get_recipe

        recipe = get_recipe(q.recipe)
        out = {f"{module}.weight": as_codes(q.codes, recipe)}
        if q.recipe == "nvfp4":
            out[f"{module}.weight_scale"] = q.scale.contiguous().view(torch.float8_e4m3fn)
            out[f"{module}.weight_scale_2"] = scalar_f32(q.global_scale, ())
        elif q.recipe == "fp8-block":
            nb, kb = q.scale.shape
            out[f"{module}.weight_scale"] = q.scale.reshape(nb, 1, kb, 1).contiguous()
        else:  # fp8-channel [N] F32, mxfp8 [N, K/32] U8
            out[f"{module}.weight_scale"] = q.scale.contiguous()
        return out

    def from_disk(self, module: str, recipe: Recipe, get: GetTensor, names: Mapping[str, object]) -> QuantizedTensor:
        codes = require_8bit(f"{module}.weight", get(f"{module}.weight"))
        scale = get(f"{module}.weight_scale")
        shape = (*codes.shape[:-1], logical_k(codes, recipe))
        s2 = None
        if recipe.name == "nvfp4":
            scale = require_8bit(f"{module}.weight_scale", scale)
            s2 = get(f"{module}.weight_scale_2").to(torch.float32).reshape(())
        elif recipe.name in ("mxfp8", "mxfp4"):
            scale = require_8bit(f"{module}.weight_scale", scale)
        elif recipe.name == "fp8-block":
            scale = scale.to(torch.float32).reshape(-(-shape[0] // 128), -(-shape[1] // 128))
        else:
            scale = scale.to(torch.float32).reshape(*shape[:-1])
        return QuantizedTensor(recipe.name, shape, codes, scale, s2, recipe.scale_rule)

    def describe(self, module: str, recipe: Recipe) -> list[DiskTensor]:
        codes = "e2m1x2" if recipe.element_bits == 4 else "e4m3fn"
        scale_enc = {"nvfp4": "e4m3fn", "mxfp8": "e8m0_bias127", "mxfp4": "e8m0_bias127"}.get(recipe.name, "f32")
        out = [DiskTensor(f"{module}.weight", "codes", codes, None),
               DiskTensor(f"{module}.weight_scale", "block_scale", scale_enc, "multiply")]
        if recipe.name == "nvfp4":
            out.append(DiskTensor(f"{module}.weight_scale_2", "global_scale", "f32", "multiply"))
        return out

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        qc = config.get("quantization_config") or {}
        return "hf_quant_config.json" in extra_files or qc.get("quant_method") == "modelopt"

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        if f"{module}.weight_scale" not in names:
            return None
        if f"{module}.weight_scale_2" in names:
            return "nvfp4"
        algo = _quant_algo(config)
        return ALGO_TO_RECIPE.get(algo, None)

    def _algo(self, groups: Mapping[str, list[str]]) -> str:
        used = [r for r, mods in groups.items() if mods]
        if len(used) > 1:
            raise LayoutError(
                f"--layout modelopt holds one recipe per checkpoint here, got {', '.join(used)}; "
                f"use --layout compressed-tensors for mixed precision")
        return QUANT_ALGO[used[0]] if used else "W4A16_NVFP4"

    def _section(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        algo = self._algo(groups)
        recipe = next((r for r, mods in groups.items() if mods), "nvfp4")
        section = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": excluded}
        if recipe in GROUP_SIZE:
            section["group_size"] = GROUP_SIZE[recipe]
        return section

    def extra_files(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict[str, dict]:
        return {"hf_quant_config.json": {"producer": _producer(), "quantization": self._section(groups, excluded)}}

    def quantization_config(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        section = self._section(groups, excluded)
        cfg = {"quant_method": "modelopt", "quant_algo": section["quant_algo"],
               "kv_cache_scheme": None, "ignore": excluded, "producer": _producer()}
        if "group_size" in section:
            cfg["group_size"] = section["group_size"]
        return cfg


def _producer() -> dict:
    return {"name": "quantcli", "version": __version__}


def _quant_algo(config: Mapping) -> str:
    qc = config.get("quantization_config") or {}
    section = config.get("hf_quant_config", {}).get("quantization", {}) or qc
    return str(section.get("quant_algo", "")).upper()
