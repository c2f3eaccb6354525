"""One table says which engine loads which (recipe, layout) pair (quantcli/formats/engines.py):
for every pair, a real conversion's inspect, model card and convert summary, `quantcli layouts`
and docs/formats.md say the same, each verdict cites its loader code, and the conditions a
checkpoint settles are checked on it (shapes, architecture, static scales, spelling)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from quantcli.formats.engine_checks import IF, YES, Facts, judge, judge_checkpoint, loads_in_line
from quantcli.formats.engines import ENGINES, LOADS, NO, TABLE, UNCHECKED, WHEN, loads_in, statement

ROOT = Path(__file__).resolve().parents[1]


def _ids(n: int = 3) -> str:
    return "".join(json.dumps({"input_ids": [(7 * i + 3 * j) % 512 for j in range(12)]}) + "\n" for i in range(n))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Every pair of the table converted from a tiny Llama (a tiny GptOss for gpt-oss): pair ->
    (output folder, the convert summary's text)."""
    from quantcli.testing import make_gpt_oss, make_llama

    root = tmp_path_factory.mktemp("engines")
    llama = make_llama(root / "llama", hidden=128, layers=1, shards=1)
    gpt_oss = make_gpt_oss(root / "goss", hidden=64, layers=1, shards=1)
    data = root / "ids.jsonl"
    data.write_text(_ids())
    return {"root": root, "llama": llama, "gpt-oss": gpt_oss, "data": data}


def _convert(run_cli, outputs, recipe: str, layout: str) -> tuple[Path, str]:
    """The pair's output and its convert summary (converted once per module)."""
    if (recipe, layout) not in outputs:
        outputs[recipe, layout] = _convert_once(run_cli, outputs, recipe, layout)
    return outputs[recipe, layout]


def _convert_once(run_cli, outputs, recipe: str, layout: str) -> tuple[Path, str]:
    src = outputs["gpt-oss" if layout == "gpt-oss" else "llama"]
    out = outputs["root"] / f"{recipe}-{layout}"
    static = (recipe, layout) == ("fp8", "modelopt")  # written only with static input scales
    extra = ["--activations", "static", "--calibration", outputs["data"]] if static else []
    code, text, err = run_cli("convert", src, out, "--recipe", recipe, "--layout", layout, *extra)
    assert code == 0, err
    return out, text


