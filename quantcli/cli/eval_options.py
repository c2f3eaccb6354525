"""`quantcli eval`'s options, one type each, so that the command's signature in app.py reads as
a list (the shared ones are in options.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from quantcli.cli.options import count_or_all, layout_names, one_of, quantizing_recipe_names, scale_rule_names

EvalCheckpoint = Annotated[str, typer.Argument(metavar="DST", help=(
    "The quantized checkpoint (folder, .safetensors file or Hub repo id); "
    "with --recipe, the dense model to emulate it on."))]
EvalData = Annotated[str, typer.Option(metavar="DATA", help=(
    "Held-out samples: .txt or .jsonl (text, messages or input_ids), or a Hub dataset OWNER/NAME[:SPLIT]."))]
EvalReference = Annotated[Optional[str], typer.Option(
    metavar="SRC", help="The model it was made from (folder, file or Hub repo id).")]
EvalSamples = Annotated[int, typer.Option(metavar="N", min=1, help="Samples to use.")]
EvalSeqLen = Annotated[int, typer.Option(metavar="L", min=2, help="Tokens per sample, at most.")]
EvalBatch = Annotated[int, typer.Option(
    metavar="B", min=1, help="Samples per forward (consecutive samples of equal length).")]
EvalKvCache = Annotated[str, typer.Option(
    metavar="MODE", callback=one_of("--kv-cache", "KV-cache mode", lambda: ["auto", "scale-one", "none"]),
    help="auto: FP8 with the checkpoint's k/v scales where it declares an FP8 KV cache; "
         "scale-one: FP8 with scale 1.0 (SGLang without scales); none.")]
EvalTop = Annotated[int, typer.Option(metavar="N", min=1, help="Worst modules listed per layer.")]
EvalRecipe = Annotated[Optional[str], typer.Option(
    metavar="RECIPE", callback=one_of("--recipe", "recipe", quantizing_recipe_names),
    help="Emulate this recipe on DST (a dense model) in memory, planned as convert plans it; "
         "nothing is written.")]
EvalLayout = Annotated[Optional[str], typer.Option(
    metavar="LAYOUT", callback=one_of("--layout", "layout", layout_names),
    help="With --recipe or --auto: the layout whose declarations (activations) to emulate (default per "
         "recipe; --auto: as convert --auto chooses it).")]
EvalIgnore = Annotated[Optional[list[str]], typer.Option(metavar="PATTERN", help=(
    "With --recipe or --auto: leave modules matching PATTERN unquantized, as convert --ignore does "
    "(repeatable)."))]
EvalConfig = Annotated[Optional[Path], typer.Option("--config", metavar="FILE", help=(
    "With --recipe or alone: a convert TOML recipe file (recipe, layout, ignore, [[override]], ...) to "
    "emulate; options given here override it."))]
EvalScaleRule = Annotated[Optional[str], typer.Option(
    metavar="RULE", callback=one_of("--scale-rule", "MX scale rule", scale_rule_names),
    help="With --recipe or --auto: the MX scale exponent rule.")]
EvalScaleSearch = Annotated[Optional[str], typer.Option(
    metavar="METHOD", callback=one_of("--scale-search", "scale search", lambda: ["none", "mse"]),
    help="With --recipe or --auto: none or mse block scales.")]
EvalSensitivity = Annotated[Optional[str], typer.Option(
    metavar="N|all", callback=count_or_all,
    help="Also rank the N modules with the largest own error (or all) by the model output error with each "
         "alone quantized: KL mean and top-1 (causal LM), 1 - pooled cosine (encoder). "
         "Costs one extra model pass per module ranked.")]
EvalRevision = Annotated[Optional[str], typer.Option(metavar="REV", help="Hub revision of a --reference repo id.")]
EvalWorkers = Annotated[int, typer.Option(metavar="N", min=1, help=(
    "Split the samples over N processes on this machine, each walking the model on its share "
    "(torch.distributed; under torchrun the ranks come from torchrun)."))]
EvalQuiet = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress bar; stdout gets one line of headline numbers.")]
EvalVerbose = Annotated[bool, typer.Option("--verbose", "-v", help="One stderr line per layer as it finishes.")]
EvalCalibration = Annotated[Optional[str], typer.Option(metavar="DATA", help=(
    "With --auto: the data each module is scored on, as convert --auto --calibration (with --calibration-samples, "
    "--calibration-seq-len, --calibration-batch); the measurement runs on --data."))]
