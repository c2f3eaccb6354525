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
  for recipe in fp8 fp8-channel fp8-block mxfp8 mxfp4 nvfp4 int8-channel int4; do
    "venv/bin/quantcli" convert "$src" "out-$src-$recipe" --recipe "$recipe" --quiet
    "venv/bin/quantcli" inspect "out-$src-$recipe" > /dev/null
    "venv/bin/quantcli" verify "out-$src-$recipe" --reference "$src" --exact --top 1 > /dev/null
  done
done
"venv/bin/python" -c "import quantcli, sys; assert 'site-packages' in quantcli.__file__, quantcli.__file__"
# the JSON schemas ship as package data: a --json document validates against its installed schema's keys
"venv/bin/quantcli" recipes --json > recipes.json
"venv/bin/python" -c "
import json; from quantcli.reports import json_schema
doc, schema = json.load(open('recipes.json')), json_schema('recipes')
assert doc['schema_version'] == 1 and schema['\$id'].endswith('recipes'), schema.get('\$id')"
# calibration needs the optional extra: a plain install refuses it in one line, writing nothing
echo '{"input_ids": [1, 2, 3]}' > ids.jsonl
if "venv/bin/quantcli" convert llama out-cal --recipe nvfp4 --activations static --calibration ids.jsonl 2> cal.err; then
  echo "calibration without the extra should be refused"; exit 1
fi
grep -q "calibrate extra" cal.err && [ "$(wc -l < cal.err)" -eq 1 ] && [ ! -e out-cal ] && [ ! -e out-cal.partial ]
echo "plain install: 14 conversions inspected and verified; schemas shipped; calibration refused without its extra"
