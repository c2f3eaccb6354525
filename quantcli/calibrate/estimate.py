"""What a calibrated conversion will cost before it runs (`convert --dry-run`): peak memory of the
layer-by-layer engine and its time, from the plan's shapes, the tokenized calibration data and a
matmul timed on this machine (so the estimate is this machine's, not a datasheet's)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from quantcli.calibrate.scales import needs_walk
from quantcli.convert.passes.gptq_pass import GPTQ_PASS, gram_blocks
from quantcli.convert.passes.ordered_sum import group_rows
from quantcli.convert.passes.side_by_side import solve_bytes
from quantcli.convert.passes.weight_walk import walk_threads
from quantcli.formats.facts import NO_FACTS
from quantcli.model.buffer import budget_bytes
from quantcli.model.layers import batches, matmuls_in
from quantcli.model.samples import token_ids
from quantcli.model.stack import text_config
from quantcli.planning.plan import Plan
from quantcli.planning.rounding import GPTQ
from quantcli.planning.rounding_plan import gptq_reaches
from quantcli.rounding.gptq import gptq_quantize

CONSTANT = 512 * 2**20  # interpreter, torch, transformers: measured ~0.4-0.5 GiB before any tensor
# A forward runs at a fraction of the bare matmul rate (attention, norms, activations, hooks)
# after a fixed start (importing transformers, building the model on meta): both fitted to
# scripts/bench_calibrate.py on 2 CPU cores (hidden 1024 x 4 and 2048 x 12 layers).
EFFICIENCY = 0.6
START_SECONDS = 5.0
# H's factorization (calibrate/estimate.py _gptq_seconds): a Cholesky (K^3 / 3 FLOPs) and L^-1 by
# halves (2 K^3 / 3), counted as 2 K^3 at the FP64 matmul rate: LAPACK's Cholesky runs at about a
# third of it (fitted on one CPU thread, scripts/bench_factorize.py and bench_gptq_large_k.py:
# 4.1, 3.2, 1.85 and 1.6 K^3 at K 1024, 2048, 5632 and 18,432; the large K dominate the time).
FACTOR_FLOPS = 2.0
# GPTQ's two forwards against a [rows per batch, hidden] x [hidden, hidden] matmul timed at the
# walk's threads (fitted: docs/gptq.md, "Memory and time"; refitted once the walk's activations
# stopped being fresh mappings (quantcli/memory.py): issue 32's model at full size, forward
# 310.1 s measured against 365.8 s estimated at 0.8; a later dry run, its matmul timed ~10%
# slower, estimated 340.9 s at 0.94).
GPTQ_EFFICIENCY = 0.94
# The same under --gptq-forward bfloat16 (the matmul timed under autocast): the FP32 rest of the
# layer (norms, softmax, activations, the rows' copies) weighs more beside 5x faster matmuls.
# Fitted on the same model: forward 86.7 s measured against 159.8 s estimated at 0.4.
GPTQ_BF16_EFFICIENCY = 0.74


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
    # --rounding gptq: `seconds`' GPTQ terms (the walk's two forwards, the X^T X sums, H's
    # factorizations, the layer-output errors, the column loop), to check against
    # scripts/profile_gptq.py's parts; empty without GPTQ.
    rounding_seconds: dict[str, float] = field(default_factory=dict)

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
    forward = 2.0 * tokens * _active_params(per_layer, config) * layers / max(1, len(per_layer))
    flops = forward if needs_walk(plan) else 0.0  # the calibration walk, when it runs
    rate = _matmul_rate(device)
    seconds = START_SECONDS + flops / (rate * EFFICIENCY)
    rounding_bytes, rounding_seconds = 0, {}
    if plan.options.rounding.data_aware:
        cost = _gptq_cost(plan, tokens, torch.get_num_threads() if device.type == "cpu" else 1)
        rounding_bytes = cost.bytes
        peak += rounding_bytes
        # GPTQ's walk runs each layer twice, observed then quantized, but the last once (its
        # outputs feed nothing; the observed run stops as the last module it observes is reached, a
        # Llama's down_proj: ~10% of the two, not counted), and each once where the next layer's
        # inputs are the source's (--gptq-inputs dense)
        runs = 2 - 1 / max(1, layers) if plan.options.rounding.inputs == "quantized" else 1
        flops += runs * forward + cost.flops
        rows = tokens / max(1, len(batches(ids, plan.options.calibration.batch)))  # per batch, as the walk's rule
        rounding_seconds = _gptq_seconds(plan, cost, runs * forward, device, rows)
        seconds += sum(rounding_seconds.values())
    return CalibrationEstimate(len(ids), tokens, layers, 4 * largest, activations, spilled, peak, flops, rate,
                               seconds, rounding_bytes, rounding_seconds)


@dataclass(frozen=True)
class GptqCost:
    """GPTQ's share, from the plan's shapes: FLOPs of the X^T X sums (`stats`, FP64, in the walk),
    of H's factorizations (FP64, one thread), of the layer-output errors and the column loop's lazy
    updates (FP32, one thread); `modules` [(N, K)] of every module solved (the loop's
    per-column work), `recipe` the most common one's; `bytes` the memory (see _gptq_cost)."""
    bytes: int
    stats: float
    factor: float
    errors: float
    updates: float
    modules: tuple[tuple[int, int], ...]
    recipe: str | None
    side: int = 1  # solves side by side (passes/side_by_side.py: one per CPU thread, at most a layer's Hs)

    @property
    def flops(self) -> float:
        return self.stats + self.factor + self.errors + self.updates


