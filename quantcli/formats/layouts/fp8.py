"""fp8 layout (`quant_method: fp8`, DeepSeek-V3 style); which engine loads which recipe in it:
quantcli/formats/engines.py.

    fp8        weight F8_E4M3 [N, K], weight_scale F32 [] (per tensor, multiply)
    fp8-block  weight F8_E4M3 [N, K], weight_scale_inv F32 [ceil(N/128), ceil(K/128)]
               (multiply, despite the name: "inv" is the inverse of the 448/amax multiplier)
    mxfp8      weight F8_E4M3 [N, K], weight_scale_inv U8 E8M0 [N, K/32]
               (SGLang's `quant_method: mxfp8`, `weight_block_size: [1, 32]`)
Config: {quant_method, activation_scheme: dynamic, fmt: e4m3, weight_block_size,
ignored_layers, modules_to_not_convert} (vLLM reads the first list, transformers the second).

FP8 KV cache (--kv-cache fp8): `<attn>.k_scale`, `<attn>.v_scale` F32 [] (amax / 448, multiply)
and `kv_cache_quant_algo: "FP8"`. Both engines' fp8 method gives every attention layer an FP8
KV-cache method holding k_scale / v_scale (vLLM 0.33 quantization/kv_cache.py
BaseKVCacheMethod, 0-d or [1]; SGLang 0.5.23 the same, any one-element tensor) and map
`.self_attn.k_scale` to `.self_attn.attn.k_scale` (vLLM QuantizationConfig.get_cache_scale_mapper,
SGLang weight_utils.maybe_remap_kv_scale_name). SGLang turns its cache to FP8 from
kv_cache_quant_algo (mem_cache/kv_cache_dtype.py); vLLM only with --kv-cache-dtype fp8
(quantcli/formats/engines.py VLLM_KV_FLAGS). transformers ignores them.
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
    tables = TABLES
    optional = OPTIONAL
    default_scale_rule = "rceil"
    exclusion_key = "ignored_layers"
    kv_scales = ("k_scale", "v_scale")  # on the attention module: `...self_attn.k_scale`
    kv_scale_shape = ()  # F32 0-d, as this layout's other per-tensor scales

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
        if kv_fp8:  # SGLang's Fp8Config reads it and turns its KV cache to FP8 (vLLM needs the flag)
            config["kv_cache_quant_algo"] = "FP8"

    def activation_scheme(self, config: Mapping) -> str:
        scheme = (config.get("quantization_config") or {}).get("activation_scheme")
        return scheme if scheme in ("static", "dynamic") else "none"

    def kv_cache_declared(self, config: Mapping) -> str | None:
        algo = str((config.get("quantization_config") or {}).get("kv_cache_quant_algo") or "").upper()
        return f"kv_cache_quant_algo {algo}" if algo.startswith("FP8") else None
