"""Calibrated scales (no reference needed): where the config declares static activations or an
FP8 KV cache, the input scales and k_scale / v_scale must be present, finite, positive, in the
layout's direction (compressed-tensors `input_global_scale` is a divisor, 2688/amax; modelopt
`input_scale` a multiplier, amax/2688) and equal across each fused group (q/k/v, gate/up).
With --reference and --calibration DATA,
recalibrate.py reruns the calibration and compares."""

from __future__ import annotations

from collections.abc import Iterator

from quantcli.errors import QuantcliError
from quantcli.formats.activation_scales import (
    CalibratedScales,
    calibrated_scales,
    divisor_of,
    fused_input_mismatches,
    missing_kv,
    scale_value_fault,
)
from quantcli.formats.detect import all_names
from quantcli.formats.layouts.base import Direction
from quantcli.verify.findings import CALIBRATED, Findings
from quantcli.verify.recalibrate import RECALIBRATED, calibration_of, recalibrated_faults, rerun

Finding = tuple[str, str]


def _input_faults(scales: CalibratedScales) -> Iterator[Finding]:
    for name in scales.missing_inputs:
        yield name, (f"is missing; the config declares static activations ({scales.activation_scheme}), so engines "
                     f"need a calibrated scale per module")
    for s in scales.inputs:
        fault = scale_value_fault(s.value, s.amax, s.direction)
        if fault:
            yield s.tensor, fault
    for group, values in fused_input_mismatches(scales).items():
        first = next(iter(values))
        yield first, (f"fused group {group} has different input scales {values}; vLLM and TensorRT-LLM use one "
                      f"activation scale for the fused GEMM (the max over the group)")


def _kv_faults(scales: CalibratedScales) -> Iterator[Finding]:
    for name in missing_kv(scales):
        yield name, (f"is missing; the config declares an FP8 KV cache ({scales.kv_cache}) and vLLM/SGLang "
                     f"silently fall back to 1.0")
    for r in scales.kv:
        for name, value in ((r.k_tensor, r.k_scale), (r.v_tensor, r.v_scale)):
            if value is not None:
                fault = scale_value_fault(value, value * divisor_of("fp8"), Direction.MULTIPLY)
                if fault:
                    yield name, fault


def calibrated_check(source, det, config: dict, modules: dict, qt, findings: Findings) -> CalibratedScales | None:
    """File faults in the static input scales and the KV-cache scales under CALIBRATED; returns
    the scales found (None for a weight-only checkpoint)."""
    selected = {m: det.modules[m] for m in modules}
    scales = calibrated_scales(det.layout, config, selected, all_names(source), qt)
    if scales.activation_scheme != "static" and not scales.kv_cache and not scales.inputs and not scales.kv:
        return None  # a weight-only checkpoint: nothing calibrated to check
    findings.record(CALIBRATED, [*_input_faults(scales), *_kv_faults(scales)])
    return scales


def recalibrated_check(source, scales: CalibratedScales | None, reference: str, revision: str | None, data: str,
                       device, findings: Findings, weighted: bool = False, layout=None, targets: dict | None = None,
                       gptq_rerun: bool = False):
    """--calibration DATA: file under RECALIBRATED every stored scale a rerun disagrees with.
    Returns the rerun's statistics (their per-channel mean squared inputs let --exact reproduce
    an activation-weighted scale search, `weighted`) and the layer-output errors of `targets`
    (outputs.py: checkpoint module -> (recipe, q), judged by them). `gptq_rerun`: --exact reran GPTQ
    with the data, which is then use enough for it."""
    has_scales = scales is not None and bool(scales.inputs or any(r.k_scale is not None for r in scales.kv))
    if not has_scales and not weighted and not targets:
        if gptq_rerun:  # the data served --exact's GPTQ rerun (gpt-oss's expert stacks): nothing more to check
            return None, {}
        raise QuantcliError(f"--calibration: {source.label} holds no static activation or KV-cache scales, no "
                            f"activation-weighted scale search and no Linear whose outputs it could check")
    stats, outputs = rerun(reference, revision, calibration_of(source, data), device, layout, targets)
    if has_scales:
        findings.record(RECALIBRATED, recalibrated_faults(scales, stats))
    return stats, outputs
