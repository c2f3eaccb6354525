"""Layouts: names, dtypes, shapes, scale direction; read-back; compressed-tensors interop; manifest."""

import json

import pytest
import torch

from quantcli.checkpoint.manifest import Manifest
from quantcli.errors import LayoutError
from quantcli.formats.layouts import LAYOUTS, get_layout, layout_for
from quantcli.recipes import get_recipe


def weight(shape=(64, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w[0, :7] *= 30
    return w.bfloat16()


PAIRS = [(lay.name, r) for lay in LAYOUTS.values() for r in lay.recipes]


@pytest.mark.parametrize("layout_name, recipe_name", PAIRS)
def test_to_disk_from_disk_round_trip(layout_name, recipe_name):
    layout = get_layout(layout_name)
    recipe = layout.recipe_for(recipe_name)
    w = weight((4, 64, 128)) if layout_name == "gpt-oss" else weight((128, 256))
    q = recipe.quantize("m", w)
    disk = layout.to_disk("m", q)
    back = layout.from_disk("m", recipe, disk.__getitem__, disk)
    assert back.shape == q.shape
    assert torch.equal(back.codes.view(torch.uint8), q.codes)
    assert torch.equal(back.scale.reshape(q.scale.shape).view(q.scale.dtype), q.scale)
    assert torch.equal(recipe.dequantize(back), recipe.dequantize(q)) or recipe_name == "nvfp4"


def test_modelopt_nvfp4_names_dtypes_shapes():
    q = get_recipe("nvfp4").quantize("m", weight())
    disk = get_layout("modelopt").to_disk("x.q_proj", q)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in disk.items()} == {
        "x.q_proj.weight": (torch.uint8, (64, 64)),
        "x.q_proj.weight_scale": (torch.float8_e4m3fn, (64, 8)),
        "x.q_proj.weight_scale_2": (torch.float32, ()),
    }
    assert float(disk["x.q_proj.weight_scale_2"]) < 1  # multiplier amax/2688


def test_compressed_tensors_nvfp4_global_is_reciprocal():
    q = get_recipe("nvfp4").quantize("m", weight())
    disk = get_layout("compressed-tensors").to_disk("x", q)
    assert disk["x.weight_global_scale"].shape == (1,)
    assert float(disk["x.weight_global_scale"]) == float(1.0 / q.global_scale)
    assert set(disk) == {"x.weight_packed", "x.weight_scale", "x.weight_global_scale"}


def test_fp8_layout_names():
    assert set(get_layout("fp8").to_disk("x", get_recipe("fp8-block").quantize("m", weight()))) == {
        "x.weight", "x.weight_scale_inv"}
    d = get_layout("fp8").to_disk("x", get_recipe("fp8").quantize("m", weight()))
    assert d["x.weight_scale"].shape == () and d["x.weight"].dtype == torch.float8_e4m3fn
    d = get_layout("modelopt").to_disk("x", get_recipe("fp8-block").quantize("m", weight((256, 256))))
    assert d["x.weight_scale"].shape == (2, 1, 2, 1)


def test_gpt_oss_shapes():
    q = get_layout("gpt-oss").recipe_for("mxfp4").quantize("m", weight((2, 64, 128)))
    d = get_layout("gpt-oss").to_disk("mlp.experts.gate_up_proj", q)
    assert d["mlp.experts.gate_up_proj_blocks"].shape == (2, 64, 4, 16)
    assert d["mlp.experts.gate_up_proj_scales"].shape == (2, 64, 4)


def test_refused_pairs_name_the_layouts_that_load():
    with pytest.raises(LayoutError, match="--layout modelopt cannot hold recipe mxfp4.*"
                                          "layouts that do: compressed-tensors, gpt-oss"):
        layout_for("mxfp4", "modelopt")
    with pytest.raises(LayoutError, match="cannot hold recipe fp8 .*"
                                          "layouts that do: modelopt, compressed-tensors, fp8"):
        layout_for("fp8", "gpt-oss")
    # modelopt holds per-tensor fp8 (quant_algo FP8) only with static activation scales
    with pytest.raises(LayoutError, match="modelopt holds recipe fp8 only with static activation scales.*"
                                          "--layout compressed-tensors or fp8"):
        get_layout("modelopt").require_static("fp8", False, ["compressed-tensors", "fp8", "modelopt"])
    get_layout("modelopt").require_static("fp8", True, [])


def test_default_scale_rules_per_producer():
    assert get_layout("compressed-tensors").recipe_for("mxfp4").scale_rule == "even"
    assert get_layout("gpt-oss").recipe_for("mxfp4").scale_rule == "rceil"
    assert get_layout("modelopt").recipe_for("mxfp8").scale_rule == "rceil"


def test_configs_have_the_keys_loaders_need():
    lay = get_layout("modelopt")
    hq = lay.extra_files({"nvfp4": ["a"]}, ["lm_head"])["hf_quant_config.json"]["quantization"]
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["group_size"] == 16 and hq["exclude_modules"] == ["lm_head"]
    assert "kv_cache_quant_algo" in hq
    ct = get_layout("compressed-tensors").quantization_config({"nvfp4": ["a"]}, ["lm_head"])
    assert ct["format"] == "nvfp4-pack-quantized" and ct["ignore"] == ["lm_head"]
    assert ct["config_groups"]["group_0"]["weights"]["group_size"] == 16
    fp8 = get_layout("fp8").quantization_config({"fp8-block": ["a"]}, ["lm_head"])
    assert fp8 == {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": [128, 128],
                   "ignored_layers": ["lm_head"], "modules_to_not_convert": ["lm_head"]}


# ---------------------------------------------------------------- compressed-tensors decodes our bytes

CT_PRESET = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "mxfp8": "MXFP8A16", "fp8-channel": "FP8_DYNAMIC",
             "fp8-block": "FP8_BLOCK", "fp8": "FP8_DYNAMIC"}


