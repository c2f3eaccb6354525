"""Facts about a module that a pass over the checkpoint learns before its shard is written.

Convert runs passes that produce facts (the shared amax of each fused group; with --calibration
the calibrated activation and KV-cache scales and the per-channel input statistics that weight a
scale search; quantcli/convert/passes/), then writes each shard as a pure
function of (plan, shard, facts). Recipes read the facts they need to quantize a weight;
layouts read the ones they write as extra tensors (an activation `input_scale`, `k_scale`).
A fact that is absent means "not known": the recipe falls back to the weight alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the command line reads CALIBRATION_SAMPLES, and --help should not load torch
    import torch


@dataclass(frozen=True)
class ModuleFacts:
    # max |w| over the module's fused group (q/k/v, gate/up, ...): one NVFP4 global scale for the
    # group, as the engines that fuse the GEMM require (docs/formats.md,
    # "Fused groups share one global scale"). None: the module's own amax.
    group_amax: torch.Tensor | None = None
    # Calibrated (quantcli/calibrate), multipliers: the activation scale of a static-activation
    # recipe (amax_x / 448 for FP8, amax_x / 2688 for NVFP4, shared across the fused group) and
    # the FP8 KV-cache scales amax / 448, carried by the k_proj (k_scale) and v_proj (v_scale).
    input_scale: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # Calibrated mean squared input per channel, diag(X^T X) / N: FP32 [in_features]. With
    # --scale-search mse it weights each input channel's error (kernels/search.py).
    input_channel_ms: torch.Tensor | None = None
    # What the user must know about how a fact was found (an MoE expert no calibration token
    # reached took its block's max): reported in the summary and the manifest's notes.
    note: str | None = None


# --calibration-samples' default: a cap, so that the whole of an ordinary calibration file is used
# (it once kept the first 128, dropping a third of a 190-sample file); llm-compressor's
# num_calibration_samples defaults to 512 too.
CALIBRATION_SAMPLES = 512


@dataclass(frozen=True)
class Calibration:
    """What `--calibration` asks for: the data file and how much of it to run (`samples`: at most)."""

    data: str
    samples: int = CALIBRATION_SAMPLES
    seq_len: int = 512
    batch: int = 1


NO_FACTS = ModuleFacts()
