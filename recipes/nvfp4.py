"""nvfp4: NVIDIA FP4, E2M1 elements with an E4M3 scale per 16 and an FP32 global scale.

Format card (ModelOpt's arithmetic, FP32 throughout)
    element     E2M1, RNE ties to even code, saturating at 6, two per byte, low nibble first
    block       1 x 16 along K (K % 16 == 0)
    global      s2 = amax_W / 2688 (2688 = 6 * 448), FP32, multiply (`weight_scale_2`);
                compressed-tensors stores 1 / s2 as `weight_global_scale` (divide).
                Fused groups (q/k/v, gate/up, w1/w3) share the group's max amax.
                All-zero tensor: amax_W treated as 1.0. s2 is at least 2^-126 (smallest normal
                FP32): an all-subnormal tensor would otherwise get s2 = 0 (NaN block scales) or
                an Inf 1 / s2. No cap at the top: a decode is at most 6 * 448 * s2 ~ amax_W,
                finite in every op order up to FP32 max (tests/test_faults_numerics.py).
    block scale sb = e4m3_rne(clamp(amax_b / (6 * s2), 2^-9, 448)), the product 6 * s2 first;
                a zero quotient (all-zero block) -> 1.0 (0x38)
    encode      q = e2m1_rne(x / (float(sb) * s2)), the product float(sb) * s2 formed first
    decode      x ~ e2m1(q) * (float(sb) * s2)
    bits/param  4.5 (+ 32 bits per tensor)
    search      --scale-search mse: per block the E4M3 code in -3..+7 around sb with the smallest
                (activation-weighted) squared error, ties to sb; s2 unchanged (kernels/search.py)
    layouts     modelopt (default; `weight` U8 [N, K/2], `weight_scale` F8_E4M3 [N, K/16],
                `weight_scale_2` F32 0-d), compressed-tensors (`weight_packed`, `weight_scale`,
                `weight_global_scale` F32 [1])
"""

from quantcli.kernels.spec import E2M1, E4M3_GLOBAL_SCALE, GROUP, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="nvfp4", spec=QuantSpec(GROUP, E2M1, E4M3_GLOBAL_SCALE, group=16), default_layout="modelopt")
