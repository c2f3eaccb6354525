"""int8-channel: per-channel symmetric INT8 weights, one FP32 scale per output row (W8A8 dynamic).

Format card (compressed-tensors' own integer arithmetic, in FP32)
    element     INT8, two's complement, one byte per weight, codes -128..127
    block       1 x K (one scale per output channel N; per expert for 3-D stacks)
    scale       FP32 `amax_row / 127.5`, shape [..., N], multiply; 127.5 = (127 - (-128)) / 2 is
                compressed-tensors' symmetric `max_val_pos / (bit_range / 2)` (calculate_qparams),
                so the row's largest magnitude lands on the +-127.5 tie: -amax -> -128,
                +amax -> 127 (clamped). All-zero row -> 1.0 (compressed-tensors writes its eps;
                codes are 0 either way); at least 2^-126 like every FP32 scale
    saturation  scale capped at FP32_MAX / 128, so -128 * scale stays finite: only a row whose
                amax exceeds ~3.39e38 (bf16 max) is affected; it then clips like an MX block
    encode      q = clamp(round_half_even(x / scale_row), -128, 127): a true division, then
                torch.round (ties to even), then clamp, as compressed-tensors' `_quantize`
    decode      x ~ float(q) * scale_row
    bits/param  8 + 32/K
    layouts     compressed-tensors (default; `weight` I8 [N, K], `weight_scale` F32 [N, 1],
                format `int-quantized`, inputs dynamic per-token INT8: vLLM CompressedTensorsW8A8Int8)
"""

from quantcli.kernels.spec import F32_SCALE, INT8, ROW, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="int8-channel", spec=QuantSpec(ROW, INT8, F32_SCALE))