@pytest.mark.parametrize("recipe_name", ["nvfp4", "mxfp4", "mxfp8", "fp8-channel", "fp8-block", "fp8"])
def test_compressed_tensors_package_decompresses_our_layout(recipe_name):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    layout = get_layout("compressed-tensors")
    recipe = layout.recipe_for(recipe_name)
    q = recipe.quantize("m", weight((128, 256)))
    disk = layout.to_disk("m", q)
    local = {k.split(".", 1)[1]: v for k, v in disk.items()}
    scheme: QuantizationScheme = preset_name_to_scheme(CT_PRESET[recipe_name], ["Linear"])
    if recipe_name == "fp8":
        scheme.weights.strategy = "tensor"
    fmt = layout.quantization_config({recipe_name: ["m"]}, ["lm_head"])["format"]
    compressor = BaseCompressor.get_value_from_registry(fmt)
    out = compressor.decompress(local, scheme)["weight"].float()
    ours = recipe.dequantize(q)
    assert torch.allclose(out, ours, rtol=0, atol=0) or torch.equal(out.bfloat16(), ours.bfloat16()), \
        float((out - ours).abs().max())
    del ct


def test_manifest_json_round_trip_and_header_check(tiny_llama, tmp_path, run_cli):
    code, _, err = run_cli("convert", tiny_llama, tmp_path / "o", "--recipe", "nvfp4", "--quiet")
    assert code == 0, err
    text = (tmp_path / "o" / "quantcli_manifest.json").read_text()
    m = Manifest.from_json(text)
    assert m.to_json() == text
    from quantcli.checkpoint.source import open_source

    src = open_source(str(tmp_path / "o"))
    assert m.check_headers(src.headers) == []
    obj = json.loads(text)
    obj["modules"][0]["tensors"][0]["shape"] = [1, 2]
    bad = Manifest.from_json(json.dumps(obj))
    assert bad.check_headers(src.headers) and "manifest says U8[1, 2]" in bad.check_headers(src.headers)[0]
    with pytest.raises(Exception, match="schema_version"):
        Manifest.from_json(json.dumps({**obj, "schema_version": 99}))


# ---------------------------------------------------------------- layout tables


def test_tables_round_trip_every_pair_and_direction_lives_in_one_place():
    """Every (layout, recipe) row of every table: to_disk -> from_disk gives the same canonical
    tensor, and a global scale is stored as the multiplier or its FP32 reciprocal by direction."""
    from quantcli.formats.layouts.base import stored_value, to_direction

    w = torch.randn(2, 128, 128, generator=torch.Generator().manual_seed(3))  # K = 128: int4's groups fit
    for layout in LAYOUTS.values():
        for name in layout.tables:
            recipe = layout.recipe_for(name)
            x = w if layout.name == "gpt-oss" else w[0]
            q = recipe.quantize("m", x)
            disk = layout.to_disk("m", q)
            assert [n for n in disk] == [d.name for d in layout.describe("m", recipe)]
            back = layout.from_disk("m", recipe, disk.__getitem__, disk)
            assert torch.equal(back.codes, q.codes) and torch.equal(back.scale, q.scale), (layout.name, name)
            assert back.shape == q.shape == layout.logical_shape(recipe, tuple(next(iter(disk.values())).shape))
            for d in layout.describe("m", recipe):
                if d.role == "global_scale":
                    assert torch.equal(disk[d.name].reshape(()), to_direction(q.global_scale, d.direction))
                    assert stored_value(float(q.global_scale), d.direction) == float(disk[d.name].reshape(()))
    assert get_recipe("nvfp4").has_global_scale


def test_optional_tensors_are_written_only_when_facts_carry_them():
    """The tables declare activation scales; to_disk writes one only when the module's facts have
    it (ModuleFacts carries none yet), in the layout's direction."""
    from types import SimpleNamespace

    q = get_recipe("nvfp4").quantize("m", torch.randn(16, 64))
    ct, mo = get_layout("compressed-tensors"), get_layout("modelopt")
    assert "m.input_global_scale" not in ct.to_disk("m", q)
    facts = SimpleNamespace(input_scale=torch.tensor(0.25))
    assert float(ct.to_disk("m", q, facts)["m.input_global_scale"]) == 4.0  # a divisor
    assert float(mo.to_disk("m", q, facts)["m.input_scale"]) == 0.25  # a multiplier, 0-d
    assert mo.kv_scales == ("k_proj.k_scale", "v_proj.v_scale") and ct.kv_scales == ("k_scale", "v_scale")
