"""What people read: --help of every command and inspect's output at 80 and 200 columns for a
dense and an MoE checkpoint, compared with snapshots in tests/data/snapshots/, plus the rules
every such output keeps: no ambiguous row, no Python repr, no name cut in its tail.

Regenerate the snapshots after a deliberate change with
`QUANTCLI_RESNAPSHOT=1 python -m pytest tests/test_cli_output.py` and say why in the commit.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from test_grouping import expand

from quantcli.testing import make_llama, make_moe

SNAPSHOTS = Path(__file__).parent / "data" / "snapshots"
REPRS = ("{'", "[(", "<list", "<str>", "<path>", "<int>", "OMITTED")
COMMANDS = ([], ["convert"], ["inspect"], ["verify"], ["eval"], ["recipes"], ["layouts"], ["push"])


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / name
    text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"  # rich pads lines with spaces
    if os.environ.get("QUANTCLI_RESNAPSHOT") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}; run with QUANTCLI_RESNAPSHOT=1 to write it"
    assert text == path.read_text(), f"{name} differs from its snapshot (QUANTCLI_RESNAPSHOT=1 if deliberate)"


def assert_readable(text: str) -> None:
    for r in REPRS:
        assert r not in text, f"Python repr {r!r} in output"
    assert not re.search(r"…(\s|│|$)", text, re.MULTILINE), "a cell was cut at its end"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A dense Llama and an MoE, both converted to NVFP4, under fixed relative names."""
    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("out")
    make_llama(root / "llama", hidden=64, layers=2, shards=2, seed=0)
    make_moe(root / "moe", hidden=64, layers=2, shards=2, seed=0, experts=4)
    for name in ("llama", "moe"):
        with pytest.raises(SystemExit) as exc:
            main(["convert", str(root / name), str(root / f"{name}-nvfp4"), "--recipe", "nvfp4", "--quiet"])
        assert exc.value.code in (0, None)
    return root


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0] if c else "quantcli")
def test_help_snapshot(run_cli, monkeypatch, command):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run_cli(*command, "--help")
    assert code == 0
    assert run_cli(*command, "-h")[1] == out  # -h is --help
    assert_readable(out)
    assert not re.search(r"\{[A-Z_]+\}", out), "a placeholder in braces"
    assert not re.search(r"[A-Za-z]-$", out, re.M), "a word split at a hyphen across lines (--target- / bits)"
    check_snapshot(f"help-{command[0] if command else 'quantcli'}.txt", out)


def test_top_level_help_documents_exit_codes_and_completion(run_cli):
    out = run_cli("--help")[1]
    assert "Exit codes: 0" in out and "130 interrupted" in out
    assert "--install-completion" in out
    convert = run_cli("convert", "--help")[1]
    assert "[required]" in convert and "[default: auto]" in convert


@pytest.mark.parametrize("width", [80, 200])
@pytest.mark.parametrize("name", ["llama", "moe"])
def test_inspect_snapshot(run_cli, monkeypatch, checkpoints, name, width):
    monkeypatch.chdir(checkpoints)  # the snapshot shows a relative path, not the temp folder
    monkeypatch.setenv("COLUMNS", str(width))
    code, out, err = run_cli("inspect", f"{name}-nvfp4")
    assert code == 0, err
    assert_readable(out)
    modules = [m["module"] for m in json.loads(run_cli("inspect", f"{name}-nvfp4", "--json")[1])["modules"]]
    labels = set(re.findall(r"model\.[\w.{},]+", out))
    for m in modules:  # every module is named by exactly one row: no row hides or shares a name
        assert len([label for label in labels if m in expand(label)]) == 1, m
    assert len(out.splitlines()) < len(modules) * 3 or name == "llama"  # grouped, not one row per module
    check_snapshot(f"inspect-{name}-{width}.txt", out)


def test_per_tensor_lists_every_module_and_stats_are_tables(run_cli, monkeypatch, checkpoints):
    monkeypatch.chdir(checkpoints)
    monkeypatch.setenv("COLUMNS", "200")
    out = run_cli("inspect", "moe-nvfp4", "--per-tensor")[1]
    assert "model.layers.1.block_sparse_moe.experts.3.w2" in out and "{0..3}" not in out
    out = run_cli("inspect", "moe-nvfp4", "--stats")[1]
    assert_readable(out)
    assert "data (--stats)" in out and "saturated (max)" in out


