"""Write a small random Hugging Face checkpoint (Llama, Mixtral-style MoE, or gpt-oss-style MoE
with 3-D expert stacks) for demos and tests.

    python scripts/make_checkpoint.py demo/tiny-llama
    python scripts/make_checkpoint.py demo/tiny-moe --arch moe --shards 2
    python scripts/make_checkpoint.py demo/moe-8x --arch moe --experts 8 --hidden 512 --layers 4
    python scripts/make_checkpoint.py demo/tiny-gpt-oss --arch gpt-oss   # for --layout gpt-oss

Writes exactly --shards safetensors files (fewer only when there are fewer tensors). Run again
into the same folder, it first deletes the weights of the earlier run (*.safetensors and the
index): stale shards (say 5 where 4 are written now) would otherwise stay beside the new index.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantcli.testing import make_gpt_oss, make_llama, make_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder to write (created; an earlier run's weights are replaced)")
    ap.add_argument("--arch", choices=["llama", "moe", "gpt-oss"], default="llama",
                    help="llama: dense Llama; moe: Mixtral-style experts (one Linear per expert); gpt-oss: "
                         "GptOss, experts as 3-D stacks, hidden rounded up to a multiple of 32 (default: llama)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    ap.add_argument("--experts", type=int, default=4, help="--arch moe, gpt-oss: experts per layer (default: 4)")
    ap.add_argument("--shards", type=int, default=2, help="safetensors files to write (default: 2)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    args = ap.parse_args()
    for option in ("hidden", "layers", "experts", "shards"):
        if getattr(args, option) < 1:
            ap.error(f"--{option} {getattr(args, option)}: must be 1 or more")
    if args.out.is_dir():  # the earlier run's weights; other files are rewritten or kept
        for old in [*args.out.glob("*.safetensors"), *args.out.glob("*.safetensors.index.json")]:
            old.unlink()
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's one-step bar says nothing here
    size = dict(hidden=args.hidden, layers=args.layers, shards=args.shards, seed=args.seed)
    if args.arch == "llama":
        make_llama(args.out, **size)
    elif args.arch == "gpt-oss":
        make_gpt_oss(args.out, experts=args.experts, **size)
    else:
        make_moe(args.out, experts=args.experts, **size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
