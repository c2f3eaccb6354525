"""mxfp4: OCP microscaling FP4, E2M1 elements packed two per byte, one E8M0 scale per 32.

Format card
    element     E2M1 (values 0, .5, 1, 1.5, 2, 3, 4, 6 and negatives; bit 3 = sign), RNE with
                ties to the even code, saturating at 6; negatives that round to 0 keep 0x8
    packing     byte[j] = code[2j] | code[2j+1] << 4 along K (even index in the low nibble)
    block       1 x 32 along K (K % 32 == 0)
    scale       E8M0 as U8, 2^(byte - 127), shape [..., N, K/32], multiply; `scale_rule`:
                  floor  floor(log2 amax) - 2          (OCP MX v1.0; may clip the block max)
                  even   floor(log2 R(amax)) - 2       (compressed-tensors, Quark)
                  rceil  ceil(log2(amax / 6))          (ModelOpt, triton_kernels, gpt-oss)
                clamped to [0, 254]; all-zero block -> byte 0
    saturation  byte capped at 252 = 254 - 2, the last byte whose largest code decodes finitely
                (6 * 2^125 = 2.55e38; 6 * 2^126 is Inf in FP32). even and rceil ask for more only
                when the block amax exceeds ~2.5e38; such a block then clips to +-2.55e38, as
                floor clips every block's 6..8 range to 6. Ordinary inputs are unaffected.
    encode      q = e2m1_rne(x / 2^(byte-127))
    decode      x ~ e2m1(q) * 2^(byte - 127)
    bits/param  4.25
    search      --scale-search mse: per block byte, byte + 1 or byte - 1, whichever dequantizes
                with the smallest (activation-weighted) squared error, ties to byte (kernels/search.py)
    layouts     compressed-tensors (default, rule even; `weight_packed` [N, K/2]),
                gpt-oss (MoE experts, rule rceil; `*_blocks` [E, N, K/32, 16], `*_scales`)
"""

from quantcli.kernels.spec import E2M1, E8M0_SCALE, GROUP, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="mxfp4", spec=QuantSpec(GROUP, E2M1, E8M0_SCALE, group=32, scale_rule="even"))
