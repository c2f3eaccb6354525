"""Which scorer should convert --auto use? The exact one it uses (each module's model output error
with it alone quantized, measured on the calibration data) against cheap proxies, on
all-MiniLM-L6-v2:

- weight SSE (data-free): the weight's own squared rounding error, sum (W - Q(W))^2;
- layer output (data-aware): the module's own output error on the calibration inputs,
  ||(W - Q(W)) X^T||^2 = sum((dW H) * dW), H = X^T X from the source model's inputs to the
  module (one forward over the data for every candidate; no walk per candidate);
- layer output x downstream: the same, times a per-module factor that carries it to the model's
  output, measured by one exact walk with the first candidate (factor = exact / layer output
  there): one exact walk instead of one per candidate.

Takes the output of an `--auto` run (its manifest's `auto` record holds the groups, each option's
bits as written, the budget and the exact scores), then for each proxy:

1. how well it ranks like the exact scores: Spearman's rank correlation over every
   (module, candidate) pair, and over the per-module gains (for each module and pair of its
   candidates, the difference of their errors), the quantity the knapsack trades against bits;
2. the choice it makes at the same budget (the same exact knapsack, the same costs), written as
   exact-name [[override]]s, converted and measured end to end like the exact one:
   `quantcli eval OUT --reference MODEL` on held-out sentences.

    .venv/bin/python scripts/measure_auto_minilm.py --no-gptq --auto-only --bits 5.0 --work W
    .venv/bin/python scripts/measure_auto_scorers.py --auto-run W/nearest-0 [--model DIR] [--work DIR]
        [--samples 192] [--seq-len 128]   (the calibration measure_auto_minilm.py gives --auto)
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
from measure_gptq_minilm import DATA, evaluate, quantcli  # noqa: E402
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


def input_grams(model: Path, samples: int, seq_len: int) -> dict[str, torch.Tensor]:
    """module -> H = X^T X (FP64) of its inputs over the first `samples` calibration sentences,
    each cut to `seq_len` tokens, run through the source model (transformers, FP32)."""
    from transformers import AutoModel, AutoTokenizer

    sentences = (DATA / "calibration_sentences.txt").read_text().splitlines()[:samples]
    tok = AutoTokenizer.from_pretrained(model)
    net = AutoModel.from_pretrained(model, torch_dtype=torch.float32).eval()
    grams: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            grams[name] = grams.get(name, 0) + x.T @ x
        return record

    for name, mod in net.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        for text in sentences:
            net(**tok(text, return_tensors="pt", truncation=True, max_length=seq_len))
    return grams


def output_scores(record: dict, weights: dict[str, torch.Tensor], grams: dict[str, torch.Tensor]
                  ) -> dict[str, dict[str, float]]:
    """module -> candidate -> ||(W - Q(W)) X^T||^2 on the calibration inputs."""
    out: dict[str, dict[str, float]] = {}
    for g in record["groups"]:
        for m in g["modules"]:
            w, h = weights[f"{m}.weight"].double(), grams[m]
            out[m] = {}
            for c in g["options"]:
                r = get_recipe(c)
                dw = w - r.dequantize(r.quantize(m, w.float(), backend="torch"), backend="torch").double()
                out[m][c] = float(((dw @ h) * dw).sum())
    return out


def downstream(proxy: dict[str, dict[str, float]], exact: dict[str, dict[str, float]], anchor: str
               ) -> dict[str, dict[str, float]]:
    """The proxy carried to the model's output by one factor per module, exact / proxy at `anchor`."""
    return {m: {c: v * exact[m][anchor] / max(proxy[m][anchor], 1e-300) for c, v in cands.items()}
            for m, cands in proxy.items()}


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


def _counts(chosen: dict[str, str], record: dict) -> str:
    """How many modules each candidate got: 'nvfp4 14, fp8-block 10'."""
    return ", ".join(f"{c} {n}" for c in record["candidates"] if (n := sum(v == c for v in chosen.values())))


def compare(label: str, record: dict, exact, proxy, model: Path, work: Path) -> tuple[str, dict[str, str]]:
    """Print how `proxy` ranks like `exact`, convert its choice; its table row and its choice."""
    pairs = [(m, c) for m in exact for c in exact[m]]
    every = spearman([exact[m][c] for m, c in pairs], [proxy[m][c] for m, c in pairs])
    cheap = record["candidates"][0]
    trades = [(m, a, b) for m in exact for i, a in enumerate(exact[m]) for b in list(exact[m])[i + 1:]]
    gain = spearman([exact[m][a] - exact[m][b] for m, a, b in trades],
                    [proxy[m][a] - proxy[m][b] for m, a, b in trades])
    chosen = solve(record, proxy)
    toml = [f'recipe = "{cheap}"', f'layout = "{record["layout"]}"']
    for m, c in sorted(chosen.items()):
        if c != cheap:
            toml += ["[[override]]", f'pattern = "{m}"', f'recipe = "{c}"']
    slug = "-".join(w for w in label.split()[:4] if w.isalpha())
    (work / f"{slug}.toml").write_text("\n".join(toml) + "\n")
    out = work / slug
    quantcli("convert", str(model), str(out), "--config", str(work / f"{slug}.toml"), "--device", "cpu", "-q",
             "--overwrite")
    emb = evaluate(str(out), model)
    row = f"| {label} | {every:.3f} | {gain:.3f} | {_counts(chosen, record)} | {emb['cosine_mean']:.6f} | "
    return row + f"{emb['cosine_min']:.6f} |", chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--auto-run", type=Path, required=True, help="an --auto output folder (its manifest)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--samples", type=int, default=192, help="calibration sentences the --auto run used")
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    model = model_dir(args.model)
    work = args.work or Path(tempfile.mkdtemp(prefix="quantcli-auto-scorers-"))
    work.mkdir(parents=True, exist_ok=True)
    record = json.loads((args.auto_run / "quantcli_manifest.json").read_text())["auto"]
    exact = {g_m: s for g in record["groups"] for g_m, s in g["scores"].items()}
    weights = _weights(model)
    layer = output_scores(record, weights, input_grams(model, args.samples, args.seq_len))
    proxies = {"weight SSE (data-free)": proxy_scores(record, weights),
               "layer output (data-aware)": layer,
               f"layer output x downstream (one exact walk, {record['candidates'][0]})":
                   downstream(layer, exact, record["candidates"][0])}
    chosen_exact = {m: g["choice"] for g in record["groups"] for m in g["modules"]}
    emb = evaluate(str(args.auto_run), model)
    print(f"budget {record['target_bits']} bits, candidates {', '.join(record['candidates'])}")
    print("| scorer | Spearman, every (module, candidate) | Spearman, gain | modules per candidate | cosine mean | "
          "cosine min |\n|---|---|---|---|---|---|")
    print(f"| exact (one module alone, on data) | 1 | 1 | {_counts(chosen_exact, record)} | "
          f"{emb['cosine_mean']:.6f} | {emb['cosine_min']:.6f} |")
    for label, proxy in proxies.items():
        row, chosen = compare(label, record, exact, proxy, model, work)
        print(row + f"  ({sum(chosen[m] != chosen_exact[m] for m in chosen)} modules differ from exact)", flush=True)


if __name__ == "__main__":
    main()
