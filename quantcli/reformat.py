"""Convert from quantized sources: lossless re-layout, dequantize to a dense dtype, re-quantize."""

from __future__ import annotations

from .detect import Detected, detect
from .errors import QuantcliError
from .plan import Options, Plan, make_plan
from .source import Source


def detect_quantized(source: Source) -> Detected | None:
    found = detect(source)
    return found if found is not None and found.modules else None


def plan_for(source: Source, opts: Options, detected: Detected | None) -> Plan:
    if detected is None:
        if opts.recipe in ("bf16", "fp16", "fp32"):
            raise QuantcliError(f"--recipe {opts.recipe}: the source {source.label} is not quantized; "
                                f"nothing to dequantize")
        return make_plan(source, opts)
    raise QuantcliError(f"{source.label}: is already quantized ({detected.layout.name}); converting quantized "
                        f"sources is not supported yet")
