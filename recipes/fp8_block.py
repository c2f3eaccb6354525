"""fp8-block: FP8 E4M3FN weights, one FP32 scale per 128 x 128 block (DeepSeek-V3 style).

Format card
    element     E4M3FN, one byte per weight
    block       128 x 128 of W[N, K]; edge blocks are partial (zero-padded for the amax only)
    scale       FP32 `amax_block / 448`, shape [..., ceil(N/128), ceil(K/128)], row-major,
                multiply on dequant (even when stored as `weight_scale_inv`); all-zero block -> 1.0
                at least 2^-126 (smallest normal FP32), so an FP32-subnormal amax never gives a
                zero scale (x / 0: NaN codes); at the top 448 * (amax / 448) stays finite
    encode      q = e4m3_rne(clamp(x / scale_block, -448, 448))
    decode      x ~ float(q) * scale_block
    bits/param  8 + 32/16384
    layouts     fp8 (default; `weight_scale_inv`), compressed-tensors (`weight_scale`),
                modelopt (`fp8_pb_wo`, 4-D `weight_scale`, N and K multiples of 128); which engine
                loads which: quantcli/formats/engines.py
"""

from quantcli.kernels.spec import BLOCK, E4M3, F32_SCALE, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="fp8-block", spec=QuantSpec(BLOCK, E4M3, F32_SCALE), default_layout="fp8")
