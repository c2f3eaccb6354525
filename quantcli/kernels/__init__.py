"""The single dispatch point for quantize/dequantize: `backend = auto | torch | triton`.

`kernels.reference` (pure torch, CPU or GPU), `kernels.cpu` (the reference's arithmetic in
place) and `kernels.triton_quant` share one signature. `auto` picks Triton for CUDA tensors when
Triton imports; otherwise the torch backend runs, as `kernels.cpu` for CPU tensors and as the
reference on a GPU. This package is the only place that imports triton, and only when the
Triton backend is actually used, so the CLI and the CPU path never pay for it. `search` imports
this package (its reference), so it is imported when a scale search runs.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from quantcli.kernels import cpu, reference
from quantcli.kernels.reference import cpu_workers
from quantcli.kernels.spec import NonFiniteInput, QuantResult, QuantSpec

BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS", "NonFiniteInput", "QuantResult", "QuantSpec", "cpu_workers", "dequantize", "quantize",
           "resolve_backend", "tensor_amax", "triton_available"]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Name the implementation that will run: 'torch' or 'triton'."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend 'triton' needs the triton package: pip install triton")
        if device.type != "cuda" and not _interpreted():
            raise RuntimeError(
                "backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to run the kernels "
                "on the CPU through the interpreter)")
    return backend


def _impl(backend: str, device: torch.device) -> ModuleType:
    if resolve_backend(backend, device) == "triton":
        from quantcli.kernels import triton_quant

        return triton_quant
    return cpu if device.type == "cpu" else reference


def quantize(x: torch.Tensor, spec: QuantSpec, global_amax: torch.Tensor | None = None,
             backend: str = "auto", channel_weight: torch.Tensor | None = None) -> QuantResult:
    """`channel_weight` [K]: per input channel weights of a scale search's error (mean squared
    activation); ignored unless `spec.scale_search` is set."""
    impl = _impl(backend, x.device)
    if not spec.scale_search.active:
        return impl.quantize(x, spec, global_amax)
    if impl in (cpu, reference):
        from quantcli.kernels import search

        return search.quantize(x, spec, global_amax, channel_weight)
    return impl.quantize(x, spec, global_amax, channel_weight)


def dequantize(q: QuantResult, spec: QuantSpec, shape: tuple[int, ...], backend: str = "auto") -> torch.Tensor:
    return _impl(backend, q.codes.device).dequantize(q, spec, tuple(shape))


def tensor_amax(x: torch.Tensor, backend: str = "auto", *, name: str | None = None) -> torch.Tensor:
    """Max |x| as FP32 0-d. NaN/Inf raise NonFiniteInput (a RecipeError) naming `name`, the
    tensor's checkpoint name, when given (callers such as the fused-group pass should give it)."""
    try:
        return _impl(backend, x.device).tensor_amax(x)
    except NonFiniteInput:
        if name is None:
            raise
        raise NonFiniteInput(name) from None