def _gptq_cost(plan: Plan, tokens: int, solvers: int) -> GptqCost:
    """GPTQ's work and memory: per layer one FP64 K x K sum per distinct input (a fused group
    shares one: 2 T K^2 FLOPs for T tokens, less the blocks gram() does not compute) and one
    factorization of it (~K^3); per module the
    column loop (its lazy updates ~N K^2) and the two layer-output errors with H's (two FP32
    products, 4 N K^2: GPTQ's own error comes from its loop); the bytes are the largest layer's
    sums with the rows waiting for their X^T X (ordered_sum.group_rows(K) FP32 rows of K per
    sum), plus the largest solve
    (side_by_side.solve_bytes: its K x K matrices and the weight's FP32 copies) for each of the
    `solvers` solves side by side (at most as many as a layer has distinct inputs; fewer where
    memory is short, which the estimate does not assume)."""
    rounding = plan.options.rounding
    solved = [t for t in plan.tensors if t.action == "quantize" and gptq_reaches(plan, t)
              and rounding.method_for(t.module) == GPTQ]
    inputs: dict[int, dict[str, int]] = {}
    for t in solved:
        layer = plan.walk.layer_of(t.name) if plan.walk is not None else -1
        inputs.setdefault(layer, {})[t.fused_group or t.module] = t.logical_shape[-1]
    sums = max((sum(8 * k * k + 4 * group_rows(k) * k for k in keys.values()) for keys in inputs.values()),
               default=0)
    distinct = [k for keys in inputs.values() for k in keys.values()]
    modules = tuple((t.logical_shape[0], t.logical_shape[1]) for t in solved if len(t.logical_shape) == 2)
    counted = Counter(t.recipe for t in solved)
    side = max(1, min(solvers, max((len(keys) for keys in inputs.values()), default=1)))
    solve = max((solve_bytes(t.logical_shape) for t in solved), default=0)
    return GptqCost(sums + side * solve,
                    sum(tokens * k * k * (1 + 1 / gram_blocks(k)) for k in distinct),
                    sum(FACTOR_FLOPS * float(k) ** 3 for k in distinct),
                    sum(4.0 * n * k * k for n, k in modules), sum(float(n) * k * k for n, k in modules),
                    modules, counted.most_common(1)[0][0] if counted else None, side)


