"""Would a scale search help the FP8 recipes (fp8 per-tensor, fp8-channel, fp8-block)? Their
F32 scales have no code grid to search, so the candidates are a shrink grid, scale * (1 - i/100)
for i = 0..SHRINK, the best per scale block by squared error of the dequantized weights (what
issue 13 proposed). Measured in plain torch on the dequantized values (no bytes are written):
relative weight error on Laplace and Student-t weights, and on all-MiniLM-L6-v2 (see
scripts/measure_scale_search.py) the weight error and the model's output against the original.

    python scripts/measure_fp8_shrink.py [--model DIR_OR_ZIP] [--shrink 20]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from measure_scale_search import EVAL, embed, linears, load, output_error  # scripts/ on sys.path
from minilm import model_dir

from quantcli.kernels import reference as R

BLOCK = 128


def blocks(x: torch.Tensor, geometry: str) -> torch.Tensor:
    """x as [blocks, elements] for the scale geometry (128 x 128 tiles zero-padded)."""
    if geometry == "tensor":
        return x.reshape(1, -1)
    if geometry == "row":
        return x
    n, k = x.shape
    p = F.pad(x, (0, -k % BLOCK, 0, -n % BLOCK))
    nb, kb = p.shape[0] // BLOCK, p.shape[1] // BLOCK
    return p.reshape(nb, BLOCK, kb, BLOCK).permute(0, 2, 1, 3).reshape(nb * kb, BLOCK * BLOCK)


def fake_quant(b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return R.decode_e4m3(R.encode_e4m3(b / scale[:, None])) * scale[:, None]


def quantize(x: torch.Tensor, geometry: str, shrink: int) -> torch.Tensor:
    """Dequantized blocks [blocks, elements] (padding included) with the best shrunk scale."""
    b = blocks(x.float(), geometry)
    s0 = R.fp8_scale(b.abs().amax(-1))
    best = fake_quant(b, s0)
    best_err = ((best - b) ** 2).sum(-1)
    for i in range(1, shrink + 1):
        q = fake_quant(b, s0 * (1 - i / 100))
        err = ((q - b) ** 2).sum(-1)
        better = err < best_err
        best = torch.where(better[:, None], q, best)
        best_err = torch.where(better, err, best_err)
    return best


def unblock(q: torch.Tensor, shape: tuple[int, int], geometry: str) -> torch.Tensor:
    if geometry != "block":
        return q.reshape(shape)
    n, k = shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    return q.reshape(nb, kb, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(nb * BLOCK, kb * BLOCK)[:n, :k]


def rel_err(pairs) -> float:
    num = sum(float(((d - w) ** 2).sum()) for d, w in pairs)
    return (num / sum(float((w * w).sum()) for _, w in pairs)) ** 0.5


def random_weights(kind: str) -> torch.Tensor:
    torch.manual_seed(0)
    dist = torch.distributions.Laplace(0.0, 0.02) if kind == "laplace" else torch.distributions.StudentT(3.0)
    return dist.sample((1024, 1024)).to(torch.bfloat16).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder or the package's model.zip (default: the installed package)")
    ap.add_argument("--shrink", type=int, default=20)
    args = ap.parse_args()
    geometries = {"fp8": "tensor", "fp8-channel": "row", "fp8-block": "block"}
    print("| weights | recipe | absmax rel err | shrink rel err | change |\n|---|---|---|---|---|")
    for kind in ("laplace", "student-t"):
        w = random_weights(kind)
        for recipe, geo in geometries.items():
            a = rel_err([(unblock(quantize(w, geo, 0), w.shape, geo), w)])
            s = rel_err([(unblock(quantize(w, geo, args.shrink), w.shape, geo), w)])
            print(f"| {kind} 1024x1024 | {recipe} | {a:.5f} | {s:.5f} | {100 * (s / a - 1):+.2f} % |")
    model, tok = load(model_dir(args.model))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ref_hidden, ref_emb = embed(model, tok, EVAL)
    print("\n| model | recipe | scales | weight rel err | 1 - cosine | hidden-state rel err |\n"
          "|---|---|---|---|---|---|")
    for recipe, geo in geometries.items():
        for label, shrink in (("absmax", 0), (f"shrink 0..{args.shrink} %", args.shrink)):
            state, pairs = dict(original), []
            for name, lin in linears(model).items():
                w = lin.weight.detach().float().clone()  # load_state_dict below writes into the weight
                d = unblock(quantize(w, geo, shrink), tuple(w.shape), geo)
                pairs.append((d, w))
                state[f"{name}.weight"] = d.to(lin.weight.dtype)
            cos, herr = output_error(model, tok, state, original, (ref_hidden, ref_emb))
            print(f"| all-MiniLM-L6-v2 | {recipe} | {label} | {rel_err(pairs):.5f} | {1 - cos:.2e} | {herr:.4f} |")


if __name__ == "__main__":
    main()
