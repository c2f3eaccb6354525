#!/usr/bin/env bash
# One command for a newcomer: a virtual environment with quantcli and its test dependencies,
# then a tiny Llama checkpoint generated locally and converted to NVFP4 and verified.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0          # the CPU build; pin it so no CUDA wheel is fetched
python -m pip install --quiet -e ".[test]"
python scripts/make_checkpoint.py demo/tiny-llama
# 8 calibration samples of token ids, which the README's calibration, GPTQ and --auto examples use
python -c "import json; [print(json.dumps({'input_ids': [(7 * i + 3 * j) % 500 for j in range(32)]})) for i in range(8)]" > demo/calib.jsonl
quantcli convert demo/tiny-llama demo/tiny-llama-nvfp4 --recipe nvfp4 --overwrite
quantcli inspect demo/tiny-llama-nvfp4
quantcli verify demo/tiny-llama-nvfp4 --reference demo/tiny-llama --exact --top 3
