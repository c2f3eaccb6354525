"""fp8: FP8 E4M3FN weights, one FP32 scale for the whole tensor.

Format card
    element     E4M3FN (1-4-3, bias 7, max 448, no Inf), one byte per weight
    block       whole tensor (a 3-D expert stack shares one scale)
    scale       FP32 `amax / 448`, multiply on dequant; all-zero tensor -> 1.0
    encode      q = e4m3_rne(clamp(x / scale, -448, 448)): a true division, then clamp, then cast
    decode      x ~ float(q) * scale
    bits/param  8 (+ 32 bits per tensor)
    layouts     fp8 (default: `weight_scale`), compressed-tensors (FP8 tensor strategy)
"""

from quantcli.kernels.spec import FP8_TENSOR, QuantSpec

from .base import Recipe

RECIPE = Recipe(name="fp8", spec=QuantSpec(FP8_TENSOR), element_bits=8, block=(0, 0), scale_encoding="f32")
