"""`--rounding gptq`: the weight pass that rounds each Linear of the decoder layers by GPTQ
(quantcli/rounding/gptq.py) from H = X^T X of the calibration inputs reaching it, layer by
layer on the walk (weight_walk.py): each layer's inputs come from the layers already quantized
(`--gptq-inputs quantized`, the default, as llm-compressor's sequential pipeline) or from the
source (`dense`).

H is summed in FP64 (products of FP32 values are exact in FP64) over groups of up to 4096 rows
taken in global batch order (ordered_sum.py), so the bytes do not depend on the number of ranks.
A module that no token, or fewer than `--gptq-min-tokens`, reached (an MoE expert the router
seldom chose) is rounded to nearest and named: its H is the routed tokens' only (what the expert
sees at inference), and from a handful of them GPTQ would fit those tokens rather than the module.
Non-finite activations are refused.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import replace

import torch

from quantcli.convert.passes.kinds import ModuleWork, Rounded
from quantcli.errors import QuantcliError
from quantcli.planning.plan import Plan, TensorPlan
from quantcli.planning.rounding import GPTQ
from quantcli.planning.rounding_plan import gptq_reaches
from quantcli.recipes import QuantizedTensor
from quantcli.rounding.gptq import Factor, GptqSettings, factorize, gptq_quantize


def gram_blocks(k: int) -> int:
    """Block rows of H that gram() computes on the CPU: (blocks + 1) / (2 blocks) of one product's work."""
    return max(1, min(8, k // 256))


def gram(x: torch.Tensor) -> torch.Tensor:
    """X^T X of rows `x` [rows, K]. On the CPU by block rows of the upper triangle, each mirrored
    below (H is symmetric: every off-diagonal block computed once): ~30% less time than x.T @ x
    at K 2048-5632 and 4096 rows, and the same bits (MKL's strict mode, quantcli/__init__.py:
    each element's sum does not depend on the blocking; tests/test_gptq.py holds it)."""
    k = x.shape[1]
    blocks = gram_blocks(k)
    if x.device.type != "cpu" or blocks == 1:
        return x.T @ x
    edges = [round(i * k / blocks) for i in range(blocks + 1)]
    h = torch.empty(k, k, dtype=x.dtype)
    for a, b in zip(edges, edges[1:]):
        row = x[:, a:b].T @ x[:, a:]  # rows a:b of H, from the diagonal on
        h[a:b, a:] = row
        h[b:, a:b] = row[:, b - a:].T
    return h


class GptqPass:
    name = "gptq"

    def __init__(self):
        # per solving thread, the last H's Factor: q/k/v (and gate/up) come one after the other in
        # one thread with one H object (the layer's groups may be solved side by side, one thread
        # each); H held by a weak reference whose end drops the Factor, so that it goes with the sums
        self._last: dict[int, tuple[weakref.ref, GptqSettings, Factor]] = {}
        self._lock = threading.RLock()  # RLock: H's end may call _forget in a thread holding it

    def takes(self, plan: Plan, t: TensorPlan) -> bool:
        return plan.options.rounding.method_for(t.module) == GPTQ and gptq_reaches(plan, t)

    def feeds_quantized(self, plan: Plan) -> bool:
        return plan.options.rounding.inputs == "quantized"

    def matmul_dtype(self, plan: Plan) -> torch.dtype | None:
        return torch.bfloat16 if plan.options.rounding.forward == "bfloat16" else None  # --gptq-forward

    def statistic(self, x: torch.Tensor) -> torch.Tensor:
        return gram(x.double())

    def quantize(self, work: ModuleWork) -> Rounded:
        if work.experts is not None:
            return self._stack(work)
        module, rounding = work.tensor.module, work.options.rounding
        if work.statistic is None or work.tokens < rounding.min_tokens:
            q = work.recipe.quantize(work.tensor.name, work.weight, backend=work.backend, facts=work.facts)
            reason = (f"{work.tokens} calibration tokens reached it (fewer than --gptq-min-tokens "
                      f"{rounding.min_tokens})")
            return Rounded(q, {"method": "nearest", "tokens": work.tokens, "reason": reason},
                           note=f"{module}: rounded to nearest, not GPTQ: {reason}")
        if not bool(torch.isfinite(work.statistic).all()):
            raise QuantcliError(f"{module}: the calibration activations reaching it are not finite (Inf/NaN in "
                                f"X^T X): the source overflows on this data; check the data or the source's dtype")
        o = gptq_quantize(work.tensor.name, work.weight, work.statistic, work.recipe, work.facts, rounding.gptq,
                          work.backend, self._factor(work.statistic, rounding.gptq))
        record = {"method": o.method, "tokens": work.tokens, "output_error": o.error,
                  "nearest_output_error": o.nearest_error, "dampening": o.dampening}
        if o.reason is None:
            return Rounded(o.q, record)
        return Rounded(o.q, {**record, "reason": o.reason}, note=f"{module}: rounded to nearest, not GPTQ: {o.reason}")


    def _factor(self, h: torch.Tensor, settings: GptqSettings) -> Factor:
        """H's Factor, computed once for the modules that share `h` (the same bits: the same call)."""
        me = threading.get_ident()
        with self._lock:  # the thread's previous Factor goes before the next one is computed (peak memory)
            last = self._last.pop(me, None)
        if last is not None and last[0]() is h and last[1] == settings:
            factor = last[2]
        else:
            del last
            factor = factorize(h, settings)
        with self._lock:
            self._last[me] = (weakref.ref(h, self._forget), settings, factor)
        return factor

    def _forget(self, ref: weakref.ref) -> None:
        """An H is gone (the layer's sums with it): its Factor goes too."""
        with self._lock:
            for thread in [t for t, entry in self._last.items() if entry[0] is ref]:
                del self._last[thread]

    def _stack(self, work: ModuleWork) -> Rounded:
        """A 3-D expert stack [E, N, K] (gpt-oss's): each expert rounded as a Linear of its own,
        from the tokens routed to it; the record sums them up."""
        parts = [self.quantize(replace(work, weight=work.weight[e], statistic=h, tokens=n, experts=None))
                 for e, (h, n) in enumerate(work.experts)]
        first = parts[0].q
        q = QuantizedTensor(first.recipe, tuple(work.weight.shape), torch.stack([p.q.codes for p in parts]),
                            torch.stack([p.q.scale for p in parts]),
                            None if first.global_scale is None else torch.stack([p.q.global_scale for p in parts]),
                            first.scale_rule)
        gptq = [p.record for p in parts if p.record["method"] == "gptq"]
        record = {"method": "gptq" if gptq else "nearest", "tokens": sum(n for _, n in work.experts),
                  "experts": len(parts), "experts_gptq": len(gptq)}
        if gptq:
            record.update(output_error=sum(r["output_error"] for r in gptq) / len(gptq),
                          nearest_output_error=sum(r["nearest_output_error"] for r in gptq) / len(gptq),
                          dampening=max(r["dampening"] for r in gptq))
        nearest = [(e, p.record) for e, p in enumerate(parts) if p.record["method"] != "gptq"]
        if not nearest:
            return Rounded(q, record)
        reason = f"{len(nearest)} of {len(parts)} experts rounded to nearest (expert {nearest[0][0]}: " \
                 f"{nearest[0][1].get('reason')})"
        return Rounded(q, {**record, "reason": reason}, note=f"{work.tensor.module}: {reason}")


GPTQ_PASS = GptqPass()
