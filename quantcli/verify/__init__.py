"""`quantcli verify`: decode a quantized checkpoint tensor by tensor and prove it is right.

Structural checks need no reference (structure.py, direction.py). With `--reference`, every
quantized module is judged as a quantization of the reference (judge.py): its codes must be a
rounding of the reference to its stored scales, by what makes a checkpoint wrong (a gain that no
rounding explains, an error beyond what rounding can give, blocks rescaled along their source,
scales too small for their block), never by how close its error comes to quantcli's own, so
other producers' rounding (BF16 scales, other tie rules, GPTQ's error feedback) passes and
swapped, transposed, shifted or inverted scales and codes fail. The comparison streams both
checkpoints band by band on convert's thread pool (kernels/blockstats.py). Unquantized tensors
must be bit-identical. `--exact` re-quantizes and compares bytes. Each check's status comes from
the faults filed under it (findings.py).

A quantized reference (the source of a re-layout or re-quantization) is decoded module by module
through its own layout: a module of the same recipe must decode identically, another recipe is
judged as a quantization of the decoded reference. A module convert re-quantized from a quantized
source, checked against the original dense model, may carry both errors (the manifest records the
second). A checkpoint with no quantized modules is checked for identity (unquantized.py).
"""

from __future__ import annotations

import contextlib

import torch

from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert import resolve_device
from quantcli.errors import QuantcliError
from quantcli.formats.consistency import CONFIG_NAME, config_fix, contradictions, missing_config
from quantcli.formats.detect import all_names, config_with_extras, detect
from quantcli.inspect import engine_loads
from quantcli.kernels import cpu_workers
from quantcli.planning.plan import matches
from quantcli.reports import OMITTED
from quantcli.verify.activation_scales import calibrated_check, recalibrated_check
from quantcli.verify.direction import direction_check
from quantcli.verify.findings import CONFIG, Findings, VerifyReport, build_report
from quantcli.verify.gptq_exact import gptq_modules, gptq_notes, rerun_gptq
from quantcli.verify.limits import Limits, parse_thresholds
from quantcli.verify.reference import reference_checks
from quantcli.verify.structure import Progress, no_progress, read_modules, structure_checks
from quantcli.verify.unquantized import verify_unquantized


def verify_checkpoint(quant: str, reference: str | None = None, revision: str | None = None,
                      pattern: str | None = None, exact: bool = False, tp: int | None = None,
                      limits: Limits | None = None, device: str = "auto",
                      calibration: str | None = None, progress: Progress = no_progress) -> VerifyReport:
    """`progress` is called per module read back and per module compared (see structure.Progress)."""
    limits = limits or Limits()
    if calibration is not None and reference is None:
        raise QuantcliError("--calibration needs --reference SRC: the calibration is rerun on the reference model")
    dev = resolve_device(device)
    source = open_source(quant)
    det = detect(source)
    found = Findings()
    found.record(CONFIG, config_faults(source, det))
    if det is None or not det.modules:
        if found.faults:  # no engine loads it, whatever its tensors are
            return build_report(source, det.layout.name if det else "none", reference, None, 0, found, [])
        if reference is None:
            raise QuantcliError(f"{quant}: no quantized modules found (no modelopt, compressed-tensors, fp8 or gpt-oss "
                                f"layout detected); an unquantized (e.g. dequantized) checkpoint is checked for "
                                f"identity with the one it came from: pass --reference SRC")
        if pattern is not None:
            _require_selection(pattern, source, None)
        return verify_unquantized(source, reference, revision, pattern, dev)
    if pattern is not None:
        _require_selection(pattern, source, det)
    config = config_with_extras(source, det.extra_files)
    rows, reference_kind = [], None
    gptq = gptq_modules(det.manifest, det.modules, pattern) if exact and reference is not None else []
    # before verify's thread pool: the rerun runs with torch's threads as convert does
    rerun = rerun_gptq(source, det.manifest, reference, revision, calibration, device, gptq, progress) if (
        gptq and calibration is not None) else None
    # convert's thread pool: bands of a tensor side by side on the CPU (kernels/chunks.py)
    threads = cpu_workers(torch.get_num_threads()) if dev.type == "cpu" else contextlib.nullcontext()
    with CheckpointTensors(source) as qt, threads:
        modules = structure_checks(source, det, config, qt, pattern, found)
        decoded_cache = read_modules(det, modules, qt, tp, found, decode=reference is None, dev=dev,
                                     progress=progress)
        if reference is None:  # a heuristic on magnitudes; with a reference the judge sees each gain exactly
            direction_check(decoded_cache, qt, det, found)
        scales = calibrated_check(source, det, config, modules, qt, found)
        engines = engine_loads(det, qt, config, OMITTED if scales is None else scales)
        stats, outputs = None, {}
        if calibration is not None:
            weighted = any(m.scale_search_weights for m in det.manifest.modules) if det.manifest else False
            targets = {m: (r, q) for m, (r, q) in decoded_cache.items() if len(q.shape) == 2}
            stats, outputs = recalibrated_check(source, scales, reference, revision, calibration, dev, found, weighted,
                                                det.layout, targets, gptq_rerun=rerun is not None)
        if reference is not None:
            rows, reference_kind = reference_checks(reference, revision, det, decoded_cache, qt, pattern, exact,
                                                    limits, dev, found, progress,
                                                    channel_ms=stats.channel_ms if stats is not None else None,
                                                    outputs=outputs, rerun=rerun)
    return build_report(source, det.layout.name, reference, reference_kind, len(modules), found, rows,
                        notes=(*found.notes, *gptq_notes(det.manifest, rerun, found)),
                        gptq_rerun=rerun if rerun is not None else OMITTED, engines=engines)


def config_faults(source, det) -> list[tuple[str, str]]:
    """config.json missing or naming no model, or contradicted by the tensors: (file, fault)."""
    missing = missing_config(source)
    faults = [] if missing is None else [(CONFIG_NAME, f"{missing}; {config_fix(source)}")]
    return faults + [(CONFIG_NAME, p) for p in contradictions(source, det)]


def _require_selection(pattern: str, source, det) -> None:
    """A --tensors filter that selects nothing would make every check pass vacuously."""
    modules = det.modules if det is not None else {}
    if any(matches(pattern, m) for m in modules) or any(matches(pattern, n) for n in all_names(source)):
        return
    raise QuantcliError(f"--tensors {pattern!r}: matches no tensor or module in {source.label}; try a module name "
                        f"or prefix (model.layers.0), a glob ('*q_proj') or re:REGEX")


__all__ = ["Limits", "VerifyReport", "parse_thresholds", "verify_checkpoint"]
