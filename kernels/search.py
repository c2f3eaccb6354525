"""Scale search (`QuantSpec.scale_search = "mse"`), the pure-torch reference; the Triton twin is
the candidate loop in triton_quant._group_kernel, byte for byte.

The on-disk formats leave one freedom that absmax producers do not use: which scale code each
block gets. Here each block tries a few codes around the absmax one and keeps the one whose
dequantized block is closest to the weights (squared error, each input channel weighted by its
mean squared activation when calibration statistics are given). The element codes are then the
ordinary RNE codes given the chosen scale, so every decoder reproduces the values.

- NVFP4 (E4M3 block scale x FP32 global): the absmax code, then codes -3..-1 and +1..+7 around it
  (E4M3 codes of positive values are monotone, so code + d is the d-th neighbouring scale);
  the global scale stays amax / 2688, shared across fused groups.
- MX (E8M0): the layout rule's exponent e, then e + 1, then e - 1.

The error criterion is defined op by op so both backends compute the same FP32 numbers (and so
pick the same code): y = |x| / den; r = y on the element grid (E2M1: floor(y * inv + 0.5) / inv
with inv = 2, 1, 1/2 below 2, 4, 6, then at most 6; E4M3: decode(encode(y))); d = r * den - |x|;
e = d * d (* w); the block sum adds halves (e[:h] + e[h:]) until one value is left. A candidate
replaces the best only if strictly smaller, so ties keep the absmax code, then the earlier
candidate. An all-zero block errs 0 everywhere and keeps the absmax code.
"""

from __future__ import annotations

import torch

from . import reference as R
from .spec import E8M0_MAX_FINITE_BYTE, QuantResult, QuantSpec

# Tried after the absmax code, in this order (the window a full 126-code sweep never left).
NVFP4_WINDOW = (-3, -2, -1, 1, 2, 3, 4, 5, 6, 7)
MX_WINDOW = (1, -1)
E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN
E4M3_MIN_CODE = 1  # 2^-9; code 0 would be a zero scale


def window(spec: QuantSpec) -> tuple[int, ...]:
    return NVFP4_WINDOW if spec.scale.has_global else MX_WINDOW


def code_range(spec: QuantSpec) -> tuple[int, int]:
    """The scale codes a candidate may take: E4M3 1..126, E8M0 0..the last finite byte."""
    if spec.scale.has_global:
        return E4M3_MIN_CODE, E4M3_MAX_CODE
    return 0, E8M0_MAX_FINITE_BYTE[spec.element.name]


def on_grid(y: torch.Tensor, element: str) -> torch.Tensor:
    """The element magnitude nearest y >= 0 (ties up: the error is the same either way)."""
    if element == "e4m3":
        return R.decode_e4m3(R.encode_e4m3(y))
    inv = torch.where(y < 2.0, 2.0, torch.where(y < 4.0, 1.0, 0.5))
    return torch.floor(y * inv + 0.5).div_(inv).clamp_max_(6.0)


def halves_sum(e: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) in a fixed order: halves added until one is left."""
    while e.shape[-1] > 1:
        h = e.shape[-1] // 2
        e = e[..., :h] + e[..., h:]
    return e[..., 0]


def block_error(ax: torch.Tensor, den: torch.Tensor, element: str, weight: torch.Tensor | None) -> torch.Tensor:
    """Squared error of each block [..., B, G] of magnitudes `ax` quantized with the scales `den` [..., B]."""
    dd = den.unsqueeze(-1)
    d = on_grid(ax / dd, element).mul_(dd).sub_(ax)
    e = d.mul_(d)
    return halves_sum(e if weight is None else e.mul_(weight))


def decode_code(code: torch.Tensor, spec: QuantSpec, s2: torch.Tensor | None) -> torch.Tensor:
    """The FP32 divisor of a scale code (as reference.encode_scale forms it)."""
    if spec.scale.has_global:
        return R.decode_e4m3(code.to(torch.uint8)) * s2
    return R.e8m0_to_float(code.to(torch.uint8))


def search_codes(ax: torch.Tensor, code0: torch.Tensor, den0: torch.Tensor, spec: QuantSpec,
                 s2: torch.Tensor | None, weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(best scale code, its divisor) per block, starting from the absmax code `code0`."""
    lo, hi = code_range(spec)
    element = spec.element.name
    base = code0.to(torch.int32)
    best, best_den = base, den0
    best_err = block_error(ax, den0, element, weight)
    for step in window(spec):
        cand = base + step
        valid = (cand >= lo) & (cand <= hi)
        cand = cand.clamp(lo, hi)
        den = decode_code(cand, spec, s2)
        err = block_error(ax, den, element, weight)
        better = valid & (err < best_err)
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, cand, best)
        best_den = torch.where(better, den, best_den)
    return best.to(torch.uint8), best_den


def _group_chunk(x: torch.Tensor, spec: QuantSpec, s2, weight: torch.Tensor | None) -> QuantResult:
    g = R._groups(x, spec.group)
    ax = g.abs()
    amax = R._check_finite(ax.amax(dim=-1))
    code0, den0 = R.encode_scale(amax, spec, s2)
    stored, den = search_codes(ax, code0, den0, spec, s2, weight)
    return QuantResult(R.encode_elements((g / den.unsqueeze(-1)).reshape(x.shape), spec.element), stored)


def channel_weight_groups(weight: torch.Tensor | None, k: int, group: int, device) -> torch.Tensor | None:
    """Per input channel weights [K] (mean squared activation) as [K / G, G] FP32, or None."""
    if weight is None:
        return None
    weight = weight.reshape(-1)
    if weight.numel() != k:
        raise ValueError(f"channel weights have {weight.numel()} entries, the weight has K = {k}")
    return weight.to(device=device, dtype=torch.float32).reshape(k // group, group)


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None,
             channel_weight: torch.Tensor | None = None) -> QuantResult:
    """reference.quantize with the searched block scales (group geometry)."""
    if x.numel() == 0:
        return R.empty_result(x, spec, global_amax)
    s2 = R.global_scale_for(x, spec, global_amax)
    w = channel_weight_groups(channel_weight, x.shape[-1], spec.group, x.device)
    r = R._chunked(x, 1, lambda c: _group_chunk(c.to(torch.float32), spec, s2, w))
    return QuantResult(r.codes, r.scale, s2)
