"""Where `convert --rounding gptq --calibration` spends its time: one conversion of a synthetic
Llama (bench_calibrate's MAKE) run in this process under cProfile, its cumulative times split
into the parts of docs/gptq.md's "Where the time goes" table.

    python scripts/profile_gptq.py                              # hidden 512, 2 layers, 16 x 128 tokens
    python scripts/profile_gptq.py --hidden 1024 --layers 4 --samples 32
    python scripts/profile_gptq.py --minilm --samples 190      # all-MiniLM-L6-v2, calibration_sentences.txt
    python scripts/profile_gptq.py --minilm --model DIR_OR_ZIP  # where the wheel is not installed here

Each part is the cumulative time of the functions named in PARTS, less the parts nested in it,
so the rows add up to the wall time (cProfile's own overhead is spread over them; the wall time
without the profiler is printed too, from a second, unprofiled run in a child process).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_calibrate import make_synthetic  # noqa: E402
from minilm import model_dir  # noqa: E402

SENTENCES = Path(__file__).parent / "data" / "calibration_sentences.txt"

# (file suffix, function name) -> cumulative seconds, from pstats
CALLS = {
    "walks": ("model/layers.py", "walk_layers"),
    "record": ("passes/weight_walk.py", "record"),
    "fold": ("passes/ordered_sum.py", "_fold_round"),
    "last": ("passes/ordered_sum.py", "finish"),  # the last groups' X^T X (one process: no round left)
    "update": ("passes/weight_walk.py", "update"),
    "stage": ("passes/weight_walk.py", "_stage"),
    "gptq": ("rounding/gptq.py", "gptq_quantize"),
    "factor": ("rounding/gptq.py", "upper_inverse_factor"),
    "columns": ("rounding/gptq.py", "_columns"),
    "choose": ("rounding/spans.py", "choose"),
    "reload": ("passes/weight_walk.py", "get"),
    "shards": ("convert/shard.py", "convert_shard"),
}


def cumulative(stats: pstats.Stats) -> dict[str, float]:
    out = dict.fromkeys(CALLS, 0.0)
    for (path, _, name), (_, _, _, cum, _) in stats.stats.items():
        for key, (suffix, fn) in CALLS.items():
            if name == fn and path.endswith(suffix):
                out[key] += cum
    return out


def parts(c: dict[str, float], wall: float) -> list[tuple[str, float]]:
    statistics = c["record"] + c["fold"] + c["last"]
    rows = [
        ("forward (the walk's layer runs and reloads; a calibration walk too if one runs)",
         c["walks"] - statistics - c["update"]),
        ("statistics (the rows recorded, X^T X of each group, FP64, the ordered sum)", statistics),
        ("factorization (dampening, Cholesky, H^-1, its upper factor)", c["factor"]),
        ("column loop (rounding, err, the lazy updates)", c["columns"] - c["choose"]),
        ("scale choice (Spans.choose)", c["choose"]),
        # the pass factorizes each H once, before gptq_quantize (GptqPass._factor): not nested in it
        ("GPTQ's rest (round to nearest, output errors, encoding)", c["gptq"] - c["columns"]),
        ("staging (layout, the staged layer's file, reloading it)", c["update"] - c["gptq"] - c["factor"]),
        ("writing (the output shards)", c["shards"]),
    ]
    rows.append(("other (planning, reading the data, model build, manifest)", wall - sum(s for _, s in rows)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--recipe", default="nvfp4")
    ap.add_argument("--keep", help="work folder to keep (default: a temporary one, removed)")
    ap.add_argument("--minilm", action="store_true", help="all-MiniLM-L6-v2 on calibration_sentences.txt instead")
    ap.add_argument("--model", help="with --minilm: its folder or zip (default: the installed wheel's)")
    args = ap.parse_args()
    root = Path(args.keep or tempfile.mkdtemp(prefix="profile_gptq_"))
    root.mkdir(parents=True, exist_ok=True)
    src, dst, data = root / "src", root / "dst", root / "ids.jsonl"
    try:
        if args.minilm:
            src, data = model_dir(args.model), SENTENCES
        else:
            make_synthetic(src, data, args)
        argv = ["convert", str(src), str(dst), "--recipe", args.recipe, "--device", "cpu", "--quiet", "--rounding",
                "gptq", "--calibration", str(data), "--calibration-samples", str(args.samples),
                "--calibration-seq-len", str(args.seq_len)]
        shutil.rmtree(dst, ignore_errors=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantcli", *argv], check=True, stdout=subprocess.DEVNULL)
        plain_wall = time.perf_counter() - t
        shutil.rmtree(dst)
        from quantcli.cli import entry
        sys.argv = ["quantcli", *argv]
        prof = cProfile.Profile()
        t = time.perf_counter()
        try:
            prof.runcall(entry)
        except SystemExit as e:
            if e.code:
                raise
        wall = time.perf_counter() - t
        model = ("all-MiniLM-L6-v2" if args.minilm else f"Llama hidden {args.hidden}, intermediate "
                 f"{args.intermediate}, {args.layers} layers, vocab {args.vocab}")
        print(f"model: {model}, recipe {args.recipe}; data: {args.samples} samples x {args.seq_len} tokens; CPU")
        print(f"wall: {plain_wall:.1f} s unprofiled, {wall:.1f} s under cProfile\n")
        print("| part | seconds | share |\n|---|---|---|")
        for label, secs in parts(cumulative(pstats.Stats(prof)), wall):
            print(f"| {label} | {secs:.2f} | {100 * secs / wall:.0f}% |")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