def _card_rows(out: Path) -> dict[str, tuple[str, str]]:
    """engine -> (loads, why) from the model card's engine table."""
    rows = {}
    for line in (out / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ENGINES:
            rows[cells[0]] = (cells[1], "" if cells[2] == "-" else cells[2])
    return rows


@pytest.mark.parametrize("pair", list(TABLE), ids=lambda p: f"{p[0]}-{p[1]}")
def test_inspect_card_summary_and_layouts_say_the_same_for_every_pair(run_cli, outputs, pair):
    recipe, layout = pair
    out, summary = _convert(run_cli, outputs, recipe, layout)
    doc = json.loads(run_cli("inspect", out, "--json")[1])
    inspected = {j["engine"]: (j["loads"], j["reason"]) for j in doc["engines"]}
    assert list(inspected) == list(ENGINES)
    assert _card_rows(out) == {e: (loads, why.replace("|", "/")) for e, (loads, why) in inspected.items()}
    loading = [e for e, (loads, _) in inspected.items() if loads in (YES, IF)]
    assert f"loads in: {doc['consumers']}\n" in summary
    assert f"(loads in {doc['consumers']})" in (out / "README.md").read_text()
    assert [e for e in loading] == [e for e in loads_in(recipe, layout) if e in loading]  # never beyond the table
    for engine, (loads, reason) in inspected.items():
        v = TABLE[pair][engine]
        expected = {LOADS: {YES}, NO: {NO}, UNCHECKED: {UNCHECKED}, WHEN: {YES, IF, NO}}[v.status]
        assert loads in expected, (engine, loads, v.status)
        if v.status == WHEN:  # the condition is said, settled on the files or left to the GPU
            assert v.condition in reason or (v.hardware and v.hardware in reason), reason
    layouts = {i["name"]: i for i in json.loads(run_cli("layouts", "--json")[1])["layouts"]}
    assert layouts[layout]["statements"][recipe] == statement(recipe, layout)
    assert [(v["engine"], v["status"], v["condition"]) for v in layouts[layout]["verdicts"][recipe]] == [
        (e, TABLE[pair][e].status, TABLE[pair][e].condition) for e in ENGINES]


def test_every_verdict_cites_its_loader_code_and_every_pair_has_four_engines():
    from quantcli.formats.layouts import layouts_for
    from quantcli.recipes import RECIPES

    assert set(TABLE) == {(r, layout) for r in RECIPES for layout in layouts_for(r)}
    for pair, found in TABLE.items():
        assert set(found) == set(ENGINES), pair
        for engine, v in found.items():
            assert v.rules and all(re.fullmatch(r"\S+/\S+ \S+ \S+\.py::\S+", r.cite()) for r in v.rules), (pair, engine)
            assert v.status in (LOADS, NO, UNCHECKED) or v.condition, (pair, engine)
            assert v.status in (WHEN,) or not v.checks, (pair, engine)


def test_docs_table_is_generated_from_the_engines_table():
    from quantcli.formats.engines_doc import BLOCKS, section

    text = (ROOT / "docs" / "formats.md").read_text()
    for begin, end, make in BLOCKS:
        assert text[text.index(begin):text.index(end) + len(end) + 1] == make(), \
            "a generated section of docs/formats.md is stale: run python scripts/engines_table.py"
    for (recipe, layout), found in TABLE.items():
        assert statement(recipe, layout) in section()
        for v in found.values():
            assert all(r.cite() in section() for r in v.rules)


# ---------------------------------------------------------------- the conditions, on the files


def test_fp8_in_the_fp8_layout_is_not_claimed_for_transformers(run_cli, outputs):
    """The reported case: `--recipe fp8` (fp8 layout) loads in vLLM and SGLang; transformers runs
    the raw codes, so it is not named as loading it."""
    out, summary = _convert(run_cli, outputs, "fp8", "fp8")
    text = run_cli("inspect", out)[1]
    assert "(loads in vLLM, SGLang)" in text and "loads in: vLLM, SGLang\n" in summary
    assert re.search(r"transformers\s+no: FineGrainedFP8 reads only weight_scale_inv", text)


def _facts(shapes: dict[str, tuple[int, int]], recipe: str = "fp8-block", **config) -> Facts:
    return Facts({m: (recipe, s) for m, s in shapes.items()}, config, static=config.pop("static", False))


ATTN = "model.layers.0.self_attn"


def test_block_fp8_shapes_are_checked_per_engine_rule():
    """vLLM lets the last fused part off (v_proj), SGLang does not; transformers wants N and K."""
    shapes = {f"{ATTN}.q_proj": (256, 256), f"{ATTN}.k_proj": (128, 256), f"{ATTN}.v_proj": (64, 256)}
    got = {j.engine: j for j in judge("fp8-block", "fp8", _facts(shapes, architectures=["Qwen3ForCausalLM"]))}
    assert got["vLLM"].loads == YES
    assert got["SGLang"].loads == NO and f"{ATTN}.v_proj (64x256)" in got["SGLang"].reason
    assert got["transformers"].loads == NO and "1 of 3" in got["transformers"].reason
    shapes[f"{ATTN}.k_proj"] = (64, 256)
    got = {j.engine: j for j in judge("fp8-block", "compressed-tensors", _facts(shapes))}
    assert got["vLLM"].loads == NO and f"{ATTN}.k_proj" in got["vLLM"].reason
    assert got["transformers"].loads == YES and "K a multiple of 128" in got["transformers"].reason


def test_architecture_static_scales_and_spelling_are_checked():
    llama = _facts({f"{ATTN}.q_proj": (256, 256)}, "mxfp8", architectures=["LlamaForCausalLM"])
    sglang = {j.engine: j for j in judge("mxfp8", "fp8", llama)}["SGLang"]
    assert sglang.loads == NO and "LlamaForCausalLM is Llama-family" in sglang.reason
    qwen = _facts({f"{ATTN}.q_proj": (256, 256)}, "mxfp8", architectures=["Qwen3ForCausalLM"])
    sglang = {j.engine: j for j in judge("mxfp8", "fp8", qwen)}["SGLang"]
    assert sglang.loads == IF and sglang.reason.startswith("needs an SM100+ GPU")
    assert "SGLang (needs an SM100+ GPU" in loads_in_line(judge_checkpoint("fp8", qwen))
    mixtral = _facts({"model.layers.0.mlp.experts": (4, 256, 256)}, "mxfp4", architectures=["MixtralForCausalLM"],
                     model_type="mixtral")
    assert {j.loads for j in judge("mxfp4", "gpt-oss", mixtral) if j.engine != "TensorRT-LLM"} == {NO}
    weight_only = _facts({f"{ATTN}.q_proj": (256, 256)}, "nvfp4")
    trt = {j.engine: j for j in judge("nvfp4", "modelopt", weight_only)}["TensorRT-LLM"]
    assert trt.loads == NO and "no static input scales" in trt.reason
    upper = _facts({f"{ATTN}.q_proj": (256, 256)}, quantization_config={"quant_algo": "FP8_PB_WO"})
    assert {j.engine: j.loads for j in judge("fp8-block", "modelopt", upper)}["TensorRT-LLM"] == NO


def test_w4a4_compressed_tensors_groups_get_their_own_verdicts():
    """llm-compressor's NVFP4 and MXFP4 presets quantize the inputs too: the weight-only reasons
    (TensorRT-LLM's unparsed null, SGLang's missing weight-only MXFP4 scheme) do not apply."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    for recipe, preset, engine in (("nvfp4", "NVFP4", "TensorRT-LLM"), ("mxfp4", "MXFP4", "SGLang")):
        inputs = PRESET_SCHEMES[preset]["input_activations"].model_dump(mode="json")
        w4a4 = _facts({f"{ATTN}.q_proj": (256, 256)}, recipe, quantization_config={
            "quant_method": "compressed-tensors", "config_groups": {"group_0": {"input_activations": inputs}}})
        weight_only = _facts({f"{ATTN}.q_proj": (256, 256)}, recipe, quantization_config={
            "quant_method": "compressed-tensors", "config_groups": {"group_0": {"input_activations": None}}})
        got = {j.engine: j for j in judge(recipe, "compressed-tensors", w4a4)}[engine]
        assert got.loads == UNCHECKED and "W4A4" in got.reason
        assert {j.engine: j for j in judge(recipe, "compressed-tensors", weight_only)}[engine].loads == NO


def test_a_pair_quantcli_only_reads_loads_nowhere():
    facts = _facts({f"{ATTN}.q_proj": (256, 256)}, "mxfp4")
    assert {(j.loads, j.reason) for j in judge("mxfp4", "modelopt", facts)} == {
        (NO, "no engine loads mxfp4 in the modelopt layout")}


def test_fp8_block_modelopt_writes_quant_algo_as_modelopt_does(run_cli, outputs):
    """`fp8_pb_wo` lower case: TensorRT-LLM canonicalizes only that spelling; vLLM upper-cases
    quant_algo before matching, and quantcli reads either."""
    out, _ = _convert(run_cli, outputs, "fp8-block", "modelopt")
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "fp8_pb_wo"
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_algo"] == "fp8_pb_wo"
    doc = json.loads(run_cli("inspect", out, "--json")[1])
    assert {m["recipe"] for m in doc["modules"]} == {"fp8-block"}
    assert {j["engine"]: j["loads"] for j in doc["engines"]}["TensorRT-LLM"] == YES
    assert run_cli("verify", out, "--reference", outputs["llama"])[0] == 0


def test_make_checkpoint_gpt_oss_converts_with_the_example_recipe(tmp_path, monkeypatch, run_cli):
    """scripts/make_checkpoint.py --arch gpt-oss: 3-D expert stacks that the gpt-oss layout and
    recipes/examples/mxfp4-gpt-oss-experts.toml take, loaded by the engines' GptOss code."""
    import runpy
    import sys

    script = ROOT / "scripts" / "make_checkpoint.py"
    src = tmp_path / "goss"
    monkeypatch.setattr(sys, "argv", [str(script), str(src), "--arch", "gpt-oss", "--hidden", "64", "--layers", "1",
                                      "--shards", "1"])
    runpy.run_path(str(script), run_name="__main__")
    assert json.loads((src / "config.json").read_text())["model_type"] == "gpt_oss"
    out = tmp_path / "q"
    code, _, err = run_cli("convert", src, out, "--config", ROOT / "recipes/examples/mxfp4-gpt-oss-experts.toml",
                           "--quiet")
    assert code == 0, err
    doc = json.loads(run_cli("inspect", out, "--json")[1])
    assert {m["module"] for m in doc["modules"]} == {"model.layers.0.mlp.experts.gate_up_proj",
                                                     "model.layers.0.mlp.experts.down_proj"}
    assert doc["consumers"] == "vLLM, SGLang, transformers"


# ---------------------------------------------------------------- llm-compressor's scheme names


def test_llm_compressor_schemes_map_to_recipes_and_a_missing_recipe_is_coming(run_cli, monkeypatch):
    """Every scheme the issue names is listed with the options that write it; W4A16's recipe
    (int4) is listed as coming until the registry has it, then with its options."""
    import quantcli.recipes as registry
    from quantcli.formats.schemes import recipe_label, scheme_infos

    infos = {i.scheme: i for i in scheme_infos()}
    assert {"FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "NVFP4A16", "NVFP4", "MXFP4"} <= set(infos)
    assert infos["FP8_DYNAMIC"].options == "--recipe fp8-channel"
    assert infos["FP8_BLOCK"].options == "--recipe fp8-block --layout compressed-tensors"
    assert infos["NVFP4"].options.endswith("--activations static --calibration DATA")
    if "int4" not in registry.RECIPES:
        assert recipe_label(infos["W4A16"]) == "int4 (coming)" and not infos["W4A16"].available
        text = run_cli("recipes")[1]
        assert re.search(r"W4A16\s+│ int4 \(coming\)", text)
        assert "--recipe fp8-block --layout compressed-tensors" in text

        class Int4:
            default_layout = "compressed-tensors"
        monkeypatch.setitem(registry.RECIPES, "int4", Int4())
        w4 = {i.scheme: i for i in scheme_infos()}["W4A16"]
        assert w4.available and w4.options == "--recipe int4" and recipe_label(w4) == "int4"
