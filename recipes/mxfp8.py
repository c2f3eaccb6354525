"""mxfp8: OCP microscaling FP8, E4M3FN elements with one E8M0 scale per 32 along K.

Format card
    element     E4M3FN, one byte per weight
    block       1 x 32 along the input dim K (K % 32 == 0)
    scale       E8M0 stored as U8, value 2^(byte - 127), shape [..., N, K/32], multiply;
                byte from the block amax by `scale_rule` (emax_elem = 8, max_elem = 448):
                  floor  floor(log2 amax) - 8                      (OCP MX v1.0)
                  even   floor(log2 R(amax)) - 8, R rounds the mantissa at FP4 width (CT)
                  rceil  ceil(log2(amax / 448))                     (ModelOpt, triton_kernels)
                clamped to [0, 254] (255 = NaN is never written); all-zero block -> byte 0
    saturation  byte capped at 246 = 254 - 8, the last byte whose largest code decodes finitely
                (448 * 2^119 = 2.98e38; 448 * 2^120 is Inf in FP32). even and rceil ask for more
                only when the block amax exceeds ~2.98e38; such a block then clips to +-2.98e38.
                Ordinary inputs are unaffected.
    encode      q = e4m3_rne(clamp(x / 2^(byte-127), -448, 448))
    decode      x ~ float(q) * 2^(byte - 127)
    bits/param  8.25
    search      --scale-search mse: per block byte, byte + 1 or byte - 1 by squared error (on
                all-MiniLM-L6-v2 it never moved: E4M3 elements leave nothing to gain)
    layouts     compressed-tensors (default, rule even), modelopt (`MXFP8`, rule rceil),
                fp8 (`quant_method: mxfp8`, `weight_scale_inv` U8, rule rceil); engines per
                layout: quantcli/formats/engines.py
"""

from quantcli.kernels.spec import E4M3, E8M0_SCALE, GROUP, QuantSpec
from quantcli.recipes.base import Recipe

RECIPE = Recipe(name="mxfp8", spec=QuantSpec(GROUP, E4M3, E8M0_SCALE, group=32, scale_rule="even"))