def test_dry_run_is_grouped_and_convert_summary_names_dense_reasons(run_cli, monkeypatch, checkpoints):
    monkeypatch.chdir(checkpoints)
    monkeypatch.setenv("COLUMNS", "200")
    out = run_cli("convert", "moe", "x", "--recipe", "nvfp4", "--dry-run")[1]
    assert "model.layers.{0,1}.block_sparse_moe.experts.{0..3}.w1.weight │ 8 " in out
    assert "excluded model.layers.{0,1}.block_sparse_moe.gate (2): MoE router/gate" in out
    assert out.count("\n") < run_cli("convert", "moe", "x", "--recipe", "nvfp4", "--dry-run", "-v")[1].count("\n")
    code, out, err = run_cli("convert", "moe", "q", "--recipe", "fp8", "--quiet")
    assert (code, out) == (0, "q\n"), err
    out = run_cli("convert", "moe", "s", "--recipe", "fp8")[1]
    assert "left dense: 2 MoE routers/gates, 1 output head" in out
    assert "next: quantcli verify s --reference moe" in out
    assert re.search(r" at \d+\.\d\d (B|KiB|MiB|GiB)/s\)", out)  # binary units, as the progress bar


def test_next_verify_line_reads_the_same_hub_revision_and_cache(tiny_llama, tmp_path, run_cli, monkeypatch):
    """A Hub source opened with --revision and --cache-dir: the suggested verify carries both
    (quoted), and runs as printed with only that cache, offline, against that revision."""
    import shlex

    import huggingface_hub.constants as constants
    from test_hub_cache import COMMIT, COMMIT2, folder_files, put_in_cache

    cache = tmp_path / "my cache"  # a space: the line must quote it
    files = folder_files(tiny_llama)
    put_in_cache(cache, "acme/tiny-llama", files, COMMIT)
    config = json.loads(files["config.json"])
    files2 = {**files, "config.json": json.dumps({**config, "rope_theta": 1234.0}).encode()}
    put_in_cache(cache, "acme/tiny-llama", files2, COMMIT2, refs=("v2",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))  # empty
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("convert", "acme/tiny-llama", "q", "--recipe", "fp8", "--revision", "v2",
                             "--cache-dir", cache)
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if ln.startswith("next: "))
    assert line == f"next: quantcli verify q --reference acme/tiny-llama --revision v2 --cache-dir '{cache}'"
    code, out, err = run_cli(*shlex.split(line.removeprefix("next: quantcli ")), "-q")
    assert code == 0 and out.strip() == "PASS", (out, err)
    out = run_cli("convert", tiny_llama, "local", "--recipe", "fp8", "--cache-dir", cache)[1]
    assert f"next: quantcli verify local --reference {tiny_llama}\n" in out  # a local source reads no cache


def test_recipes_and_layouts_list_the_registries(run_cli):
    from quantcli.formats.layouts import LAYOUTS
    from quantcli.recipes import RECIPES

    doc = json.loads(run_cli("recipes", "--json")[1])
    assert [r["name"] for r in doc["recipes"]] == list(RECIPES)
    nvfp4 = next(r for r in doc["recipes"] if r["name"] == "nvfp4")
    assert (nvfp4["block"], nvfp4["block_scale"], nvfp4["global_scale"], nvfp4["bits_per_param"]) == \
        ("1x16", "e4m3fn", "f32", 4.5)
    doc = json.loads(run_cli("layouts", "--json")[1])
    for name, layout in LAYOUTS.items():  # the matrix is the layout tables, not a copy
        for recipe, cell in doc["loadability"][name].items():
            assert (cell == "loads") == layout.supports(recipe)
    assert doc["loadability"]["modelopt"]["mxfp4"] == "read only"
    text = run_cli("layouts")[1]
    assert_readable(text)
    assert "TensorRT-LLM" in text


