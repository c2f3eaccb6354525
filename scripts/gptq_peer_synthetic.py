"""llm-compressor's GPTQ on a causal LM and token ids (scripts/bench_gptq_peers.py --synthetic):
the other side of quantcli's `convert --rounding gptq --calibration IDS.jsonl`, run in the venv
that holds llm-compressor (scripts/gptq_peers.py says how to make it).

    /work/llmc-venv/bin/python scripts/gptq_peer_synthetic.py --model SRC --ids IDS.jsonl --out OUT
        [--scheme NVFP4A16|W4A16]

GPTQModifier(scheme, targets=["Linear"], ignore=["lm_head"]) with every other default (block 128,
dampening 0.01, static act order; see gptq_peers.py), oneshot's sequential pipeline over the
decoder layers, the model loaded in FP32 (quantcli's walk runs the layers in FP32 too), every
sample of IDS.jsonl (one {"input_ids": [...]} a line) at its full length, then save_pretrained
(compressed-tensors). The model has no tokenizer: oneshot wants a processor when it is given a
dataset, so a word-level one over the ids' vocabulary stands in (the dataset is already
tokenized; the processor is not used to tokenize). Prints one line RESULT {json} with the
seconds of load, oneshot and save.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="one {\"input_ids\": [...]} a line")
    ap.add_argument("--out", required=True)
    ap.add_argument("--scheme", default="NVFP4A16", choices=("NVFP4A16", "W4A16"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the dtype the model is loaded and run in (default float32, as quantcli's walk)")
    args = ap.parse_args()
    start = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)  # the calibration sampler's permutation
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    rows = [json.loads(line)["input_ids"] for line in Path(args.ids).read_text().splitlines() if line.strip()]
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    processor = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                        pad_token="t0")
    dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    loaded = time.perf_counter()
    oneshot(model=model, processor=processor, dataset=dataset, num_calibration_samples=len(rows),
            max_seq_length=max(len(r) for r in rows),
            recipe=GPTQModifier(scheme=args.scheme, targets=["Linear"], ignore=["lm_head"]))
    solved = time.perf_counter()
    quantized = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    model.save_pretrained(args.out, save_compressed=True)
    print("RESULT " + json.dumps({"quantized": len(quantized), "samples": len(rows), "load_s": loaded - start,
                                  "oneshot_s": solved - loaded, "save_s": time.perf_counter() - solved}), flush=True)


if __name__ == "__main__":
    main()
