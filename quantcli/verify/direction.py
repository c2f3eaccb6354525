"""Whether each global scale is read in the direction its layout stores it.

A global scale read the wrong way round (s2 for 1/s2) scales the whole tensor by 1/s2^2. Block
scales and codes cannot tell (they were computed relative to s2 either way), and s2 > 1 is
legitimate (tensor amax > 2688), so no bound on s2 alone can decide. What can: the decoded
amax 6 * max(block scale) * s2 of one module against the magnitudes of the rest of the checkpoint
(other modules, dense weights). A module is called inverted when reading its global the other way
round brings it closer to them by more than INVERSION_EVIDENCE (x100): a correct module with
s2 < 10 (amax < 26880) can never be flagged; an inverted global of any tensor with amax < 270 is.
Without a reference only: with one, each module's decoded values are judged against the
reference itself (judge.py), which sees an inverted global as the gain 1/s2^2 and does not flag a
legitimate tensor far from the rest of the checkpoint (a weight near FP32 max), as this does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.formats.layouts.base import Direction, Role
from quantcli.verify.findings import DIRECTION, Findings

INVERSION_EVIDENCE = math.log(100.0)


def _stored_direction(layout, module: str, recipe) -> str:
    """How the layout stores this module's global scale, in words (from the layout's table)."""
    d = next(d for d in layout.describe(module, recipe) if d.role == Role.GLOBAL_SCALE)
    suffix = d.name.rsplit(".", 1)[-1]
    if d.direction == Direction.MULTIPLY:
        return f"{suffix} is a multiplier amax/2688"
    return f"{suffix} is a divisor 2688/amax"


def _inverted(s2: float, here: float, reference: float, direction: str) -> str | None:
    flipped = here - 2 * math.log(s2)  # the same module with 1/s2
    if abs(here - reference) - abs(flipped - reference) <= INVERSION_EVIDENCE:
        return None
    return (f"global scale looks inverted: it decodes to amax {math.exp(here):.4g}, "
            f"{math.exp(abs(here - reference)):.3g}x off the rest of the checkpoint, and "
            f"{math.exp(flipped):.4g} read the other way round ({direction})")


def direction_faults(decoded_cache: dict, qt: CheckpointTensors, det) -> Iterator[tuple[str, str]]:
    globals_ = {m: q for m, (r, q) in decoded_cache.items() if q.global_scale is not None}
    peers = {m: _log_amax(r, q) for m, (r, q) in decoded_cache.items()}
    dense = _dense_log_amax(qt, det)
    for module, q in globals_.items():
        s2 = float(q.global_scale)
        if not math.isfinite(s2) or s2 <= 0:
            continue  # already a scale-check fault
        for reference in (_median([v for m, v in peers.items() if m != module] + dense), _median(dense)):
            if reference is None:
                continue
            fault = _inverted(s2, peers[module], reference,
                              _stored_direction(det.layout, module, decoded_cache[module][0]))
            if fault is not None:
                yield module, fault
                break


def direction_check(decoded_cache: dict, qt: CheckpointTensors, det, found: Findings) -> None:
    """Runs (and is listed) only where a module has a global scale."""
    if any(q.global_scale is not None for _, q in decoded_cache.values()):
        found.record(DIRECTION, direction_faults(decoded_cache, qt, det))


def _log_amax(recipe, q) -> float:
    """log of the module's decoded amax, from its scales alone (within a factor ~2 of the true one)."""
    value = recipe.decoded_amax_bound(q)
    return math.log(value) if value > 0 and math.isfinite(value) else 0.0


def _dense_log_amax(qt: CheckpointTensors, det, limit: int = 4) -> list[float]:
    """log amax of a few dense 2-D float weights (not norms), smallest first: the model's own scale."""
    quantized = set()
    for module, recipe in det.modules.items():
        quantized.update(d.name for d in det.layout.describe(module, det.layout.recipe_for(recipe)))
    names = [n for n in qt.where if n not in quantized and n.endswith(".weight") and "norm" not in n
             and qt.info(n).dtype in ("F32", "BF16", "F16") and len(qt.info(n).shape) == 2
             and 0 not in qt.info(n).shape]  # an empty tensor has no magnitude
    out = []
    for name in sorted(names, key=lambda n: qt.info(n).nbytes)[:limit]:
        amax = float(qt.get(name).abs().max())
        qt.release(name)
        if amax > 0 and math.isfinite(amax):
            out.append(math.log(amax))
    return out


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
