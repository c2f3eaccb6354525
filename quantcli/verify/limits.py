"""How far a decoded tensor may be from its reference: the measured tolerance, the metrics and
the --threshold overrides."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantcli.errors import QuantcliError, did_you_mean

METRICS = ("rel_err", "sqnr_db", "cosine", "margin")
ABS_FLOOR = 1e-6  # slack for tensors whose own error is ~0 (exactly representable weights)

# How much worse (relative L2 error) than quantcli's own quantization of the same reference tensor
# a decoded tensor may be where that is the question asked: a module re-quantized from a quantized
# source, checked against the dense model (compare.requantized_bound), and any module under
# --threshold margin=. Every other module is judged by judge.py. Real producers round differently
# (BF16 intermediates, scales stored in BF16, other element tie rules); corruptions land far off.
# Measured with the producers' own code (tests/test_faults_verify.py builds the same checkpoints)
# on 300 tensors per producer: normal,
# Student-t(3), outlier rows/columns, amax > 2688 (s2 > 1), FP16 and FP32 sources; shapes [1, 32]
# to [512, 128]. Ratio = rel err / quantcli's own; corruptions: min over all sizes / over tensors of
# >= 16k elements. ModelOpt's NVFP4 and FP8 arithmetic is quantcli's own (ratio 1, bit-exact).
#
#   recipe (producer)     producers max   corruption min ratio (all / >= 16k elements)
#   nvfp4 (CT)            1.033 [2,256]   nibbles swapped 12/14.8, scales transposed 2.3/3.5,
#                                         scales shifted 1.01*/3.5, scale x2 1.14*/8.6, global
#                                         inverted 1.17*/5.3, codes of another tensor 12.7/14.1,
#                                         E4M3 scale byte -1 0.91*/1.29 (+1: 1.02*/1.44)
#   nvfp4 (CT, fused)     1.021 [2,256]   nibbles 13.7, transposed 2.9, shifted 1.8, x2 9.4,
#                                         global inverted 9.0, other codes 11.9
#   mxfp4 (CT, even)      1.000           nibbles 8.3, transposed 2.9, shifted 3.1, exponent +1 5.9,
#                                         exponent -1 2.7, other codes 9.0
#   mxfp4 (ModelOpt)      1.000           nibbles 5.7, transposed 2.2, shifted 1.9, exponent +1 3.6,
#                                         exponent -1 2.7, other codes 8.7
#   mxfp8 (CT)            1.000           transposed 11.3, shifted 12, exponent +1 23.6, -1 13.3
#   fp8-block (CT, BF16)  1.060 [2,256]   transposed 1.01*/1.01*, shifted 1.26, scale x2 36,
#                                         x1.125 4.6, other codes 37.5
#   fp8-channel (CT,BF16) 1.160 [1,32]    shifted 3.4, x2 33, x1.125 4.0, other codes 36
#   fp8-channel (ModelOpt)1.000           shifted 1.04*/4.5, x2 34, x1.125 4.4, other codes 37
#
# * below the bound only where the corruption barely changes the decoded weights: permuting
#   near-equal block scales (2-block tensors, i.i.d. random blocks), inverting a global with s2 ~ 1,
#   or one E4M3 mantissa step on tensors under ~1k elements; such a tensor decodes within the
#   producers' own spread, which no error comparison can tell from a correct one.
#
# Producers' excess shrinks with tensor size (a few blocks rounded differently weigh more in a small
# tensor), so the allowed margin is a floor plus a term that fades with size:
#     margin = TOLERANCE_FLOOR + TOLERANCE_NOISE / sqrt(max(1, numel / 128))
# 10 % for large tensors, 35 % at [2, 256], 60 % at [1, 32]: above every producer with room
# (x3 or more their excess), below every corruption that changes the decoded weights.
TOLERANCE_FLOOR = 0.10
TOLERANCE_NOISE = 0.5


def allowed_margin(numel: int) -> float:
    return TOLERANCE_FLOOR + TOLERANCE_NOISE / math.sqrt(max(1.0, numel / 128))


@dataclass
class Limits:
    margin: float | None = None  # --threshold margin=: for every module; None: re-quantized modules only,
    # by allowed_margin
    rel_err: float | None = None  # absolute cap, if given
    sqnr_db: float | None = None  # minimum
    cosine: float | None = None  # minimum


# metric -> (whether a value is in range, the range in words)
RANGES = {"margin": (lambda v: v >= 0, "0 or more"), "rel_err": (lambda v: v > 0, "more than 0"),
          "cosine": (lambda v: 0 < v <= 1, "in (0, 1]"), "sqnr_db": (lambda v: True, "a finite number of dB")}


def parse_thresholds(items: list[str]) -> Limits:
    limits = Limits()
    for item in items:
        key, _, value = item.partition("=")
        if key not in METRICS or not value:
            hint = did_you_mean(key, METRICS) if key not in METRICS else ""
            raise QuantcliError(f"--threshold {item!r}: write METRIC=VALUE with METRIC one of "
                                f"{', '.join(METRICS)}{hint}")
        try:
            number = float(value)
        except ValueError:
            raise QuantcliError(f"--threshold {item!r}: {value!r} is not a number") from None
        ok, words = RANGES[key]
        if not math.isfinite(number) or not ok(number):
            allowed = words if math.isfinite(number) else "a finite number"
            raise QuantcliError(f"--threshold {item!r}: {key} must be {allowed}, got {value}; "
                                f"give a value in range")
        setattr(limits, key, number)
    return limits


def metrics(decoded: torch.Tensor, ref: torch.Tensor) -> dict:
    """rel_err, sqnr_db, cosine, max_abs of `decoded` against `ref` (the first fields of a TensorRow)."""
    d, r = decoded.double().flatten(), ref.double().flatten()
    err = (d - r).norm()
    rn = r.norm()
    rel = float(err / rn) if rn > 0 else float(err)
    sqnr = float(20 * torch.log10(rn / err)) if err > 0 and rn > 0 else math.inf
    cos = float(torch.nn.functional.cosine_similarity(d, r, dim=0)) if rn > 0 and d.norm() > 0 else 1.0
    return {"rel_err": rel, "sqnr_db": sqnr, "cosine": cos, "max_abs": float((d - r).abs().max()) if d.numel() else 0.0}


def absolute_limits(row, limits: Limits) -> list[str]:
    """The --threshold caps a row exceeds, one reason each."""
    reasons = []
    if limits.rel_err is not None and row.rel_err > limits.rel_err:
        reasons.append(f"relative error {row.rel_err:.4g} > {limits.rel_err}")
    if limits.sqnr_db is not None and row.sqnr_db < limits.sqnr_db:
        reasons.append(f"SQNR {row.sqnr_db:.2f} dB < {limits.sqnr_db}")
    if limits.cosine is not None and row.cosine < limits.cosine:
        reasons.append(f"cosine {row.cosine:.6f} < {limits.cosine}")
    return reasons
