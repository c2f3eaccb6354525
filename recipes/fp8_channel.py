"""fp8-channel: FP8 E4M3FN weights, one FP32 scale per output row.

Format card
    element     E4M3FN, one byte per weight
    block       1 x K (one scale per output channel N; per expert for 3-D stacks)
    scale       FP32 `amax_row / 448`, shape [..., N], multiply; all-zero row -> 1.0
                at least 2^-126 (smallest normal FP32), so an FP32-subnormal amax never gives a
                zero scale (x / 0: NaN codes); at the top 448 * (amax / 448) stays finite
    encode      q = e4m3_rne(clamp(x / scale_row, -448, 448))
    decode      x ~ float(q) * scale_row
    bits/param  8 + 32/K
    layouts     compressed-tensors (default; `weight_scale` [N, 1]), modelopt
                (`FP8_PER_CHANNEL_PER_TOKEN`, `weight_scale` [N]); engines: quantcli/formats/engines.py
"""

from quantcli.kernels.spec import E4M3, F32_SCALE, ROW, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="fp8-channel", spec=QuantSpec(ROW, E4M3, F32_SCALE))
