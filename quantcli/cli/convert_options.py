"""`quantcli convert`'s options, one type each, so that the command's signature in app.py reads
as a list (the push options are in push_command.py, the shared ones in options.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.cli.options import (
    BACKEND_NAMES,
    LAYOUT_NAMES,
    RECIPE_NAMES,
    SCALE_RULE_NAMES,
    backend_names,
    completer,
    layout_names,
    one_of,
    recipe_names,
    scale_rule_names,
)
from quantcli.formats.facts import CALIBRATION_SAMPLES


def choice(option: str, kind: str, names: Callable[[], Sequence[str]], shown: Sequence[str], metavar: str,
           help: str):
    """An option whose value is one of a registry's names: checked case-insensitively, completed."""
    return typer.Option(metavar=metavar, callback=one_of(option, kind, names), autocompletion=completer(shown),
                        help=help)


Recipe = Annotated[Optional[str], choice("--recipe", "recipe", recipe_names, RECIPE_NAMES, "RECIPE", (
    f"One of: {', '.join(RECIPE_NAMES)} (bf16/fp16/fp32 dequantize a quantized source)."))]
Layout = Annotated[Optional[str], choice("--layout", "layout", layout_names, LAYOUT_NAMES, "LAYOUT", (
    f"One of: {', '.join(LAYOUT_NAMES)} (default per recipe)."))]
Ignore = Annotated[Optional[list[str]], typer.Option(metavar="PATTERN", help=(
    "Leave modules matching PATTERN unquantized: a name, a parent module, a glob or re:REGEX (repeatable)."))]
ConfigFile = Annotated[Optional[Path], typer.Option("--config", metavar="FILE", help=(
    "TOML recipe file: recipe, layout, scale_rule, scale_search, targets, ignore, [[override]], rounding, gptq_*, "
    "[[rounding_override]], auto, target_bits, max_size."))]
ScaleRule = Annotated[Optional[str], choice(
    "--scale-rule", "MX scale rule", scale_rule_names, SCALE_RULE_NAMES, "RULE",
    f"MX scale exponent rule: {', '.join(SCALE_RULE_NAMES)} (default: the layout's producer).")]
ScaleSearch = Annotated[Optional[str], choice(
    "--scale-search", "scale search", lambda: ["none", "mse"], ["none", "mse"], "METHOD",
    "none: absmax block scales; mse: per block the scale code with the smallest error (nvfp4, mxfp4, mxfp8; "
    "activation-weighted with --calibration).")]
RoundingMethod = Annotated[Optional[str], choice(
    "--rounding", "rounding", lambda: ["nearest", "gptq"], ["nearest", "gptq"], "METHOD",
    "nearest: round each weight to nearest (default); gptq: round with GPTQ's error feedback from the calibration "
    "data (needs --calibration).")]
Rotate = Annotated[Optional[str], choice(
    "--rotate", "rotation", lambda: ["vo"], ["vo"], "WHAT",
    "vo: rotate each attention's value and output projections per head by a Hadamard matrix before rounding "
    "(exact: the model's function is unchanged; spreads outliers within each head).")]
Activations = Annotated[Optional[str], choice(
    "--activations", "activation scheme", lambda: ["static", "dynamic"], ["static", "dynamic"], "MODE",
    "static: write calibrated activation scales (nvfp4 W4A4, fp8); needs --calibration. dynamic (the default): "
    "write none; the engine scales activations at run time where the config declares it (the fp8 recipes, "
    "int8-channel), else the weights alone are quantized; overrides static from --config.")]
KvCache = Annotated[Optional[str], choice(
    "--kv-cache", "KV-cache dtype", lambda: ["fp8", "none"], ["fp8", "none"], "DTYPE",
    "fp8: write calibrated k_scale/v_scale; needs --calibration.")]
Calibration = Annotated[Optional[str], typer.Option(metavar="DATA", help=(
    "Calibration samples: .txt or .jsonl (text, messages or input_ids), or a Hub dataset OWNER/NAME[:SPLIT] (needs "
    "the datasets package)."))]
CalibrationSamples = Annotated[Optional[int], typer.Option(metavar="N", help=(
    f"Samples to use, at most: by default the whole data up to {CALIBRATION_SAMPLES} (llm-compressor's default).  "
    f"[default: {CALIBRATION_SAMPLES}]"))]
CalibrationSeqLen = Annotated[Optional[int], typer.Option(metavar="L",
                                                          help="Tokens per sample, at most.  [default: 512]")]
CalibrationBatch = Annotated[Optional[int], typer.Option(metavar="B", help="Samples per forward.  [default: 1]")]
Backend = Annotated[str, choice("--backend", "backend", backend_names, BACKEND_NAMES, "BACKEND",
                                f"One of: {', '.join(BACKEND_NAMES)} (auto: Triton on CUDA).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run with the same inputs.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help=(
    "Replace DST when it is a quantcli output (or empty); never a folder of other files."))]
PerTensor = Annotated[bool, typer.Option("--per-tensor", help=(
    "--dry-run: one row per tensor instead of one per layer pattern."))]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help=(
    "No progress bar; stdout gets only the destination path, or with --dry-run the total line (errors and "
    "warnings go to stderr)."))]
Workers = Annotated[int, typer.Option(metavar="N", min=1, help=(
    "Convert on N processes on this machine (torch.distributed; under torchrun the ranks come from torchrun)."))]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help=(
    "Per-tensor detail: each tensor as it is written (stderr), the dry run per tensor."))]
Auto = Annotated[Optional[str], typer.Option("--auto", metavar="R1,R2", help=(
    "Choose each module group's recipe among these candidates (bf16: stays dense) for the least model output "
    "error on --calibration DATA, under --target-bits or --max-size."))]
TargetBits = Annotated[Optional[float], typer.Option(metavar="B", help=(
    "--auto: average stored bits per quantized weight (codes and scales, as written), at most."))]
MaxSize = Annotated[Optional[str], typer.Option(metavar="SIZE", help=(
    "--auto: the whole output's tensors at most SIZE, in binary units (e.g. 3.5GiB)."))]
