"""What a finished conversion says: the summary lines (stdout) and the --json document."""

from __future__ import annotations

import shlex
from pathlib import Path

from quantcli.cli.name_tables import ERROR, counted
from quantcli.cli.render import console as _console
from quantcli.cli.render import dense_reasons, human_bytes
from quantcli.cli.render_auto import auto_summary
from quantcli.cli.render_rounding import rounding_summary
from quantcli.reports import envelope, excluded_entries


def convert_summary(plan, result) -> dict:
    """The --json document of a finished conversion (quantcli/schemas/convert.json)."""
    return envelope("convert", {
        "layout": plan.target, "recipes": sorted(plan.recipes),
        "tensors_quantized": result.quantized, "tensors_total": len(plan.tensors),
        "bytes_in": result.bytes_in, "bytes_out": result.bytes_out, "seconds": round(result.seconds, 3),
        "seconds_total": round(max(result.wall_seconds or 0.0, result.seconds), 3),
        "shards_written": result.shards_written, "shards_resumed": result.shards_resumed,
        "excluded": excluded_entries(plan.exclusions),
        "exclusion_key": plan.layout.exclusion_key if plan.layout else None,
        "exclusion_list": plan.excluded_names() if plan.layout else [], "warnings": result.warnings,
        "lossless": plan.lossless, "notes": result.notes,
        "requantize_rel_err_vs_decoded_source": result.requantize_errors,
        "already_complete": result.already_complete,
        "calibration": _calibration_record(plan, result.dst),
        "auto": plan.options.auto_choice.record() if plan.options.auto_choice is not None else None,
    }, source=plan.source.label, destination=result.dst)


def print_convert_result(plan, result, src: str, overwrite: bool = False) -> None:
    con = _console()
    if result.already_complete:  # --resume keeps a finished output of the same plan, with --overwrite too
        again = "drop --resume (keep --overwrite) to convert again" if overwrite else "use --overwrite to convert again"
        con.print(f"{result.dst}: already complete (a finished quantcli output of the same source headers, recipe "
                  f"and options); nothing to resume, nothing written: {again}")
        return
    if plan.lossless:
        con.print("lossless re-layout: every code and block-scale value carried over unchanged")
    for n in result.notes:
        con.print(f"note: {n}")
    if result.requantize_errors:  # the plan's warning said why; the `next:` line below says how to check
        errs = result.requantize_errors
        worst = max(errs, key=errs.get)
        con.print(f"re-quantized {counted(len(errs), 'module')}; relative error vs the decoded source: mean "
                  f"{ERROR.format(sum(errs.values()) / len(errs))}, worst {ERROR.format(errs[worst])} ({worst})")
    con.print(f"wrote {result.dst}: {_what_was_done(plan, result)}, "
              f"{human_bytes(result.bytes_in)} -> {human_bytes(result.bytes_out)}{_timing(result)}")
    if plan.options.auto_choice is not None:
        con.print(auto_summary(plan.options.auto_choice), markup=False, highlight=False)
    if plan.exclusions:
        con.print(f"left dense: {dense_reasons(plan.exclusions)}")
    if plan.layout is not None:  # the card's verdicts (quantcli/formats/engines.py, checked on the output)
        from quantcli.convert.model_card import output_loads
        from quantcli.formats.engine_checks import loads_in_line, ruled_out_line

        loads = output_loads(plan, result.dst)
        con.print(f"loads in: {loads_in_line(loads)}", markup=False)
        if ruled_out_line(loads):  # the pair loads there, this checkpoint does not: said, not left out silently
            con.print(f"not in: {ruled_out_line(loads)}", markup=False)
    cal = plan.options.calibration
    if cal is not None and _calibrated_counts(plan):
        con.print(f"calibrated: {_calibrated_counts(plan)} from {cal.data}")
    record = _calibration_record(plan, result.dst)
    if record is not None:
        con.print(f"calibration data: {_data_used(record)}", markup=False)
    if plan.options.rounding.data_aware:
        con.print(f"rounded: {_rounding_line(result.dst)}", markup=False)
    con.print(f"next: {_verify_command(plan, result, src)}")


def _verify_command(plan, result, src: str) -> str:
    """`quantcli verify DST --reference SRC`, reading what this convert read: a Hub source at the
    same --revision, the Hub cache folder (--cache-dir) where the source or a Hub --calibration
    dataset came from it, and the calibration data."""
    from quantcli.checkpoint.hub import current
    from quantcli.model.samples import is_hub_dataset

    cal = plan.options.calibration
    args = ["quantcli", "verify", str(result.dst), "--reference", src]
    if plan.source.repo_id is not None and plan.source.revision:
        args += ["--revision", plan.source.revision]
    cache = current().cache_dir  # --cache-dir, set for the length of the command (cli/app.py)
    if cache and (plan.source.repo_id is not None or (cal is not None and is_hub_dataset(cal.data))):
        args += ["--cache-dir", cache]
    if cal is not None:
        args += ["--calibration", cal.data]
    return shlex.join(args)


