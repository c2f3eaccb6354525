"""compressed-tensors layout (`quant_method: compressed-tensors`); engines per recipe: quantcli/formats/engines.py.

    nvfp4        weight_packed U8 [N, K/2], weight_scale F8_E4M3 [N, K/16],
                 weight_global_scale F32 [1] = 1 / weight_scale_2 (divide)   nvfp4-pack-quantized
    mxfp4        weight_packed U8 [N, K/2], weight_scale U8 E8M0 [N, K/32]     mxfp4-pack-quantized
    mxfp8        weight F8_E4M3 [N, K], weight_scale U8 E8M0 [N, K/32]         mxfp8-quantized
    fp8          weight F8_E4M3, weight_scale F32 [1]                           float-quantized
    fp8-channel  weight F8_E4M3, weight_scale F32 [N, 1]                        float-quantized
    fp8-block    weight F8_E4M3, weight_scale F32 [ceil(N/128), ceil(K/128)]    float-quantized
    int8-channel weight I8 [N, K], weight_scale F32 [N, 1]                      int-quantized
    int4         weight_packed I32 [N, K/8], weight_scale (weight dtype) [N, K/128],
                 weight_shape I64 [2]                                           pack-quantized
FP8-family scales are written in FP32 (the producer writes the dense dtype, usually BF16, which
would round the scale the codes were computed with); consumers cast on load. int4's scales are
in the weight's dtype, as llm-compressor writes them: its codes were rounded with those values. Activations of
the fp8 recipes are declared dynamic (per token / per 128-group), which needs no calibration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from quantcli.formats.layouts.base import COLUMN, ONE, Direction, Layout, Role, TensorRow
from quantcli.formats.patterns import matches_target, validate
from quantcli.recipes import get_recipe

_SCALE = TensorRow(".weight_scale", Role.BLOCK_SCALE, direction=Direction.MULTIPLY)
_CODES = TensorRow(".weight", Role.CODES)
_PACKED = TensorRow(".weight_packed", Role.CODES)
# The divisor convention: weight_global_scale = 1 / weight_scale_2, one FP32 division.
_GLOBAL = TensorRow(".weight_global_scale", Role.GLOBAL_SCALE, ONE, Direction.DIVIDE)
_FLOAT = {"type": "float", "symmetric": True, "dynamic": False}
_DYNAMIC = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
# The logical [N, K], which the pack-quantized compressor stores with every packed weight.
_SHAPE = TensorRow(".weight_shape", Role.SHAPE, dtype=torch.int64)
# llm-compressor 0.14's W4A16 weights, key for key (QuantizationModifier, scheme="W4A16", with
# compressed-tensors 0.19; docs/formats.md, "compressed-tensors presets"): compressed-tensors'
# QuantizationArgs parses it (extra="forbid"), and 0.20 reads the same keys it would write.
_W4A16 = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
          "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "group",
          "symmetric": True, "type": "int", "zp_dtype": None}


@dataclass(frozen=True)
class Scheme:
    """One recipe in compressed-tensors: its disk tensors and its config group."""

    tensors: tuple[TensorRow, ...]
    format: str
    weights: dict
    input_activations: dict | None = None


SCHEMES = {
    "nvfp4": Scheme((_PACKED, _SCALE, _GLOBAL), "nvfp4-pack-quantized",
                    {"num_bits": 4, **_FLOAT, "strategy": "tensor_group", "group_size": 16,
                     "scale_dtype": "torch.float8_e4m3fn"}),
    "mxfp4": Scheme((_PACKED, _SCALE), "mxfp4-pack-quantized",
                    {"num_bits": 4, **_FLOAT, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}),
    "mxfp8": Scheme((_CODES, _SCALE), "mxfp8-quantized",
                    {"num_bits": 8, **_FLOAT, "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"}),
    "fp8": Scheme((_CODES, TensorRow(".weight_scale", Role.BLOCK_SCALE, ONE, Direction.MULTIPLY)), "float-quantized",
                  {"num_bits": 8, **_FLOAT, "strategy": "tensor"}, {**_DYNAMIC, "strategy": "token"}),
    "fp8-channel": Scheme((_CODES, TensorRow(".weight_scale", Role.BLOCK_SCALE, COLUMN, Direction.MULTIPLY)),
                          "float-quantized",
                          {"num_bits": 8, **_FLOAT, "strategy": "channel"}, {**_DYNAMIC, "strategy": "token"}),
    "fp8-block": Scheme((_CODES, _SCALE), "float-quantized",
                        {"num_bits": 8, **_FLOAT, "strategy": "block", "block_structure": [128, 128]},
                        {**_DYNAMIC, "strategy": "group", "group_size": 128}),
    # W8A8 with dynamic per-token INT8 activations: vLLM's CompressedTensorsW8A8Int8 (an
    # int-quantized group with input_activations null matches no vLLM scheme).
    "int8-channel": Scheme((_CODES, TensorRow(".weight_scale", Role.BLOCK_SCALE, COLUMN, Direction.MULTIPLY)),
                           "int-quantized",
                           {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "channel"},
                           {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}),
    # W4A16: vLLM's CompressedTensorsWNA16 (Machete on SM90, Marlin SM75+), SGLang's (Marlin).
    "int4": Scheme((_PACKED, _SCALE, _SHAPE), "pack-quantized", _W4A16),
}
TABLES = {recipe: scheme.tensors for recipe, scheme in SCHEMES.items()}
FORMAT = {recipe: scheme.format for recipe, scheme in SCHEMES.items()}
WEIGHTS = {recipe: scheme.weights for recipe, scheme in SCHEMES.items()}
INPUTS = {recipe: scheme.input_activations for recipe, scheme in SCHEMES.items() if scheme.input_activations}
# Static activation scales (docs/formats.md, "compressed-tensors presets"): filled from ModuleFacts
# when a calibration pass learns them; `input_global_scale` is a divisor like `weight_global_scale`.
_INPUT = TensorRow(".input_scale", Role.INPUT_SCALE, ONE, Direction.MULTIPLY, fact="input_scale")
OPTIONAL = {"fp8": (_INPUT,), "fp8-channel": (_INPUT,),
            "nvfp4": (TensorRow(".input_global_scale", Role.INPUT_GLOBAL_SCALE, ONE, Direction.DIVIDE,
                                fact="input_scale"),)}

class CompressedTensorsLayout(Layout):
    name = "compressed-tensors"
    tables = TABLES
    optional = OPTIONAL
    kv_scales = ("k_scale", "v_scale")  # on the attention module: `...self_attn.k_scale`
    kv_scale_shape = (1,)
    default_scale_rule = "even"
    exclusion_key = "ignore"

    def mix_problem(self, recipes: set[str]) -> str | None:
        return None  # one config group per recipe (format mixed-precision when the formats differ)

    def config_problems(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> list[str]:
        qc = config.get("quantization_config") or {}
        return [f"compressed-tensors quantization_config lacks {key!r}" for key in ("config_groups", "format")
                if not qc.get(key)] + _group_size_problems(qc)

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        qc = config.get("quantization_config") or {}
        if qc.get("quant_method") != "compressed-tensors":
            return False
        _check_targets(qc)
        return True

    def quantized_modules(self, names: Mapping[str, object], config: Mapping) -> dict[str, str]:
        _check_targets(config.get("quantization_config") or {})  # also when a manifest named the layout
        return super().quantized_modules(names, config)

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        if f"{module}.weight_global_scale" in names:
            return "nvfp4"
        scheme = self.scheme_of(module, config)
        if scheme is None or f"{module}.weight_scale" not in names:
            return None
        w = scheme.get("weights") or {}
        bits, strategy, group = w.get("num_bits"), w.get("strategy"), w.get("group_size")
        if w.get("type") == "int" and w.get("symmetric", True) is not True:
            return None  # zero points (W4A16_ASYM): no recipe decodes them
        if bits == 4 and group == 32 and w.get("type", "float") == "float":
            return "mxfp4"
        if bits == 8 and strategy == "group" and group == 32:
            return "mxfp8"
        if bits == 8 and w.get("type") == "float":
            return {"tensor": "fp8", "channel": "fp8-channel", "block": "fp8-block"}.get(strategy)
        # Any other recipe: the one whose config group this is (its defining keys agree).
        return next((r for r, scheme in SCHEMES.items() if _same_weights(w, scheme.weights)), None)

    @staticmethod
    def scheme_of(module: str, config: Mapping) -> dict | None:
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

    def declare_calibration(self, config: dict, extra: dict[str, dict], groups: Mapping[str, list[str]],
                            static: bool, kv_fp8: bool) -> None:
        if static:  # the FP8 and NVFP4 (W4A4) presets (docs/formats.md, "compressed-tensors presets")
            for group in config["config_groups"].values():
                recipe = next(r for r, s in SCHEMES.items() if s.format == group["format"]
                              and _same_weights(group["weights"], s.weights))
                if recipe in STATIC_INPUTS:
                    group["input_activations"] = dict(STATIC_INPUTS[recipe])
        if kv_fp8:  # docs/formats.md, "FP8 KV-cache scale names"
            config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                         "symmetric": True}

    def activation_scheme(self, config: Mapping) -> str:
        groups = ((config.get("quantization_config") or {}).get("config_groups") or {}).values()
        inputs = [g.get("input_activations") for g in groups if isinstance(g, dict)]
        if any(isinstance(i, dict) and i.get("dynamic") in (False, "local") for i in inputs):
            return "static"  # nvfp4's "local": a static global scale, dynamic per-group scales
        return "dynamic" if any(isinstance(i, dict) for i in inputs) else "none"

    def kv_cache_declared(self, config: Mapping) -> str | None:
        kv = (config.get("quantization_config") or {}).get("kv_cache_scheme")
        if isinstance(kv, dict) and kv.get("num_bits") == 8 and kv.get("type") == "float":
            return "kv_cache_scheme (8-bit float)"
        return None


_STATIC_FP8 = {"num_bits": 8, **_FLOAT, "strategy": "tensor"}
STATIC_INPUTS = {"fp8": _STATIC_FP8, "fp8-channel": _STATIC_FP8,
                 "nvfp4": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                           "group_size": 16, "dynamic": "local", "scale_dtype": "torch.float8_e4m3fn"}}


def _same_weights(theirs: Mapping, ours: Mapping) -> bool:
    return all(theirs.get(key) == ours.get(key) for key in ("num_bits", "type", "strategy", "group_size"))


def _check_targets(qc: Mapping) -> None:
    """Every `config_groups.*.targets` pattern compiles; one line naming config.json and the key."""
    for name, group in (qc.get("config_groups") or {}).items():
        for target in (group.get("targets") or []) if isinstance(group, dict) else []:
            validate(target, f"config.json: quantization_config.config_groups.{name}.targets")


def _group_size_problems(qc: Mapping) -> list[str]:
    """Config groups whose weights.group_size is not the block of the recipe their format names
    (nvfp4 16, mxfp4 and mxfp8 32): loaders would read the scales with the wrong block."""
    # Only formats that fix the group (pack-quantized holds int groups of any size).
    by_format = {s.format: r for r, s in SCHEMES.items()
                 if s.weights.get("group_size") and s.weights["type"] == "float"}
    problems = []
    for name, group in (qc.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            continue
        recipe = by_format.get(group.get("format") or qc.get("format"))
        declared = (group.get("weights") or {}).get("group_size")
        if recipe and declared is not None and declared != get_recipe(recipe).block[1]:
            problems.append(f"config_groups.{name}.weights.group_size is {declared}, but {recipe} blocks hold "
                            f"{get_recipe(recipe).block[1]} elements; set it to {get_recipe(recipe).block[1]}")
    return problems
