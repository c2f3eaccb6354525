"""verify --exact on modules convert rounded by GPTQ (manifest `rounding.method` gptq): their
codes (and, with `--gptq-scales updated`, their block scales) depend on the calibration data,
so round to nearest says nothing about their bytes.

Without --calibration they are listed as not byte-checked, naming the data the manifest
records. With --calibration DATA: the data's SHA-256 must be the manifest's (recalibrate.py
refuses other data); the conversion options are rebuilt from the manifest
(planning/from_manifest.py) and planned on the reference, and that plan must have the
manifest's fingerprint (source headers, recipes, scale rules and searches, calibration data
and amounts, rounding settings, quantcli version), else verify refuses rather than compare
against another conversion. quantcli's own conversion of the reference then runs into a
temporary folder (removed after, also when interrupted) and each GPTQ module's stored tensors
are compared byte for byte with the checkpoint's.

The rerun runs on verify's --device with torch's default threads, as convert does. The manifest
does not record the device convert ran on; GPTQ's FP32 column loop may round otherwise on another
kind of device (reproduction is tested on the CPU), so the failure names that cause too.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path

import torch

from quantcli import __version__
from quantcli.checkpoint.manifest import Manifest
from quantcli.checkpoint.source import Source, open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.convert import RunOptions, convert, fingerprint
from quantcli.errors import QuantcliError
from quantcli.planning.conversion import plan_conversion
from quantcli.planning.from_manifest import CANNOT, recorded_options
from quantcli.planning.plan import Plan, matches
from quantcli.verify.findings import Findings, GptqRerun
from quantcli.verify.recalibrate import calibration_of
from quantcli.verify.structure import Progress, no_progress

GPTQ = "gptq"
NOT_BYTE_CHECKED_GPTQ = ("--exact: {n} module(s) were rounded by GPTQ (manifest rounding.method gptq): their bytes "
                         "depend on the calibration data and were not checked; pass --calibration with the data "
                         "convert used (recorded as {data}, SHA-256 {sha}...: a file's name, or a Hub dataset) to "
                         "rerun GPTQ with the recorded options and compare byte for byte")


def is_gptq(entry) -> bool:
    """Whether a manifest entry says GPTQ rounded the module (not round to nearest's fallback)."""
    return entry is not None and (entry.rounding or {}).get("method") == GPTQ


def gptq_modules(manifest: Manifest | None, modules, pattern: str | None) -> list[str]:
    """The modules of `modules` (detected, read back) the manifest says GPTQ rounded."""
    if manifest is None:
        return []
    return [m.module for m in manifest.modules
            if m.module in modules and is_gptq(m) and (pattern is None or matches(pattern, m.module))]


def gptq_notes(manifest: Manifest | None, rerun: GptqRerun | None, findings: Findings) -> list[str]:
    """What --exact did about the GPTQ modules: the rerun and its time, or why their bytes were
    not checked (and the data that would check them)."""
    if rerun is not None:
        return [f"--exact: reran GPTQ (quantcli's own conversion of the reference with the recorded options and "
                f"data) in {rerun.seconds:.1f} s: {rerun.identical} of {rerun.modules} GPTQ module(s) byte-identical"]
    if not findings.gptq_unchecked or manifest is None:
        return []
    cal = manifest.calibration or {}
    return [NOT_BYTE_CHECKED_GPTQ.format(n=len(findings.gptq_unchecked), data=cal.get("data", "DATA"),
                                         sha=str(cal.get("data_sha256", ""))[:12])]


def rerun_gptq(source: Source, manifest: Manifest, reference: str, revision: str | None, data: str, device: str,
               modules: list[str], progress: Progress = no_progress) -> GptqRerun:
    """Convert the reference again with the recorded options and `data`; compare `modules`."""
    cal = calibration_of(source, data)  # other data: refused in one line
    plan = recorded_plan(open_source(reference, revision), manifest, cal, source.label)
    progress("rerunning GPTQ", 0, 1, "(quantcli's own conversion of the reference, recorded options)")
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="quantcli-verify-gptq-") as tmp:  # removed on Ctrl-C too
        out = Path(tmp) / "rerun"
        convert(plan, out, RunOptions(device=device))
        fractions = compare_modules(source, open_source(str(out)), manifest, modules)
    progress("rerunning GPTQ", 1, 1, "")
    return GptqRerun(time.time() - start, len(modules), sum(f >= 1.0 for f in fractions.values()), fractions)


def recorded_plan(ref: Source, manifest: Manifest, cal, label: str) -> Plan:
    """The plan of the options the manifest records, on the reference; refused when none has
    the manifest's fingerprint (another source, or options the manifest cannot give back)."""
    if manifest.quantcli_version != __version__:
        raise QuantcliError(CANNOT.format(label=label) + f"it was written by quantcli {manifest.quantcli_version}, "
                            f"this is {__version__}, whose GPTQ may round otherwise; verify with quantcli "
                            f"{manifest.quantcli_version}, or without --exact")
    plans = [plan_conversion(ref, opts) for opts in recorded_options(manifest, cal, label)]
    for plan in plans:
        if fingerprint(plan) == manifest.fingerprint:
            return plan
    raise QuantcliError(CANNOT.format(label=label) + _difference(plans[0], manifest, ref.label))


def _difference(plan: Plan, manifest: Manifest, ref: str) -> str:
    """Why the rebuilt plan's fingerprint is not the manifest's, as far as the plan tells."""
    planned = {t.module: t.recipe for t in plan.tensors if t.quantized}
    recorded = {m.module: m.recipe for m in manifest.modules}
    for module in sorted(set(planned) | set(recorded)):
        if planned.get(module) != recorded.get(module):
            return (f"{module} is {recorded.get(module) or 'dense'} there, but {planned.get(module) or 'dense'} in "
                    f"the conversion rebuilt from it on {ref} (a per-module choice the manifest cannot give back, "
                    f"or another source)")
    return (f"the conversion rebuilt from it on {ref} has another fingerprint: {ref} is not the source it was "
            f"converted from (other tensors, dtypes or shards)")


def compare_modules(quant: Source, rerun: Source, manifest: Manifest, modules: list[str]) -> dict[str, float]:
    """Module -> fraction of its stored tensors' bytes identical in both checkpoints (a tensor
    missing or of another size on either side counts as all different)."""
    entries = {m.module: m for m in manifest.modules}
    out = {}
    with CheckpointTensors(quant) as qt, CheckpointTensors(rerun) as rt:
        for module in modules:
            same = total = 0
            for t in entries[module].tensors:
                a = qt.raw(t.name) if t.name in qt else memoryview(b"")
                b = rt.raw(t.name) if t.name in rt else memoryview(b"")
                same += _same_count(a, b)
                total += max(a.nbytes, b.nbytes)
                for side in (qt, rt):
                    if t.name in side:
                        side.release(t.name)
            out[module] = same / total if total else 1.0
    return out


def _same_count(a: memoryview, b: memoryview) -> int:
    if a.nbytes != b.nbytes or a.nbytes == 0:
        return 0
    with warnings.catch_warnings():  # read-only buffers (memory maps): only read here
        warnings.simplefilter("ignore", UserWarning)
        return int((torch.frombuffer(a, dtype=torch.uint8) == torch.frombuffer(b, dtype=torch.uint8)).sum())


def rerun_reason(fraction: float) -> str:
    return (f"--exact: {100 * (1 - fraction):.3g}% of bytes differ from rerunning GPTQ with the recorded options and "
            f"data: the codes or scales were changed after convert (or it ran on another kind of device than "
            f"--device)")
