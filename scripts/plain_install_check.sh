#!/usr/bin/env bash
# The main job from a plain install: a fresh virtual environment with torch and `pip install .`
# (no extras, not editable), then convert a generated tiny Llama and MoE with every recipe and
# inspect and verify each output. The checkpoints are generated with the set-up's .venv
# (transformers is a test dependency, not a runtime one).
set -euo pipefail
cd "$(dirname "$0")/.."
work="${PLAIN_CHECK_DIR:-demo/plain-check}"
rm -rf "$work" && mkdir -p "$work"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip install --quiet torch==2.13.0
"$work/venv/bin/python" -m pip install --quiet .
.venv/bin/python scripts/make_checkpoint.py "$work/llama"
.venv/bin/python scripts/make_checkpoint.py "$work/moe" --arch moe
q="$work/venv/bin/quantcli"
cd "$work"  # away from the source tree, so `import quantcli` can only find the installed package
for src in llama moe; do
  for recipe in fp8 fp8-channel fp8-block mxfp8 mxfp4 nvfp4 int8-channel; do
    "venv/bin/quantcli" convert "$src" "out-$src-$recipe" --recipe "$recipe" --quiet
    "venv/bin/quantcli" inspect "out-$src-$recipe" > /dev/null
    "venv/bin/quantcli" verify "out-$src-$recipe" --reference "$src" --exact --top 1 > /dev/null
  done
done
"venv/bin/python" -c "import quantcli, sys; assert 'site-packages' in quantcli.__file__, quantcli.__file__"
echo "plain install: 14 conversions inspected and verified"