def _gptq_seconds(plan: Plan, cost: GptqCost, forward: float, device: torch.device,
                  rows: float) -> dict[str, float]:
    """Seconds of GPTQ's walk and solves by part, each term at the rate it runs at here: the two forwards
    and the sums at the walk's threads (weight_walk.walk_threads: one for small batches), the
    solves on one thread each, `side` at a time (FP64 factorizations, FP32 errors), and the
    column loop (its lazy updates at the FP32 rate; not divided among the side-by-side solves:
    divided, the estimate came 1.17-1.36x under measured runs, undivided 0.99-1.19x)
    at its per-column cost, timed on this machine by running the recipe's own loop on two small
    weights (a fixed cost per column plus one per row)."""
    hidden = int(text_config(plan.source.config).get("hidden_size") or 1024)
    autocast = GPTQ_PASS.matmul_dtype(plan)  # --gptq-forward
    with walk_threads(device, rows, plan.source.config):  # at the walk's own shapes: a batch's rows x hidden
        walk32 = _matmul_rate(device, duration=0.1, shape=(rows, hidden, hidden), autocast=autocast)  # and X^T X
        walk64 = _matmul_rate(device, torch.float64, duration=0.1, shape=(hidden, min(512, group_rows(hidden)), hidden))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as compute_threads runs the solves
    try:
        one64 = _matmul_rate(device, torch.float64, duration=0.05)
        per_column, per_row = _column_cost(plan, cost.recipe, device) if cost.recipe else (0.0, 0.0)
    finally:
        torch.set_num_threads(previous)
    loop = cost.updates / (2 * one64) + sum(k * (per_column + per_row * n) for n, k in cost.modules)
    efficiency = GPTQ_EFFICIENCY if autocast is None else GPTQ_BF16_EFFICIENCY
    return {"forward": forward / (walk32 * efficiency), "statistics": cost.stats / walk64,
            "factorization": cost.factor / one64 / cost.side, "output_errors": cost.errors / (2 * one64) / cost.side,
            "column_loop": loop}  # Python per column, holding the GIL much of the time


def _column_cost(plan: Plan, recipe: str, device: torch.device) -> tuple[float, float]:
    """(seconds per column, seconds per column and row) of GPTQ's loop in `recipe` on this
    machine: gptq_quantize of a [128, K] and a [1024, K] weight, K = one block of columns (its
    other work, the factorization and output errors of a K x K H, is negligible there)."""
    settings = plan.options.rounding.gptq
    k = settings.block_columns
    h = torch.eye(k, dtype=torch.float64, device=device) * 4 + 1  # values do not change the loop's speed
    times = []
    for n in (128, 128, 1024):  # the first is a warm-up
        w = torch.full((n, k), 0.5, device=device).add_(torch.arange(k, device=device) / k)
        start = time.perf_counter()
        gptq_quantize("estimate", w, h, plan.recipes[recipe], NO_FACTS, settings, "auto")
        times.append(time.perf_counter() - start)
    per_row = max(0.0, times[2] - times[1]) / (1024 - 128) / k
    return max(0.0, times[1] / k - 128 * per_row), per_row


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


def _matmul_rate(device: torch.device, dtype: torch.dtype = torch.float32, duration: float = 0.1,
                 shape: tuple[int, int, int] = (512, 1024, 1024), autocast: torch.dtype | None = None) -> float:
    """Matmul FLOP/s on `device` of an [m, k] x [k, n] `shape` in `dtype` (FP32: a forward's; FP64:
    GPTQ's sums and solves), under torch.autocast to `autocast` if given (--gptq-forward bfloat16:
    the activations cast on each call, the weights once, as the walk does), timed for ~`duration` s at
    torch's current thread count: one window, not the best of several (a walk on two threads of a
    shared CPU stalls as often as the window does; with the best of three windows the GPTQ
    estimate fell to 0.4-0.5x the time, docs/gptq.md)."""
    m, k, n = (max(1, int(x)) for x in shape)
    a = torch.full((m, k), 0.5, device=device, dtype=dtype)  # values do not change a matmul's speed
    b = torch.full((k, n), 0.25, device=device, dtype=autocast or dtype)  # the walk casts weights once a run
    with matmuls_in(autocast, device):
        a @ b  # warm-up
        count, start = 0, time.perf_counter()
        while count == 0 or time.perf_counter() - start < duration:
            a @ b
            count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 2.0 * m * k * n * count / (time.perf_counter() - start)
