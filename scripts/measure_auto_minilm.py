"""convert --auto on all-MiniLM-L6-v2: --auto nvfp4,fp8-block at --target-bits 5.0 and 6.0 against
uniform NVFP4 and the hand-written mix "attention fp8-block, MLP nvfp4", each rounded to nearest
and with --rounding gptq, measured by `quantcli eval OUT --reference MODEL` on held-out sentences
(mean and min cosine of the pooled sentence embeddings) and the average bits per weight counted
from the written tensors (every tensor each Linear of the layers writes, over those Linears'
weights). The --auto rows also give the choice's predicted error (the sum of one-module-alone
1 - cosine scores on the calibration data) beside the measured 1 - cosine mean on held-out data.

    .venv/bin/python scripts/measure_auto_minilm.py [--model DIR|ZIP] [--work DIR]
        [--no-gptq | --gptq-only] [--samples N] [--bits B ...] [--auto-only] [--modelopt DIR]

`--modelopt DIR` (scripts/modelopt_auto_peer.py's --out) adds, per ModelOpt run folder there, its
choice converted by quantcli (`--config DIR/<run>/choice.toml`, the same nearest rounding and
format as the --auto rows) and, for the weight-only runs, ModelOpt's own fake-quantized weights
(DIR/<run>/dense) evaluated the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from measure_gptq_minilm import CALIBRATION, evaluate, quantcli  # noqa: E402
from minilm import model_dir  # noqa: E402

HAND_MIX = ('recipe = "nvfp4"\nlayout = "compressed-tensors"\n'
            '[[override]]\npattern = "*attention*"\nrecipe = "fp8-block"\n')


def _tensors(folder: Path) -> dict[str, tuple[int, int]]:
    """name -> (elements, bytes) of every tensor in the folder's shards."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for n in s.keys():
                t = s.get_slice(n)
                shape, dtype = t.get_shape(), t.get_dtype()
                numel = 1
                for d in shape:
                    numel *= d
                size = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "I64": 8, "I32": 4,
                        "F8_E8M0": 1}[dtype]
                out[n] = (numel, numel * size)
    return out


def bits_per_weight(out: Path, model: Path) -> float:
    """Stored bits per weight over the layers' Linears (quantized or left dense), from the files."""
    src, dst = _tensors(model), _tensors(out)
    modules = [n[: -len(".weight")] for n in src if n.startswith("encoder.layer.") and n.endswith(".weight")
               and (n[: -len(".weight")] + ".bias") in src and "LayerNorm" not in n]
    bits = sum(8 * b for n, (_, b) in dst.items() if any(n.startswith(m + ".") and not n.endswith(".bias")
                                                         for m in modules))
    return bits / sum(src[m + ".weight"][0] for m in modules)


def convert(model: Path, out: Path, *args: str) -> None:
    if not (out / "quantcli_manifest.json").exists():
        quantcli("convert", str(model), str(out), "--device", "cpu", "-q", *args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--no-gptq", action="store_true")
    ap.add_argument("--gptq-only", action="store_true", help="the --rounding gptq rows only")
    ap.add_argument("--samples", type=int, default=192, help="calibration sentences (scores and GPTQ)")
    ap.add_argument("--bits", nargs="*", default=["5.0", "6.0"],
                    help="--target-bits of the --auto rows (5.667: the hand mix's own bits)")
    ap.add_argument("--auto-only", action="store_true", help="the --auto rows only (no uniform, no hand mix)")
    ap.add_argument("--modelopt", type=Path, default=None, help="scripts/modelopt_auto_peer.py's --out folder")
    args = ap.parse_args()
    cal = [str(args.samples) if v == "192" else v for v in CALIBRATION]
    model = model_dir(args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-auto-minilm-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "hand.toml").write_text(HAND_MIX)
    rows = []
    print("| checkpoint | rounding | bits/weight | predicted 1-cos (calibration) | cosine mean | cosine min |\n"
          "|---|---|---|---|---|---|")
    for rounding in ([] if args.gptq_only else ["nearest"]) + ([] if args.no_gptq else ["gptq"]):
        gptq = ["--rounding", "gptq", *cal] if rounding == "gptq" else []
        runs = {} if args.auto_only else {
            "uniform nvfp4": ["--recipe", "nvfp4", *gptq],
            "hand mix: attention fp8-block, MLP nvfp4": ["--config", str(work / "hand.toml"), *gptq]}
        for bits in args.bits:
            runs[f"--auto nvfp4,fp8-block --target-bits {bits}"] = [
                "--auto", "nvfp4,fp8-block", "--target-bits", bits, *(gptq or cal)]
        if args.modelopt is not None and rounding == "nearest":
            for run in sorted(p for p in args.modelopt.iterdir() if (p / "choice.toml").exists()):
                runs[f"ModelOpt auto_quantize {run.name}: its choice, converted by quantcli"] = [
                    "--config", str(run / "choice.toml")]
        for label, extra in runs.items():
            out = work / f"{rounding}-{len(rows)}"
            convert(model, out, *extra)
            emb = evaluate(str(out), model)
            record = json.loads((out / "quantcli_manifest.json").read_text()).get("auto")
            predicted = f"{record['predicted_error']:.6f}" if record else ""
            r = {"label": label, "rounding": rounding, "bits": bits_per_weight(out, model), "predicted": predicted,
                 "cosine_mean": emb["cosine_mean"], "cosine_min": emb["cosine_min"], "args": extra}
            rows.append(r)
            print(f"| {label} | {rounding} | {r['bits']:.3f} | {predicted} | {r['cosine_mean']:.6f} | "
                  f"{r['cosine_min']:.6f} |", flush=True)
            (work / "rows.json").write_text(json.dumps(rows, indent=1))
    for run in sorted(p for p in (args.modelopt.iterdir() if args.modelopt else []) if (p / "dense").is_dir()):
        emb = evaluate(str(run / "dense"), model)
        r = {"label": f"ModelOpt auto_quantize {run.name}: its fake-quantized weights", "rounding": "modelopt",
             "bits": None, "predicted": "", "cosine_mean": emb["cosine_mean"], "cosine_min": emb["cosine_min"],
             "args": [str(run / "dense")]}
        rows.append(r)
        print(f"| {r['label']} | modelopt | | | {r['cosine_mean']:.6f} | {r['cosine_min']:.6f} |", flush=True)
        (work / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"rows: {work / 'rows.json'}")


if __name__ == "__main__":
    main()
