"""The one refusal every codec shares: a tensor that holds NaN or Inf is never quantized.

It sits below the codecs (elements.py, scales.py) so that they and the quantizers can all raise
it without importing each other."""

from __future__ import annotations

import math

import torch

from quantcli.errors import RecipeError


class NonFiniteInput(RecipeError, ValueError):
    """The tensor to quantize holds NaN or Inf. The kernels raise it unnamed (they do not know
    the name), as the bare fact "holds NaN or Inf values" that a caller may put in its own
    sentence; `NonFiniteInput(name)` is the whole one-line error naming the tensor and the fix.
    Unnamed it still exits 2 with one line (a RecipeError)."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        fact = "holds NaN or Inf values"
        super().__init__(fact if name is None else
                         f"{name}: {fact}; quantizing would corrupt it. Fix the source weight or add it to --ignore")


def check_finite(amax: torch.Tensor) -> torch.Tensor:
    """amax propagates NaN and Inf, so a finite amax proves its whole block finite, and the max
    of the block amaxes (NaN propagates through max too) proves every block: one small reduction
    and a Python float, instead of an isfinite pass and an all() over the block amaxes."""
    if amax.numel() and not math.isfinite(float(amax.max())):
        raise NonFiniteInput()
    return amax
