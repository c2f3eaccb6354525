"""modelopt layout (`quant_method: modelopt`); engines per recipe: quantcli/formats/engines.py.

    nvfp4        weight U8 [N, K/2], weight_scale F8_E4M3 [N, K/16], weight_scale_2 F32 [] (multiply)
    fp8          weight F8_E4M3 [N, K], weight_scale F32 [], input_scale F32 []   FP8 (static
                 activations only: written with --activations static; docs/formats.md,
                 "ModelOpt FP8 and NVFP4 scales")
    fp8-channel  weight F8_E4M3 [N, K], weight_scale F32 [N]            FP8_PER_CHANNEL_PER_TOKEN
    fp8-block    weight F8_E4M3 [N, K], weight_scale F32 [N/128, 1, K/128, 1]   fp8_pb_wo (lower case,
                 as ModelOpt writes it: TensorRT-LLM matches only that spelling, vLLM upper-cases)
    mxfp8        weight F8_E4M3 [N, K], weight_scale U8 E8M0 [N, K/32]  MXFP8 (rule rceil)
    mxfp4        weight U8 [N, K/2], weight_scale U8 E8M0 [N, K/32]      MXFP4 (read only: ModelOpt's
                 own export, which no serving engine loads; docs/formats.md, "ModelOpt MXFP4 export")
Config: hf_quant_config.json {"producer", "quantization": {quant_algo, kv_cache_quant_algo,
group_size, exclude_modules}} plus config.json quantization_config in ModelOpt's flat form.
"""

from __future__ import annotations

from typing import Mapping

from quantcli import __version__
from quantcli.errors import LayoutError
from quantcli.formats.layouts.base import BLOCK4D, SCALAR, Direction, Layout, Role, TensorRow
from quantcli.recipes import Recipe

_CODES = TensorRow(".weight", Role.CODES)
_SCALE = TensorRow(".weight_scale", Role.BLOCK_SCALE, direction=Direction.MULTIPLY)
TABLES = {
    "nvfp4": (_CODES, _SCALE, TensorRow(".weight_scale_2", Role.GLOBAL_SCALE, SCALAR, Direction.MULTIPLY)),
    "fp8": (_CODES, TensorRow(".weight_scale", Role.BLOCK_SCALE, SCALAR, Direction.MULTIPLY)),
    "fp8-channel": (_CODES, _SCALE),
    "fp8-block": (_CODES, TensorRow(".weight_scale", Role.BLOCK_SCALE, BLOCK4D, Direction.MULTIPLY)),
    "mxfp8": (_CODES, _SCALE),
    "mxfp4": (_CODES, _SCALE),  # read only (unservable)
}
# Static activation scales, multipliers (docs/formats.md, "ModelOpt FP8 and NVFP4 scales"): filled
# from ModuleFacts.
_INPUT = TensorRow(".input_scale", Role.INPUT_SCALE, SCALAR, Direction.MULTIPLY, fact="input_scale")
OPTIONAL = {"nvfp4": (_INPUT,), "fp8": (_INPUT,), "fp8-channel": (_INPUT,)}

QUANT_ALGO = {"nvfp4": "W4A16_NVFP4", "fp8": "FP8", "fp8-channel": "FP8_PER_CHANNEL_PER_TOKEN",
              "fp8-block": "fp8_pb_wo", "mxfp8": "MXFP8"}
ALGO_TO_RECIPE = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8_PER_CHANNEL_PER_TOKEN": "fp8-channel",
                  "FP8_PB_WO": "fp8-block", "MXFP8": "mxfp8", "FP8": "fp8",
                  "MXFP4": "mxfp4", "W4A8_MXFP4_FP8": "mxfp4"}
GROUP_SIZE = {"nvfp4": 16, "mxfp8": 32}