def test_verify_reports_progress_per_module_and_draws_a_bar(checkpoints):
    """verify's progress callback: every module read back, then compared, counts rising to the
    total; PhaseBar draws it on a terminal (modules done / total and the module's tail)."""
    import io

    from rich.console import Console

    from quantcli.cli.bars import PhaseBar
    from quantcli.verify import verify_checkpoint

    calls = []
    report = verify_checkpoint(str(checkpoints / "moe-nvfp4"), reference=str(checkpoints / "moe"),
                               progress=lambda *a: calls.append(a))
    assert report.passed
    for phase in ("reading", "comparing"):
        seen = [c for c in calls if c[0] == phase]
        total = report.modules
        assert seen[-1] == (phase, total, total, "") and all(c[2] == total for c in seen)
        assert [c[1] for c in seen] == sorted(c[1] for c in seen)
        assert {c[3] for c in seen if c[3].startswith("model.")} == {t.tensor for t in report.tensors}
    assert [c[0] for c in calls].index("comparing") > max(i for i, c in enumerate(calls) if c[0] == "reading")

    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=80)
    with PhaseBar(con, True, "verifying") as bar:
        bar("comparing", 3, 8, "model.layers.1.mlp.experts.3.down_proj")
        bar.progress.refresh()
    assert "comparing" in out.getvalue() and "3/8" in out.getvalue() and "experts.3.down_proj" in out.getvalue()
    silent = io.StringIO()
    with PhaseBar(Console(file=silent), False, "verifying") as bar:
        bar("reading", 1, 2, "x")
    assert silent.getvalue() == ""


def test_verify_table_keeps_names_whole_at_80_columns(run_cli, monkeypatch, checkpoints):
    monkeypatch.chdir(checkpoints)
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_cli("verify", "moe-nvfp4", "--reference", "moe", "--top", "3")
    assert code == 0
    assert_readable(out)
    worst = out[out.index("worst 3 tensors"):out.index("relative error by layer")]
    names = re.findall(r"^(?:model\.layers|…)\S+", worst, re.MULTILINE)
    assert len(names) == 3 and any("experts.3.w2" in n for n in names), names  # each name whole, tail kept


def test_quiet_and_verbose_on_inspect_and_verify(run_cli, monkeypatch, checkpoints):
    """-q: stdout holds only the headline (inspect) or the verdict (verify); -v: one row per tensor."""
    monkeypatch.chdir(checkpoints)
    code, out, err = run_cli("inspect", "moe-nvfp4", "-q")
    assert code == 0 and err == ""
    assert out.splitlines() == [out.splitlines()[0], out.splitlines()[1]] and "bits/param" in out
    assert out.startswith("moe-nvfp4: layout modelopt")
    code, out, err = run_cli("verify", "moe-nvfp4", "--reference", "moe", "--quiet")
    assert (code, out, err) == (0, "PASS\n", "")
    per_tensor = run_cli("inspect", "moe-nvfp4", "--per-tensor")[1]
    assert run_cli("inspect", "moe-nvfp4", "-v")[1] == per_tensor
    code, out, _ = run_cli("verify", "moe-nvfp4", "--reference", "moe", "-v", "--top", "1")
    assert code == 0 and "worst 32 tensors" in out  # every module, not --top


