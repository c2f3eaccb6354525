"""What a calibrated conversion will cost before it runs (`convert --dry-run`): peak memory of the
layer-by-layer engine and its time, from the plan's shapes, the tokenized calibration data and a
matmul timed on this machine (so the estimate is this machine's, not a datasheet's)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from quantcli.calibrate.scales import needs_walk
from quantcli.convert.passes.ordered_sum import group_rows
from quantcli.model.buffer import budget_bytes
from quantcli.model.samples import token_ids
from quantcli.model.stack import text_config
from quantcli.planning.plan import Plan
from quantcli.planning.rounding import GPTQ
from quantcli.planning.rounding_plan import gptq_reaches

CONSTANT = 512 * 2**20  # interpreter, torch, transformers: measured ~0.4-0.5 GiB before any tensor
# A forward runs at a fraction of the bare matmul rate (attention, norms, activations, hooks)
# after a fixed start (importing transformers, building the model on meta): both fitted to
# scripts/bench_calibrate.py on 2 CPU cores (hidden 1024 x 4 and 2048 x 12 layers).
EFFICIENCY = 0.6
START_SECONDS = 5.0


@dataclass(frozen=True)
class CalibrationEstimate:
    samples: int
    tokens: int
    layers: int
    layer_weight_bytes: int  # the largest layer, in FP32 as the engine holds it
    activation_bytes: int  # the hidden states of every sample between two layers (FP32)
    spilled: bool  # above QUANTCLI_CALIBRATION_BUFFER_GIB: memory-mapped from a file instead
    peak_memory_bytes: int
    flops: float  # matmul FLOPs of the forward over every sample and layer
    measured_flops_per_s: float
    seconds: float
    # --rounding gptq: the largest layer's X^T X sums (FP64, one per distinct input) and the
    # solve's working set for the largest K; its FLOPs (a second forward per layer, the sums,
    # the solves) are in `flops` and `seconds`. 0 without GPTQ.
    rounding_bytes: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def estimate(plan: Plan, device: torch.device) -> CalibrationEstimate:
    ids = token_ids(plan.options.calibration, plan.source.root)
    tokens = sum(len(s) for s in ids)
    per_layer: dict[int, int] = {}
    for t in plan.tensors:
        layer = plan.walk.layer_of(t.name) if plan.walk is not None else None
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + t.numel
    config = text_config(plan.source.config)
    layers = plan.walk.layers if plan.walk is not None else int(config.get("num_hidden_layers") or len(per_layer) or 1)
    largest = max(per_layer.values(), default=0)
    hidden = int(config.get("hidden_size") or 0)
    activations = 4 * tokens * hidden
    spilled = activations > budget_bytes()
    batch = max(1, plan.options.calibration.batch) * max((len(s) for s in ids), default=0)
    working = 4 * batch * max(hidden, int(config.get("intermediate_size") or 0)) * 6  # a batch's temporaries
    # The layer's FP32 weights, plus the source tensor being converted (at most one layer's worth).
    peak = CONSTANT + 2 * 4 * largest + (0 if spilled else activations) + working
    flops = 2.0 * tokens * _active_params(per_layer, config) * layers / max(1, len(per_layer))
    forward = flops
    flops = forward if needs_walk(plan) else 0.0  # the calibration walk, when it runs
    rounding_bytes = 0
    if plan.options.rounding.data_aware:
        rounding_bytes, rounding_flops = _gptq_cost(plan, tokens)
        peak += rounding_bytes
        flops += 2 * forward + rounding_flops  # GPTQ's walk runs each layer twice: observed, then quantized
    rate = _matmul_rate(device)
    return CalibrationEstimate(len(ids), tokens, layers, 4 * largest, activations, spilled, peak, flops, rate,
                               START_SECONDS + flops / (rate * EFFICIENCY), rounding_bytes)


def _gptq_cost(plan: Plan, tokens: int) -> tuple[int, float]:
    """(bytes, FLOPs) of GPTQ: per layer one FP64 K x K sum per distinct input (a fused group
    shares one), and per module a Cholesky factorization and inversion (~K^3) and the column
    loop's updates (~2 N K^2); the bytes are the largest layer's sums with the rows waiting for
    their X^T X (ordered_sum.group_rows(K) FP32 rows of K per sum), plus one solve (three K x K
    FP64 matrices) and the weight's FP32 copies."""
    rounding = plan.options.rounding
    solved = [t for t in plan.tensors if t.action == "quantize" and gptq_reaches(plan, t)
              and rounding.method_for(t.module) == GPTQ]
    inputs: dict[int, dict[str, int]] = {}
    flops = 0.0
    for t in solved:
        n, k = t.logical_shape
        layer = plan.walk.layer_of(t.name) if plan.walk is not None else -1
        inputs.setdefault(layer, {})[t.fused_group or t.module] = k
        flops += 2.0 * n * k * k + float(k) ** 3
    sums = max((sum(8 * k * k + 4 * group_rows(k) * k for k in keys.values()) for keys in inputs.values()),
               default=0)
    flops += sum(2.0 * tokens * k * k for keys in inputs.values() for k in keys.values())
    k_max = max((t.logical_shape[-1] for t in solved), default=0)
    nk_max = max((t.numel for t in solved), default=0)
    return sums + 3 * 8 * k_max * k_max + 3 * 4 * nk_max, flops


def _active_params(per_layer: dict[int, int], config: dict) -> float:
    """Weights a token goes through, summed over layers: an MoE token visits top_k of E experts."""
    total = float(sum(per_layer.values()))
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    top_k = int(config.get("num_experts_per_tok") or 0)
    if experts and top_k:
        ffn = 3 * int(config.get("hidden_size", 0)) * int(config.get("moe_intermediate_size")
                                                          or config.get("intermediate_size", 0))
        total -= len(per_layer) * ffn * (experts - top_k)
    return max(total, 0.0)


def _matmul_rate(device: torch.device) -> float:
    """FP32 matmul FLOP/s on `device`, timed for ~0.1 s."""
    a = torch.full((512, 1024), 0.5, device=device)  # values do not change a matmul's speed
    b = torch.full((1024, 1024), 0.25, device=device)
    a @ b  # warm-up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.1:
        a @ b
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2.0 * 512 * 1024 * 1024 * n / (time.perf_counter() - start)
