"""What the manifest says about a calibrated run: the run itself (data, amounts, what was
calibrated) and the scale tensors it added to each module, with their role and direction."""

from __future__ import annotations

from pathlib import Path

from quantcli.checkpoint.manifest import DiskEntry
from quantcli.formats.layouts.base import Direction, Layout
from quantcli.model.data_used import data_used
from quantcli.model.samples import data_digest, is_hub_dataset, read_samples
from quantcli.planning.plan import Plan, TensorPlan


def calibration_record(plan: Plan) -> dict[str, object] | None:
    """`samples` / `seq_len` / `batch` as asked (at most; what verify --calibration reruns with),
    `samples_used` as found in the data, and how much of the data that was: `samples_in_data`,
    `tokens_used`, `tokens_in_data` (null: a Hub dataset, not read to its end)."""
    cal = plan.options.calibration
    if cal is None:
        return None
    name = cal.data if is_hub_dataset(cal.data) else Path(cal.data).name
    used = data_used(cal, plan.source.root)
    return {"data": name, "data_sha256": data_digest(cal), "samples_used": len(read_samples(cal)),
            "samples_in_data": used.samples_in_data, "tokens_used": used.tokens,
            "tokens_in_data": used.tokens_in_data,             "samples": cal.samples, "seq_len": cal.seq_len,
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
