"""verify --reference SRC --calibration DATA: rerun the calibration on the reference with the data
and amounts the manifest records, and check every stored activation and KV-cache scale equals
what it gives (FP32, relative difference <= 1e-5: the stored value is an FP32 rounding of the
same quotient). Catches scales calibrated on other data, another model or a stale run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from quantcli.calibrate.engine import Stats, collect
from quantcli.calibrate.scales import input_amax, scale_for
from quantcli.checkpoint.manifest import MANIFEST_NAME
from quantcli.checkpoint.source import Source, open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import QuantcliError
from quantcli.formats.activation_scales import FP8_DIVISOR, CalibratedScales
from quantcli.formats.facts import Calibration
from quantcli.model.layers import Weights
from quantcli.model.reach import walk_reach
from quantcli.model.samples import data_digest, is_hub_dataset, token_ids
from quantcli.verify.outputs import collect_with_outputs

RECALIBRATED = "static activation and KV-cache scales equal a rerun of the calibration on the reference"
TOLERANCE = 1e-5


def calibration_of(quant: Source, data: str) -> Calibration:
    """The run the manifest records (samples, seq_len, batch), refusing other data; a
    checkpoint without a quantcli manifest is rerun with convert's defaults."""
    path = quant.root / MANIFEST_NAME
    record = json.loads(path.read_text()).get("calibration") or {} if path.is_file() else {}
    cal = Calibration(data, **{k: int(record[k]) for k in ("samples", "seq_len", "batch") if k in record})
    if not is_hub_dataset(data) and not Path(data).is_file():
        raise QuantcliError(f"--calibration {data}: no such file")
    expected = record.get("data_sha256")
    if expected and data_digest(cal) != expected:
        raise QuantcliError(f"--calibration {data}: not the data {quant.label} was calibrated with (its manifest "
                            f"records {record.get('data')} with SHA-256 {expected[:12]}...); pass that file")
    return cal


def rerun(reference: str, revision: str | None, cal: Calibration, device: torch.device, layout=None,
          targets: dict | None = None) -> tuple[Stats, dict]:
    """The calibration statistics of the reference, and (outputs.py) the layer-output errors of
    `targets` (checkpoint module -> (recipe, q)) decoded through `layout`."""
    ref = open_source(reference, revision)
    with CheckpointTensors(ref) as tensors:
        source = Weights.of(tensors)
        walk_reach(ref.config, source.names, source.shape, f"--reference {ref.label}")  # refused before any work
        ids = token_ids(cal, ref.root)
        if not targets:
            return collect(ref.config, source, ids, cal.batch, device), {}
        return collect_with_outputs(ref.config, source, ids, cal.batch, device, layout, targets)


def recalibrated_faults(scales: CalibratedScales, stats: Stats) -> Iterator[tuple[str, str]]:
    if scales.inputs:
        shared, _ = input_amax([s.module for s in scales.inputs], stats)
        for s in scales.inputs:
            want = float(scale_for(shared[s.module], s.divisor))
            if not _close(s.amax / s.divisor, want):
                yield s.tensor, (f"stores a scale for activation amax {s.amax:.6g}; the calibration rerun on the "
                                 f"reference gives amax {shared[s.module]:.6g}")
    for r in scales.kv:
        for name, have, amax in ((r.k_tensor, r.k_scale, stats.keys.get(r.attention)),
                                 (r.v_tensor, r.v_scale, stats.values.get(r.attention))):
            if have is None or amax is None:
                continue
            want = float(scale_for(amax, FP8_DIVISOR))
            if not _close(have, want):
                yield name, (f"is {have:.6g}; the calibration rerun on the reference gives {want:.6g} "
                             f"(amax {amax:.6g} / 448)")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOLERANCE * abs(b)
