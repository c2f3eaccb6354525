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

from quantcli.errors import LayoutError
from quantcli.formats.layouts.base import SCALAR, Direction, Layout, Role, TensorRow

_CODES = TensorRow(".weight", Role.CODES)
_SCALE_INV = TensorRow(".weight_scale_inv", Role.BLOCK_SCALE, direction=Direction.MULTIPLY)
TABLES = {
    "fp8": (_CODES, TensorRow(".weight_scale", Role.BLOCK_SCALE, SCALAR, Direction.MULTIPLY)),
    "fp8-block": (_CODES, _SCALE_INV),
    "mxfp8": (_CODES, _SCALE_INV),
}
OPTIONAL = {"fp8": (TensorRow(".input_scale", Role.INPUT_SCALE, SCALAR, Direction.MULTIPLY, fact="input_scale"),)}

class Fp8Layout(Layout):
    name = "fp8"
    consumers = "vLLM, SGLang, transformers (FineGrainedFP8)"
    tables = TABLES
    optional = OPTIONAL
    default_scale_rule = "rceil"
    exclusion_key = "ignored_layers"

    def config_problems(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> list[str]:
        qc = config.get("quantization_config") or {}
        if qc.get("quant_method") == "fp8" and qc.get("activation_scheme") not in ("static", "dynamic"):
            return ["fp8 quantization_config lacks 'activation_scheme' (vLLM requires it)"]
        return []

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

    def declare_calibration(self, config: dict, extra: dict[str, dict], groups: Mapping[str, list[str]],
                            static: bool, kv_fp8: bool) -> None:
        if static:  # per-tensor input_scale (docs/formats.md, "FineGrainedFP8 and the fp8 layout")
            config["activation_scheme"] = "static"

    def activation_scheme(self, config: Mapping) -> str:
        scheme = (config.get("quantization_config") or {}).get("activation_scheme")
        return scheme if scheme in ("static", "dynamic") else "none"
