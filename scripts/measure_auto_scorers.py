"""Which scorer should convert --auto use? The exact one it uses (each module's model output error
with it alone quantized, measured on the calibration data) against a cheap, data-free proxy (the
weight's own squared rounding error, sum (W - Q(W))^2), both on all-MiniLM-L6-v2.

Takes the output of an `--auto` run (its manifest's `auto` record holds the groups, each option's
bits as written, the budget and the exact scores), then:

1. how well the proxy ranks like the exact scores: Spearman's rank correlation over every
   (module, candidate) pair, and over the per-module gains (error of the cheaper candidate minus
   the dearer one's), the quantity the knapsack trades against bits;
2. the choice each scorer makes at the same budget (the same exact knapsack, the same costs), the
   proxy's written as exact-name [[override]]s, converted and measured end to end like the exact
   one: `quantcli eval OUT --reference MODEL` on held-out sentences.

    .venv/bin/python scripts/measure_auto_minilm.py --samples 32 --no-gptq --auto-only --bits 5.667 --work W
    .venv/bin/python scripts/measure_auto_scorers.py --auto-run W/nearest-0 [--model DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).parent))
from measure_gptq_minilm import evaluate, quantcli  # noqa: E402
from minilm import model_dir  # noqa: E402

from quantcli.planning import knapsack  # noqa: E402
from quantcli.recipes import get_recipe  # noqa: E402


def _weights(model: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({n: s.get_tensor(n) for n in s.keys() if n.endswith(".weight")})
    return out


def proxy_scores(record: dict, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """module -> candidate -> sum (W - Q(W))^2, Q rounding to nearest in the candidate's format."""
    out: dict[str, dict[str, float]] = {}
    for g in record["groups"]:
        for m in g["modules"]:
            w = weights[f"{m}.weight"].float()
            out[m] = {}
            for c in g["options"]:
                r = get_recipe(c)
                d = r.dequantize(r.quantize(m, w, backend="torch"), backend="torch").float()
                out[m][c] = float(((w - d) ** 2).sum())
    return out


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    for r, i in enumerate(order):
        ranks[i] = float(r)
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = torch.tensor(_ranks(a)), torch.tensor(_ranks(b))
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def solve(record: dict, scores: dict[str, dict[str, float]]) -> dict[str, str]:
    """module -> candidate: the exact knapsack on these scores at the record's budget and costs."""
    groups = record["groups"]
    options = [[knapsack.Option(o["bits"], sum(scores[m][c] for m in g["modules"])) for c, o in g["options"].items()]
               for g in groups]
    found = knapsack.solve(options, record["budget_bits"])
    picks = [list(g["options"])[k] for g, k in zip(groups, found.choice)]
    return {m: c for g, c in zip(groups, picks) for m in g["modules"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auto-run", type=Path, required=True, help="an --auto output folder (its manifest)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    model = model_dir(args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-auto-scorers-"))
    work.mkdir(parents=True, exist_ok=True)
    record = json.loads((args.auto_run / "quantcli_manifest.json").read_text())["auto"]
    exact = {g_m: s for g in record["groups"] for g_m, s in g["scores"].items()}
    proxy = proxy_scores(record, _weights(model))
    pairs = [(m, c) for m in exact for c in exact[m]]
    every = spearman([exact[m][c] for m, c in pairs], [proxy[m][c] for m, c in pairs])
    print(f"Spearman, every (module, candidate): {every:.3f}")
    cheap, dear = record["candidates"][0], record["candidates"][1]
    gain_e = [exact[m][cheap] - exact[m][dear] for m in exact]
    gain_p = [proxy[m][cheap] - proxy[m][dear] for m in exact]
    print(f"Spearman, per-module gain of {dear} over {cheap}: {spearman(gain_e, gain_p):.3f}")
    chosen_exact = {m: c for g in record["groups"] for m in g["modules"] for c in [g["choice"]]}
    chosen_proxy = solve(record, proxy)
    differ = sum(chosen_exact[m] != chosen_proxy[m] for m in chosen_exact)
    print(f"modules chosen differently: {differ} of {len(chosen_exact)}")
    main_recipe = cheap
    toml = [f'recipe = "{main_recipe}"', f'layout = "{record["layout"]}"']
    for m, c in sorted(chosen_proxy.items()):
        if c != main_recipe:
            toml += ["[[override]]", f'pattern = "{m}"', f'recipe = "{c}"']
    (work / "proxy.toml").write_text("\n".join(toml) + "\n")
    out = work / "proxy"
    quantcli("convert", str(model), str(out), "--config", str(work / "proxy.toml"), "--device", "cpu", "-q",
             "--overwrite")
    emb_proxy = evaluate(str(out), model)
    emb_exact = evaluate(str(args.auto_run), model)
    print("| scorer | modules in " + dear + " | cosine mean | cosine min |\n|---|---|---|---|")
    for label, chosen, emb in (("exact (one module alone, on data)", chosen_exact, emb_exact),
                               ("proxy (weight SSE, data-free)", chosen_proxy, emb_proxy)):
        n = sum(c == dear for c in chosen.values())
        print(f"| {label} | {n} | {emb['cosine_mean']:.6f} | {emb['cosine_min']:.6f} |")


if __name__ == "__main__":
    main()