def _calibrated_counts(plan) -> str:
    """`14 activation scales, 4 KV-cache scales`: the calibrated tensors the plan wrote."""
    written = [o.name for t in plan.tensors for o in t.outputs]
    inputs = sum(n.endswith((".input_scale", ".input_global_scale")) for n in written)
    kv = sum(n.endswith((".k_scale", ".v_scale")) for n in written)
    parts = [counted(inputs, "activation scale")] * bool(inputs) + [counted(kv, "KV-cache scale")] * bool(kv)
    parts += ["activation-weighted block scales (--scale-search mse)"] * (plan.options.scale_search == "mse")
    return ", ".join(parts)


def _manifest(dst: Path):
    """The manifest just written."""
    from quantcli.checkpoint.manifest import MANIFEST_NAME, Manifest

    return Manifest.from_json((dst / MANIFEST_NAME).read_text())


def _rounding_line(dst: Path) -> str:
    """`14 modules by GPTQ, 2 to nearest (see the notes); layer-output error on the calibration
    data 0.0092 -> 0.0063 (mean)`, from the manifest just written."""
    manifest = _manifest(dst)
    return rounding_summary([m.rounding for m in manifest.modules if m.rounding], "see the notes")


def _calibration_record(plan, dst: Path) -> dict | None:
    """The manifest's record of the calibration run (the data, how much of it was used), or None."""
    if plan.options.calibration is None:
        return None
    return dict(_manifest(dst).calibration or {}) or None


def _data_used(record: dict) -> str:
    """`all 8 samples, 256 tokens of calib.jsonl`, or `128 of 190 samples, 40,960 of 61,233 tokens
    of data.jsonl (the rest left out by --calibration-samples 128 and --calibration-seq-len 512)`;
    a Hub dataset read only as far as the cap says `the first 512 samples`."""
    n, held = record["samples_used"], record.get("samples_in_data")
    tokens, tokens_held = record.get("tokens_used"), record.get("tokens_in_data")
    if n == held and tokens == tokens_held:
        return f"all {counted(n, 'sample')}, {counted(tokens, 'token', spec=',')} of {record['data']}"
    samples = f"{n} of {counted(held, 'sample')}" if held is not None else f"the first {counted(n, 'sample')}"
    said = f"{tokens:,} of {counted(tokens_held, 'token', spec=',')}" if tokens_held is not None else \
        counted(tokens, "token", spec=",")
    return (f"{samples}, {said} of {record['data']} (the rest left out by --calibration-samples {record['samples']} "
            f"and --calibration-seq-len {record['seq_len']})")


def _what_was_done(plan, result) -> str:
    """'14 of 21 tensors quantized (nvfp4 -> modelopt)', or re-laid out, or dequantized."""
    if plan.layout is None and plan.source_layout is None:  # a transform alone
        return (f"{counted(len(plan.transforms), 'tensor')} rotated (--rotate {plan.options.rotate}), every tensor in "
                f"{plan.dense_dtype}")
    if plan.layout is None:
        dequantized = sum(t.action == "dequantize" for t in plan.tensors)
        return f"{counted(dequantized, 'module')} dequantized to {plan.dense_dtype}"
    verb = "carried over" if plan.lossless else "quantized"  # a re-layout copies codes and scales
    return (f"{result.quantized} of {counted(len(plan.tensors), 'tensor')} {verb} "
            f"({', '.join(sorted(plan.recipes)) or 'none'} -> {plan.target})")


def _timing(result) -> str:
    """' in 5.3 s (start-up 3.2 s, converting 2.1 s at 25.80 MiB/s)': the wall time since the
    process started, then the conversion's own; a resumed run shows no rate (its bytes are those
    of every shard, and its time leaves out what the interrupted run did: shards written, layers a
    weight pass rounded)."""
    wall = max(result.wall_seconds or 0.0, result.seconds)
    head = f" in {_seconds(wall)} (start-up {_seconds(wall - result.seconds)}, converting {_seconds(result.seconds)}"
    layers, of = result.layers_resumed
    if result.shards_resumed or layers:  # bytes_in counts every shard, so a rate here would count the resumed ones
        rounded = f", {counted(layers, 'rounded layer')} of {of} resumed" if layers else ""
        return f"{head}); {result.shards_written} shard(s) written, {result.shards_resumed} resumed{rounded}"
    rate = result.bytes_in / max(result.seconds, 1e-9)  # binary units, as the progress bar shows it
    return f"{head} at {human_bytes(rate)}/s)"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s >= 0.1 else f"{s:.2g} s"  # a tiny run reads '0.034 s', never '0.0 s'
