"""Exhaustive check of kernels/search.py's fast element rounding against the definition: every
non-negative FP32 value (and +inf), E2M1 (doubled: from t = 2y) and E4M3. About 2 minutes per
element type on one core.

    python scripts/check_scale_search_grid.py [e2m1|e4m3]
"""

from __future__ import annotations

import sys

import torch

from quantcli.kernels import reference as R
from quantcli.kernels import search

STEP = 1 << 24
INF_BITS = 0x7F800000


def definition(y: torch.Tensor, element: str) -> torch.Tensor:
    if element == "e4m3":
        return R.decode_e4m3(R.encode_e4m3(y))
    inv = torch.where(y < 2.0, 2.0, torch.where(y < 4.0, 1.0, 0.5))
    return torch.floor(y * inv + 0.5).div_(inv).clamp_max_(6.0)


def fast(y: torch.Tensor, element: str) -> torch.Tensor:
    scratch = torch.empty(y.shape, dtype=torch.int32)
    if element == "e4m3":
        return search.e4m3_grid_(y.clone(), scratch)
    return search.e2m1_grid_x2_(y * 2, scratch) * 0.5  # 2y overflows to inf for y > 1.7e38: covered


def mismatches(element: str) -> int:
    bad = 0
    for lo in range(0, INF_BITS + 1, STEP):
        y = torch.arange(lo, min(lo + STEP, INF_BITS + 1), dtype=torch.int32).view(torch.float32)
        diff = definition(y.clone(), element).view(torch.int32) != fast(y, element).view(torch.int32)
        if bool(diff.any()):
            bad += int(diff.sum())
            print(f"{element}: first mismatch at bits {int(y.view(torch.int32)[diff][0]):#010x}")
    return bad


def main() -> None:
    torch.set_num_threads(1)
    for element in sys.argv[1:] or ("e2m1", "e4m3"):
        print(f"{element}: {mismatches(element)} mismatches over every non-negative FP32 value and +inf")


if __name__ == "__main__":
    main()
