"""gpt-oss layout (`quant_method: mxfp4`): MXFP4 MoE experts of the GptOss architecture (the
engines read these names in their gpt-oss model code only: quantcli/formats/engines.py).

    mxfp4 on a 3-D expert stack W[E, N, K] (out before in):
        <name>_blocks U8 [E, N, K/32, 16]   (16 bytes = 32 E2M1 codes, low nibble = even k)
        <name>_scales U8 E8M0 [E, N, K/32]  (multiply, 2^(byte - 127); rule rceil)
Only fused experts are quantized (vLLM's mxfp4 method covers FusedMoE alone); every other
Linear is listed in `modules_to_not_convert`.
"""

from __future__ import annotations

from typing import Mapping

from quantcli.errors import LayoutError
from quantcli.formats.layouts.base import BLOCKS16, Direction, Layout, Role, TensorRow
from quantcli.recipes import Recipe

TABLES = {"mxfp4": (TensorRow("_blocks", Role.CODES, BLOCKS16),
                    TensorRow("_scales", Role.BLOCK_SCALE, direction=Direction.MULTIPLY))}

class GptOssLayout(Layout):
    name = "gpt-oss"
    tables = TABLES
    default_scale_rule = "rceil"
    exclusion_key = "modules_to_not_convert"
    experts_only = True

    def check_shape(self, name: str, recipe: Recipe, shape: tuple[int, ...]) -> None:
        if len(shape) != 3:
            raise LayoutError(f"{name}: --layout gpt-oss quantizes 3-D MoE expert stacks only "
                              f"(got {len(shape)}-D); use --layout compressed-tensors for Linears")

    def dense_name(self, module: str) -> tuple[str, bool]:
        return module, True  # dense expert stacks are stored [E, in, out] under the stack's name

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        qc = config.get("quantization_config") or {}
        return qc.get("quant_method") == "mxfp4"

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        return "mxfp4" if f"{module}_blocks" in names and f"{module}_scales" in names else None

    def quantization_config(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        return {"quant_method": "mxfp4", "modules_to_not_convert": excluded}
