"""Quantize-dequantize of activations and of the KV cache, as a checkpoint declares them.

The arithmetic is compressed-tensors' fake-quantize (`quantization/lifecycle/forward.py`,
`_quantize_dequantize`; scales from `utils/helpers.py` `calculate_qparams`), the forward that
llm-compressor and transformers run for these schemes, in FP32:

- FP8 (E4M3): `q = cast_e4m3(clamp(x / s, -448, 448))`, `x' = q * s`; dynamic scales are
  `s = amax / 448` per token (row), per 1 x G group of a row, or per call (the whole tensor), a
  zero amax giving FP32 eps; static scales are the checkpoint's `input_scale` (a multiplier).
- INT8: the same with `s = amax / 127.5` (compressed-tensors' symmetric range 255 / 2), round
  half to even, clamp to [-128, 127].
- NVFP4 (W4A4): per 1 x 16 block `sb = cast_e4m3(gs * (amax / 6))` (0 becomes E4M3 eps 0.125),
  `e = sb / gs`, `q = e2m1(x / e)` (round to nearest, ties to the even code, saturating at 6),
  `x' = q * e`, with `gs` the global divisor: compressed-tensors' `input_global_scale`, or
  1 / ModelOpt's `input_scale`.
- MXFP8 / MXFP4 (dynamic MX activations): per 1 x 32 block of a row (a last partial block is its
  own), the E8M0 scale `2^e` from the block amax by the declared exponent rule (kernels/scales.py
  ScaleRule: `even` for compressed-tensors, `rceil` for ModelOpt and Triton's `downcast_to_mxfp`),
  `x' = nearest(x / 2^e) * 2^e` with the element's own rounding (E4M3 saturating, E2M1 ties to
  the even code, saturating at 6); an all-zero block stays zero.
Engines' fused kernels compute the same quantities; a kernel that multiplies by a reciprocal
where this divides can differ in the last bit of a scale (docs/cli.md, "quantcli eval").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantcli.kernels.elements import ELEMENTS
from quantcli.kernels.reference import decode_e2m1, encode_e2m1
from quantcli.kernels.scales import e8m0_byte, e8m0_to_float
from quantcli.model.cache import PassThroughCache

MX_BLOCK = 32
E4M3_MAX = 448.0
INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2
E2M1_MAX = 6.0
E4M3_EPS = 0.125  # torch.finfo(float8_e4m3fn).eps: compressed-tensors' stand-in for a zero block scale
F32_EPS = torch.finfo(torch.float32).eps


def _cast_e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def _dynamic(amax: torch.Tensor, half_range: float) -> torch.Tensor:
    s = amax / half_range
    return torch.where(s == 0, torch.full_like(s, F32_EPS), s)


def qdq_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize with `scale` (broadcast against x)."""
    return _cast_e4m3(x / scale) * scale


def qdq_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round((x / scale).clamp(-128, 127)) * scale


def fp8_per_token(x: torch.Tensor) -> torch.Tensor:
    return qdq_fp8(x, _dynamic(x.abs().amax(-1, keepdim=True), E4M3_MAX))


def fp8_per_tensor(x: torch.Tensor) -> torch.Tensor:
    return qdq_fp8(x, _dynamic(x.abs().amax(), E4M3_MAX))


def fp8_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per 1 x `group` block of each row; a last partial block is its own group."""
    k = x.shape[-1]
    pad = -k % group
    g = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, group))
    out = qdq_fp8(g, _dynamic(g.abs().amax(-1, keepdim=True), E4M3_MAX))
    return out.flatten(-2)[..., :k]


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    return qdq_int8(x, _dynamic(x.abs().amax(-1, keepdim=True), INT8_HALF_RANGE))


def nvfp4(x: torch.Tensor, global_divisor: float) -> torch.Tensor:
    """NVFP4 activations: dynamic 1 x 16 E4M3 block scales under the static global divisor."""
    gs = torch.tensor(global_divisor, dtype=torch.float32, device=x.device)
    g = x.unflatten(-1, (-1, 16))
    sb = _cast_e4m3(gs * (g.abs().amax(-1, keepdim=True) / E2M1_MAX))
    sb = torch.where(sb == 0, torch.full_like(sb, E4M3_EPS), sb)
    e = sb / gs
    q = decode_e2m1(encode_e2m1((g / e).contiguous()))
    return (q * e).flatten(-2)


def mx(x: torch.Tensor, element: str, rule: str) -> torch.Tensor:
    """MX activations: dynamic 1 x 32 E8M0 block scales by `rule`, `element` codes (e4m3 | e2m1)."""
    codec = ELEMENTS[element]
    k = x.shape[-1]
    g = torch.nn.functional.pad(x, (0, -k % MX_BLOCK)).unflatten(-1, (-1, MX_BLOCK))
    scale = e8m0_to_float(e8m0_byte(g.abs().amax(-1, keepdim=True), codec, rule))
    return (codec.nearest(g / scale) * scale).flatten(-2)[..., :k]


MX_ELEMENTS = {"mxfp8": "e4m3", "mxfp4": "e2m1"}


@dataclass(frozen=True)
class ActQuant:
    """How one module's input is quantized: `kind` and its static number, if any."""

    kind: str  # fp8-static | fp8-token | fp8-group | fp8-tensor | int8-token | nvfp4 | mxfp8 | mxfp4
    value: float = 0.0  # fp8-static: the scale (multiplier); nvfp4: the global divisor
    group: int = 0  # fp8-group
    rule: str = ""  # mxfp8 / mxfp4: the E8M0 exponent rule (floor | even | rceil)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.float32)
        if self.kind == "fp8-static":
            return qdq_fp8(x, torch.tensor(self.value, dtype=torch.float32, device=x.device))
        if self.kind == "fp8-token":
            return fp8_per_token(x)
        if self.kind == "fp8-group":
            return fp8_per_group(x, self.group)
        if self.kind == "fp8-tensor":
            return fp8_per_tensor(x)
        if self.kind == "int8-token":
            return int8_per_token(x)
        if self.kind in MX_ELEMENTS:
            return mx(x, MX_ELEMENTS[self.kind], self.rule)
        return nvfp4(x, self.value)

    @property
    def label(self) -> str:
        return {"fp8-static": "FP8 static per-tensor input scale", "fp8-token": "FP8 dynamic per token",
                "fp8-group": f"FP8 dynamic per 1x{self.group} group", "fp8-tensor": "FP8 dynamic per tensor",
                "int8-token": "INT8 dynamic per token",
                "nvfp4": "NVFP4 W4A4 (static global scale, dynamic 1x16 E4M3 block scales)",
                "mxfp8": f"MXFP8 dynamic 1x32 E8M0 blocks (rule {self.rule})",
                "mxfp4": f"MXFP4 dynamic 1x32 E8M0 blocks (rule {self.rule})"}[self.kind]


class KvQuantCache(PassThroughCache):
    """Stands in for a transformers Cache: the keys and values the attention stores come back
    quantize-dequantized to FP8 E4M3 with the attention's k_scale / v_scale (static, per tensor:
    what an FP8 KV cache holds and the attention then reads)."""

    def __init__(self, k_scale: float, v_scale: float):
        self.k_scale, self.v_scale = k_scale, v_scale

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        k = qdq_fp8(key_states.to(torch.float32), torch.tensor(self.k_scale, device=key_states.device))
        v = qdq_fp8(value_states.to(torch.float32), torch.tensor(self.v_scale, device=value_states.device))
        return k.to(key_states.dtype), v.to(value_states.dtype)