def test_verify_quiet_sends_faults_to_stderr(run_cli, monkeypatch, checkpoints, tmp_path):
    """A verify that fails under -q: FAIL on stdout, exit 1, each fault on stderr."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoints / "llama-nvfp4", bad)
    shard = next(bad.glob("*.safetensors"))
    tensors = load_file(shard)
    name = next(n for n in tensors if n.endswith("weight_scale_2"))
    tensors[name] = 1 / tensors[name]  # the inverted global scale producers get wrong
    save_file(tensors, shard, metadata={"format": "pt"})
    code, out, err = run_cli("verify", bad, "--reference", checkpoints / "llama", "-q")
    assert code == 1 and out.startswith("FAIL: ") and out.count("\n") == 1
    assert "FAIL " in err and name.rsplit(".", 1)[0] in err


def test_layouts_engines_come_from_one_table(run_cli, monkeypatch):
    """`quantcli layouts` (text and JSON) reads quantcli/formats/engines.py's table (as inspect,
    the model card and the docs do: tests/test_engines.py); lower case marks a condition."""
    from quantcli.formats.engines import TABLE, loads_in

    doc = json.loads(run_cli("layouts", "--json")[1])
    pairs = {(r, layout["name"]): tuple(engines)
             for layout in doc["layouts"] for r, engines in layout["loads_in"].items()}
    assert pairs == {pair: loads_in(*pair) for pair in TABLE}
    for layout in doc["layouts"]:
        assert set(layout["engines"]) == {e for (_, name) in TABLE if name == layout["name"] for e in loads_in(_, name)}
        for recipe, cell in doc["loadability"][layout["name"]].items():
            assert (cell == "loads") == ((recipe, layout["name"]) in TABLE)
    monkeypatch.setenv("COLUMNS", "80")
    text = run_cli("layouts")[1]
    assert max(map(len, text.splitlines())) <= 80 and "compressed-tensors " in text  # whole, at 80 columns
    assert re.search(r"│ nvfp4\s+│\s+V S t\s+│\s+V S h\s+│", text)  # transformers: if no merged MoE experts
    assert "  nvfp4 in modelopt: vLLM, SGLang; TensorRT-LLM if static input scales" in text


def test_dry_run_quiet_prints_only_the_total_line_with_the_real_peak(run_cli, monkeypatch, checkpoints):
    monkeypatch.chdir(checkpoints)
    code, out, err = run_cli("convert", "moe", "x", "--recipe", "nvfp4", "--dry-run", "-q")
    assert code == 0, err
    assert len(out.splitlines()) == 1 and out.startswith("total ")
    # the process constant is part of the peak: never the few KiB of one small tensor
    from quantcli.cli.commands import process_bytes

    process = re.escape(f"{process_bytes() / 2**20:.2f} MiB")
    assert re.search(rf"estimated peak memory \d+\.\d\d MiB \(process {process} \+ largest", out)
    doc = json.loads(run_cli("convert", "moe", "x", "--recipe", "nvfp4", "--dry-run", "--json")[1])
    assert doc["estimated_peak_memory_bytes"] > process_bytes()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="ru_maxrss counts KiB on Linux")
def test_dry_run_peak_is_at_least_a_real_runs_peak_rss(run_cli, checkpoints, tmp_path):
    """PROCESS_BYTES and the working set are measured (CPU torch): a conversion's peak RSS, read
    from the kernel for a fresh process, stays at or below the dry run's estimate."""
    import subprocess
    import sys

    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("PROCESS_BYTES is measured with the CPU build of torch")
    args = ["convert", str(checkpoints / "llama"), str(tmp_path / "q"), "--recipe", "nvfp4", "--device", "cpu"]
    estimate = json.loads(run_cli(*args, "--dry-run", "--json")[1])["estimated_peak_memory_bytes"]
    rss = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", rss, sys.executable, "-m", "quantcli", *args, "-q"],
                         capture_output=True, text=True, check=True).stdout
    peak = int(out.split()[-1]) * 1024
    assert peak <= estimate, f"measured {peak / 2**20:.1f} MiB > estimated {estimate / 2**20:.1f} MiB"


def test_piped_moe_at_160_columns_is_one_line_per_row_without_trailing_spaces(run_cli, monkeypatch, checkpoints):
    monkeypatch.chdir(checkpoints)
    monkeypatch.setenv("COLUMNS", "160")
    out = run_cli("inspect", "moe-nvfp4")[1]
    assert "┃ module" in out and "(8 modules)" not in out  # a table, not cards
    assert "F8_E4M3 multiply" not in out  # the direction is said once, in its own column
    monkeypatch.setenv("COLUMNS", "80")
    for text in (out, run_cli("recipes")[1], run_cli("inspect", "moe-nvfp4")[1]):
        assert not [line for line in text.splitlines() if line != line.rstrip()]


def test_relayout_summary_says_carried_over_and_already_dense(run_cli, monkeypatch, checkpoints):
    monkeypatch.chdir(checkpoints)
    code, out, err = run_cli("convert", "moe-nvfp4", "ct", "--layout", "compressed-tensors")
    assert code == 0, err
    assert re.search(r"\d+ of \d+ tensors carried over \(nvfp4 -> compressed-tensors\)", out)
    assert "left dense: 3 already dense in the source" in out
    assert " in 0.0 s" not in out and out.count("quantcli verify") == 1


def test_calibration_scalars_are_bytes_not_params():
    from types import SimpleNamespace

    from quantcli.inspect import FormatTotals, _count_scales

    by_format: dict[str, FormatTotals] = {}
    kv = [SimpleNamespace(k_scale=0.1, v_scale=None)]
    _count_scales(by_format, SimpleNamespace(inputs=[1, 2, 3], kv=kv), 4)
    assert by_format["input scales"].params == 0 and by_format["input scales"].bytes == 12
    assert by_format["kv scales"].params == 0 and by_format["kv scales"].bytes == 4


def test_model_card_names_the_source_as_its_front_matter_does(run_cli, tmp_path):
    make_llama(tmp_path / "src", hidden=64, layers=1, shards=1, seed=0)
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config, "_name_or_path": "acme/tiny-llama"}))
    code, _, err = run_cli("convert", str(tmp_path / "src"), str(tmp_path / "out"), "--recipe", "fp8", "-q")
    assert code == 0, err
    card = (tmp_path / "out" / "README.md").read_text()
    assert "base_model: acme/tiny-llama" in card and "Converted from `acme/tiny-llama`" in card
