"""What the shard job does with each source tensor (`TensorPlan.action`)."""

from __future__ import annotations

from enum import StrEnum


class Action(StrEnum):
    """What the shard job does with a source tensor."""

    COPY = "copy"  # passed through byte for byte
    QUANTIZE = "quantize"  # a dense weight, quantized with its recipe
    RELAYOUT = "relayout"  # a quantized weight's codes and scales, renamed and reshaped
    REQUANTIZE = "requantize"  # a quantized weight, decoded and quantized with another recipe
    DEQUANTIZE = "dequantize"  # a quantized weight, decoded to a dense dtype
    TRANSFORM = "transform"  # a dense tensor an exact transform changes (planning/transforms.py), in its dtype
