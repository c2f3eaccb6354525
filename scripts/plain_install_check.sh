#!/usr/bin/env bash
# The main job from a plain install: a fresh virtual environment with torch and `pip install .`
# (no extras, not editable; torch linked from the set-up's .venv, below), then convert a generated tiny Llama and MoE with every recipe and
# inspect and verify each output. The checkpoints are generated with the set-up's .venv
# (transformers is a test dependency, not a runtime one).
set -euo pipefail
cd "$(dirname "$0")/.."
work="${PLAIN_CHECK_DIR:-demo/plain-check}"
rm -rf "$work" && mkdir -p "$work"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
# torch: the set-up's own (the pinned CPU wheel, 2.13.0), linked in rather than installed again. Its
# 14,000 files, written here and deleted after, took minutes of CI on a loaded disk; pip takes the
# link for an installed torch and installs torch's own dependencies, quantcli's and nothing else.
site() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])'; }
dev="$(site .venv/bin/python)" plain="$(site "$work/venv/bin/python")"
for name in torch torchgen functorch "$(cd "$dev" && echo torch-2.13.0*.dist-info)"; do
  ln -s "$dev/$name" "$plain/$name"
done
"$work/venv/bin/python" -m pip install --quiet .
.venv/bin/python scripts/make_checkpoint.py "$work/llama"
.venv/bin/python scripts/make_checkpoint.py "$work/moe" --arch moe
cd "$work"  # away from the source tree, so `import quantcli` can only find the installed package
# Every recipe on both checkpoints: convert, inspect, verify --exact, each to exit 0. All in one
# process of the installed package, through main() as the tests run the command line: a process
# per command would spend most of its time importing torch. The console script runs below.
recipes="fp8 fp8-channel fp8-block mxfp8 mxfp4 nvfp4 int8-channel int4"
if ! "venv/bin/python" - "$recipes" llama moe > main-job.log 2>&1 <<'PY'
import sys

from quantcli.cli import main


def quantcli(*args: str) -> None:
    try:
        main(list(args))
    except SystemExit as exc:
        if exc.code:
            sys.exit(f"plain install: quantcli {' '.join(args)} exited {exc.code}")


recipes, *sources = sys.argv[1:]
for src in sources:
    for recipe in recipes.split():
        quantcli("convert", src, f"out-{src}-{recipe}", "--recipe", recipe, "--quiet")
        quantcli("inspect", f"out-{src}-{recipe}")
        quantcli("verify", f"out-{src}-{recipe}", "--reference", src, "--exact", "--top", "1")
PY
then
  tail -n 20 main-job.log
  exit 1
fi
"venv/bin/python" -c "import quantcli, sys; assert 'site-packages' in quantcli.__file__, quantcli.__file__"
# the JSON schemas ship as package data: a --json document validates against its installed schema's keys
"venv/bin/quantcli" recipes --json > recipes.json  # the console script
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
echo "plain install: $((2 * $(wc -w <<< "$recipes"))) conversions inspected and verified; schemas shipped;" \
  "calibration refused without its extra"
