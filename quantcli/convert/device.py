"""Where the arithmetic runs: the torch device and the kernel backend, checked before any work."""

from __future__ import annotations

import torch

from quantcli.convert.records import RunOptions
from quantcli.errors import QuantcliError
from quantcli.kernels import resolve_backend


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise QuantcliError(f"--device {device!r}: not a device; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise QuantcliError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise QuantcliError(f"--device {device}: only cpu and cuda are supported")
    return dev


def check_run_options(run: RunOptions) -> None:
    """The device and the kernel backend can run here: found before anything is written."""
    device = resolve_device(run.device)
    try:
        resolve_backend(run.backend, device)
    except (RuntimeError, ValueError) as exc:
        raise QuantcliError(f"--backend {run.backend}: cannot run on {device.type} here ({exc}); "
                            f"use --backend torch") from None
