"""fp8: FP8 E4M3FN weights, one FP32 scale for the whole tensor.

Format card
    element     E4M3FN (1-4-3, bias 7, max 448, no Inf), one byte per weight
    block       whole tensor (a 3-D expert stack shares one scale)
    scale       FP32 `amax / 448`, multiply on dequant; all-zero tensor -> 1.0
                at least 2^-126 (smallest normal FP32), so an FP32-subnormal amax never gives a
                zero scale (x / 0: NaN codes); at the top 448 * (amax / 448) stays finite
    encode      q = e4m3_rne(clamp(x / scale, -448, 448)): a true division, then clamp, then cast
    decode      x ~ float(q) * scale
    bits/param  8 (+ 32 bits per tensor)
    layouts     fp8 (default: `weight_scale`), compressed-tensors (FP8 tensor strategy)
"""

from quantcli.kernels.spec import E4M3, F32_SCALE, TENSOR, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="fp8", spec=QuantSpec(TENSOR, E4M3, F32_SCALE), default_layout="fp8")
