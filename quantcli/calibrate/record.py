"""What the manifest says about a calibrated run: the run itself (data, amounts, what was
calibrated) and the scale tensors it added to each module, with their role and direction."""

from __future__ import annotations

from pathlib import Path

from quantcli.checkpoint.manifest import DiskEntry
from quantcli.formats.layouts.base import Direction, Layout
from quantcli.model.samples import data_digest, is_hub_dataset, read_samples
from quantcli.planning.plan import Plan, TensorPlan


def calibration_record(plan: Plan) -> dict[str, object] | None:
    """`samples` / `seq_len` / `batch` as asked (at most; what verify --calibration reruns with),
    `samples_used` as found in the data."""
    cal = plan.options.calibration
    if cal is None:
        return None
    name = cal.data if is_hub_dataset(cal.data) else Path(cal.data).name
    return {"data": name, "data_sha256": data_digest(cal), "samples_used": len(read_samples(cal)),
            "samples": cal.samples, "seq_len": cal.seq_len,
            "batch": cal.batch, "activations": plan.options.activations or "dynamic",
            "kv_cache": plan.options.kv_cache, "statistic": "max |x| over the unquantized model's forward"}


def calibrated_entries(layout: Layout, t: TensorPlan, recipe, described: set[str]) -> list[DiskEntry]:
    """DiskEntries for the calibrated outputs of `t` (input scale, k_scale / v_scale)."""
    rows = {f"{t.module}{row.suffix}": row for row in layout.input_scale_rows(recipe.name)}
    kv = {name: fact for fact, name in layout.kv_names(t.module).items()}
    out = []
    for o in t.outputs:
        if o.name in described:
            continue
        if o.name in rows:
            out.append(DiskEntry(o.name, rows[o.name].role, o.dtype, o.shape, "f32",
                                 rows[o.name].direction or Direction.MULTIPLY))
        elif o.name in kv:
            out.append(DiskEntry(o.name, kv[o.name], o.dtype, o.shape, "f32", Direction.MULTIPLY))
    return out
