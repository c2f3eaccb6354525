"""A checkpoint without quantized modules (e.g. `convert QSRC DST --recipe bf16`), checked for
identity with its reference."""

from __future__ import annotations

import torch

from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors, same_bytes
from quantcli.errors import QuantcliError
from quantcli.planning.plan import matches
from quantcli.verify.compare import raw_bytes
from quantcli.verify.findings import (
    REF_DEQUANT,
    REF_IDENTICAL,
    REF_PRESENT,
    Findings,
    TensorRow,
    VerifyReport,
    build_report,
)
from quantcli.verify.limits import metrics
from quantcli.verify.reference import Reference, remaining_reference_tensors, source_name

UNQUANTIZED_NOTE = ("no quantized modules: an unquantized checkpoint is checked for identity with the reference, "
                    "tensor by tensor")


def verify_unquantized(source, reference: str, revision: str | None, pattern: str | None, dev) -> VerifyReport:
    """Against a quantized reference each dequantized weight must equal the reference module
    decoded and cast to its dtype, bit for bit; every other tensor (all of them for a dense
    reference) must be bit-identical. Rows carry the error so a mismatch shows how far off it is."""
    found = Findings()
    rows: list[TensorRow] = []
    ref_source = open_source(reference, revision)
    with CheckpointTensors(source) as qt, CheckpointTensors(ref_source) as rt:
        ref = Reference(reference, ref_source, rt, dev)
        consumed = _dequantized_rows(ref, qt, pattern, rows, found)
        quantized = ref.det.modules if ref.det is not None else {}
        for name in remaining_reference_tensors(rt, qt, consumed, pattern, quantized, found, "the checkpoint"):
            row = _identity_row(name, rt, qt, ref, found)
            if row is not None:
                rows.append(row)
        found.ran(REF_PRESENT)
        found.ran(REF_IDENTICAL)
        kind = ref.kind
    return build_report(source, "none", reference, kind, 0, found, rows, notes=(UNQUANTIZED_NOTE,))


def _dequantized_rows(ref: Reference, qt: CheckpointTensors, pattern: str | None, rows: list, found: Findings
                      ) -> set[str]:
    """Each module the reference quantizes against its dequantized weight; the reference names used."""
    consumed: set[str] = set()
    if ref.det is None:
        return consumed
    for module in sorted(ref.det.modules):
        if pattern and not matches(pattern, module):
            continue
        consumed.update(ref.names(module))
        row = _dequantized_row(module, ref, qt, found)
        if row is not None:
            rows.append(row)
        ref.release(module)
    found.ran(REF_DEQUANT)
    return consumed


def _dequantized_row(module: str, ref: Reference, qt: CheckpointTensors, found: Findings) -> TensorRow | None:
    # convert writes a dequantized Linear as `<module>.weight`, a gpt-oss expert stack as `<module>`
    # in its dense [E, in, out] orientation.
    name = source_name(module, qt)
    transpose = name == module
    if name is None:
        found.fault(REF_PRESENT, module, f"the reference quantizes this module but the checkpoint has no "
                                         f"{module}.weight: a different model?")
        return None
    try:
        w = ref.decoded(module)
    except QuantcliError as exc:
        found.fault(REF_DEQUANT, name, str(exc))
        return None
    w = w.transpose(-1, -2) if transpose else w
    info = qt.info(name)
    if tuple(info.shape) != tuple(w.shape) or info.dtype not in ("BF16", "F16", "F32"):
        found.fault(REF_DEQUANT, name, f"is {info.dtype}{list(info.shape)}, the reference module decodes to "
                                       f"{list(w.shape)}: expected a BF16, F16 or F32 tensor of that shape")
        return None
    got = qt.get(name)
    expected = w.to(got.dtype)  # what a faithful dequantization to this dtype writes
    identical = torch.equal(raw_bytes(expected), raw_bytes(got))
    row = TensorRow(**metrics(got.to(torch.float32), expected.to(torch.float32)), tensor=name,
                    recipe=ref.recipe_name(module), baseline_rel_err=0.0, limit_rel_err=0.0,
                    limit_basis=f"identical, decoded and cast to {info.dtype}",
                    exact_identical_fraction=1.0 if identical else None, passed=identical)
    qt.release(name)
    if not identical:
        found.fault(REF_DEQUANT, name, f"differs from the reference module decoded and cast to {info.dtype} "
                                       f"(relative error {row.rel_err:.4g}, max abs {row.max_abs:.3g}): not a "
                                       f"faithful dequantization of {ref.label}")
    return row


def _identity_row(name: str, rt: CheckpointTensors, qt: CheckpointTensors, ref: Reference,
                  found: Findings) -> TensorRow | None:
    ri, qi = rt.info(name), qt.info(name)
    row = None
    if ri.dtype != qi.dtype or ri.shape != qi.shape:
        found.fault(REF_IDENTICAL, name, f"changed from {ri.dtype}{list(ri.shape)} to {qi.dtype}{list(qi.shape)}: "
                                         f"an unquantized checkpoint is checked for identity with the reference")
    else:
        identical = same_bytes(rt.raw(name), qt.raw(name))
        if ri.dtype in ("BF16", "F16", "F32") and len(ri.shape) >= 1:
            row = TensorRow(**metrics(qt.get(name).to(torch.float32), rt.get(name).to(torch.float32)), tensor=name,
                            recipe="-", baseline_rel_err=0.0, limit_rel_err=0.0, limit_basis="identical",
                            passed=identical)
        if not identical:
            err = f" (relative error {row.rel_err:.4g})" if row else ""
            hint = ("; if it was dequantized from a quantized checkpoint, pass that one as --reference"
                    if ref.det is None else "")
            found.fault(REF_IDENTICAL, name, f"not bit-identical to the reference{err}: an unquantized checkpoint "
                                             f"is checked for identity{hint}")
    rt.release(name)
    qt.release(name)
    return row
