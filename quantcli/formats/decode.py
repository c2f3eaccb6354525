"""Decode quantized modules of any supported layout back to FP32 (verify, inspect --stats, convert)."""

from __future__ import annotations

import torch

from quantcli.formats.layouts import Layout
from quantcli.recipes import QuantizedTensor, Recipe


def decode_module(layout: Layout, module: str, recipe: Recipe, q: QuantizedTensor, *,
                  transpose: bool = False, backend: str = "auto", device: torch.device | None = None) -> torch.Tensor:
    """FP32 weight of `module`; `transpose` returns a [E, N, K] expert stack as [E, K, N]."""
    if device is not None:
        q = q.to(device)
    w = recipe.dequantize(q, backend=backend)
    return w.transpose(-1, -2) if transpose else w
