"""Does transformers load what quantcli says it loads, architecture by architecture? The slow
matrix behind tests/test_loader_names.py: tiny random models (tests/tiny_models.py: MoE, VLM,
GPT-NeoX, Falcon, ModernBERT) converted to compressed-tensors with each recipe, then for each
output quantcli's transformers verdict (inspect --json) next to what transformers does with it:
its logits (and a VLM's vision-tower output) against a forward of quantcli's decode (`--recipe
fp32`), loaded by default and, where the verdict names it, with run_compressed=False.

    .venv/bin/python scripts/check_loader_names.py [--kinds qwen3_moe ...] [--recipes nvfp4 ...]
        [--quantcli-path DIR] [--work DIR]

--quantcli-path runs another quantcli tree's convert and inspect (e.g. `git archive` of main in a
folder) to compare before and after. A row is flagged WRONG when the verdict says transformers
loads it (yes/if) and the load fails or its cosine is below 0.999 (0.99 where the config declares
dynamic 8-bit activations), and CONSERVATIVE when the verdict says no and the load matches."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models as tm  # noqa: E402

RECIPES = ["nvfp4", "mxfp4", "int4", "fp8-channel", "int8-channel"]
FLOOR = 0.999
# These configs declare dynamic 8-bit activations, which transformers applies and the decode does not.
W8A8_FLOOR = {"fp8": 0.99, "fp8-channel": 0.99, "fp8-block": 0.99, "int8-channel": 0.99}


def quantcli(args: list[str], path: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PYTHONPATH": path} if path else {})}
    # `python -m` puts the working folder first on sys.path: run in the tree asked for
    return subprocess.run([sys.executable, "-m", "quantcli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=path)


def verdict(out: Path, path: str | None) -> tuple[str, str]:
    doc = json.loads(quantcli(["inspect", out, "--json"], path).stdout)
    return next((j["loads"], j["reason"]) for j in doc["engines"] if j["engine"] == "transformers")


def compare(kind: str, out: Path, dec: Path, **kwargs) -> str:
    """`cos 1.0000` (text; `/ vision 1.0000` for a VLM), or the load's error in one line."""
    try:
        got, ref = tm.load(out, **kwargs), tm.load(dec)
        text = f"cos {tm.cosine(tm.output(got, tm.IDS), tm.output(ref, tm.IDS)):.4f}"
        if kind in tm.VISION:
            text += f" / vision {tm.cosine(tm.vision(got, kind), tm.vision(ref, kind)):.4f}"
        return text
    except Exception as exc:  # noqa: BLE001 (the row reports whatever transformers raised)
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"


def cosines(text: str) -> list[float]:
    """The cosines `compare` wrote (nan included, which no floor passes); none for an error."""
    return [float(v) for v in re.findall(r"(?:cos|vision) (\S+)", text)]


def row(kind: str, recipe: str, src: Path, work: Path, path: str | None) -> str:
    out = work / f"{kind}-{recipe}"
    done = quantcli(["convert", src, out, "--recipe", recipe, "--layout", "compressed-tensors", "-q",
                     "--overwrite"], path)
    if done.returncode:
        return f"{kind:<12} {recipe:<13} convert refused: {done.stderr.strip().splitlines()[-1][:110]}"
    quantcli(["convert", out, work / f"{kind}-{recipe}-dec", "--recipe", "fp32", "-q", "--overwrite"], path)
    loads, reason = verdict(out, path)
    default = compare(kind, out, work / f"{kind}-{recipe}-dec")
    line = f"{kind:<12} {recipe:<13} claim {loads:<4} default: {default}"
    if loads == "if" and "run_compressed=False" in reason:
        from transformers import CompressedTensorsConfig

        dense = compare(kind, out, work / f"{kind}-{recipe}-dec",
                        quantization_config=CompressedTensorsConfig(run_compressed=False))
        line += f"; run_compressed=False: {dense}"
        default = dense
    found = cosines(default)
    good = bool(found) and all(c >= W8A8_FLOOR.get(recipe, FLOOR) for c in found)  # nan fails
    flag = "WRONG" if loads in ("yes", "if") and not good else "CONSERVATIVE" if loads == "no" and good else ""
    return f"{line}  {flag}".rstrip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=[*tm.CLASSES, *tm.MORE])
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--quantcli-path", help="the quantcli tree to run (put on PYTHONPATH)")
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    work = args.work or Path(tempfile.mkdtemp(prefix="loader-names-"))
    for kind in args.kinds:
        src = work / "src" / kind
        if not src.exists():
            tm.build(kind, src)
        for recipe in args.recipes:
            print(row(kind, recipe, src, work, args.quantcli_path), flush=True)


if __name__ == "__main__":
    main()
