"""int4: W4A16, symmetric INT4 weights in groups of 128 along K, one scale per group in the
weight's own dtype (the 4-bit format Marlin / Machete kernels serve on Ampere and Hopper).

Format card (compressed-tensors' own arithmetic: its W4A16 preset, format `pack-quantized`;
tests/test_int4.py calls its functions and compares every byte)
    element     INT4, codes -8..7
    block       1 x 128 along the input dim K (K % 128 == 0; other K is refused, as by every
                group recipe)
    scale       s = dtype(amax_group / 7.5), in the weight's dtype (BF16, FP16 or FP32), shape
                [..., N, K/128], multiply on dequant. 7.5 = (7 - (-8)) / 2 is compressed-tensors'
                symmetric `max_val_pos / (bit_range / 2)` (quantization/utils/helpers.py
                calculate_qparams), which divides in the weight's dtype: torch forms the FP32
                quotient and rounds it once (RNE) to BF16 / FP16. A zero scale (an all-zero group,
                or an amax / 7.5 that underflows the dtype) becomes the dtype's eps (BF16 2^-7,
                FP16 2^-10, FP32 2^-23), as calculate_qparams does; that group's codes are 0
    saturation  the FP32 quotient is capped at (2 - 2^-7) * 2^124 before the rounding, so that
                -8 * s stays finite: only a group whose amax exceeds ~3.18e38 (where
                compressed-tensors' own decode is -Inf) is affected. FP16 is left as
                compressed-tensors has it: an amax above ~61400 gives -8 * s past FP16 max, finite
                in quantcli's FP32 decode, -Inf in an FP16 one
    encode      q = clamp(round_half_even(dtype(x / s)), -8, 7): compressed-tensors' eager
                `_quantize` (quantization/lifecycle/forward_helpers.py) divides the BF16 / FP16
                weight by the scale in that dtype, so the FP32 quotient is rounded to the dtype
                before torch.round (ties to even) and the clamp. -amax lands on the -7.5 tie -> -8
    packing     offset binary u = q + 8 (0..15), two per byte along K, even k in the low nibble:
                codes U8 [..., N, K/2]. Read as little-endian int32 words they are
                compressed-tensors' `weight_packed` I32 [..., N, K/8] (compressors/pack_quantized/
                helpers.py pack_to_int32: +8, element 8w + i in bits 4i..4i+3 of word w)
    decode      x ~ q * s (`_dequantize` multiplies in the scale's dtype; q * s is exact in FP32
                and rounds to the same value)
    bits/param  4 + 16/128 (BF16 / FP16 scales)
    caveat      compressed-tensors >= 0.20 on CUDA quantizes with a Triton kernel that divides in
                FP32 without the rounding to the weight's dtype: where the FP32 quotient lies
                within half an ulp below a .5 tie its codes differ from these and from its own CPU
                run (measured on N(0, 0.02) weights: ~0.6 % of codes for BF16, ~0.2 % FP16, none
                for FP32)
    layouts     compressed-tensors `pack-quantized` (the default; llm-compressor's W4A16):
                `weight_packed` I32 [N, K/8], `weight_scale` (weight dtype) [N, K/128],
                `weight_shape` I64 [2] = [N, K]; loaded by vLLM (CompressedTensorsWNA16: Machete
                on SM90, Marlin SM75+), SGLang (Marlin, SM80+) and transformers (decompressed)
"""

from quantcli.kernels.spec import GROUP, INT4, WEIGHT_DTYPE_SCALE, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="int4", spec=QuantSpec(GROUP, INT4, WEIGHT_DTYPE_SCALE, group=128))