class ModelOptLayout(Layout):
    name = "modelopt"
    tables = TABLES
    optional = OPTIONAL
    kv_scales = ("k_proj.k_scale", "v_proj.v_scale")  # relative to the attention module
    unservable = ("mxfp4",)
    needs_static = ("fp8",)
    default_scale_rule = "rceil"
    exclusion_key = "exclude_modules"

    def check_shape(self, name: str, recipe: Recipe, shape: tuple[int, ...]) -> None:
        super().check_shape(name, recipe, shape)
        if recipe.name == "fp8-block" and (shape[0] % 128 or shape[1] % 128):
            raise LayoutError(
                f"{name}: shape {list(shape)} is not a multiple of 128 in both dims, which vLLM's "
                f"modelopt FP8_PB_WO loader requires; use --layout fp8 or compressed-tensors")

    def config_problems(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> list[str]:
        qc = config.get("quantization_config") or {}
        hq = extra_files.get("hf_quant_config.json") or {}
        section = hq.get("quantization") or qc
        problems = [] if section.get("quant_algo") else ["modelopt config lacks a non-empty 'quant_algo' (vLLM/SGLang "
                                                         "need it)"]
        # The exclusion list may be empty (every Linear quantized, an encoder with no head): vLLM's
        # ModelOptQuantConfigBase.from_config reads `exclude_modules` (or config.json's `ignore`)
        # with a default of [] and only refuses a non-list; SGLang's ModelOptFp4Config.from_config
        # refuses only a missing one (None).
        key = "exclude_modules" if "quantization" in hq else "ignore"
        if not isinstance(section.get(key, []), list):
            problems.append(f"modelopt config's {key!r} is {type(section[key]).__name__}, not a list (vLLM refuses it)")
        if "NVFP4" in str(section.get("quant_algo", "")).upper():
            if key == "exclude_modules" and key not in section:  # ModelOptNvFp4Config._from_config: a required key
                problems.append("modelopt NVFP4 config lacks 'exclude_modules' (vLLM requires the key; [] will do)")
            if "group_size" not in section:
                problems.append("modelopt NVFP4 config lacks 'group_size' (vLLM requires it)")
            if "kv_cache_quant_algo" not in section and "kv_cache_scheme" not in section:
                problems.append("modelopt NVFP4 config lacks 'kv_cache_quant_algo' (vLLM requires the key)")
        return problems

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


    def declare_calibration(self, config: dict, extra: dict[str, dict], groups: Mapping[str, list[str]],
                            static: bool, kv_fp8: bool) -> None:
        section = extra["hf_quant_config.json"]["quantization"]
        # W4A4: an input_scale per Linear (docs/formats.md, "ModelOpt FP8 and NVFP4 scales")
        if static and section["quant_algo"] == "W4A16_NVFP4":
            section["quant_algo"] = config["quant_algo"] = "NVFP4"
        if kv_fp8:  # docs/formats.md, "FP8 KV-cache scale names"
            section["kv_cache_quant_algo"] = "FP8"
            config["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}


    def activation_scheme(self, config: Mapping) -> str:
        algo = _quant_algo(config)
        if algo in STATIC_ALGOS:
            return "static"
        return "dynamic" if algo in DYNAMIC_ALGOS else "none"

    def kv_cache_declared(self, config: Mapping) -> str | None:
        qc = config.get("quantization_config") or {}
        section = config.get("hf_quant_config", {}).get("quantization", {}) or qc
        algo = str(section.get("kv_cache_quant_algo") or "").upper()
        return f"kv_cache_quant_algo {algo}" if algo.startswith("FP8") else None


# input_scale per Linear (docs/formats.md, "ModelOpt FP8 and NVFP4 scales")
STATIC_ALGOS = ("NVFP4", "FP8", "W4A8_MXFP4_FP8")
DYNAMIC_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "MXFP8")


def _producer() -> dict:
    return {"name": "quantcli", "version": __version__}


def _quant_algo(config: Mapping) -> str:
    qc = config.get("quantization_config") or {}
    section = config.get("hf_quant_config", {}).get("quantization", {}) or qc
    return str(section.get("quant_algo", "")).upper()
