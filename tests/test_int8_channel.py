"""int8-channel: per-channel symmetric INT8 weights in compressed-tensors `int-quantized` (W8A8,
dynamic per-token activations). The numerics are compressed-tensors' own (calculate_qparams +
quantize, byte for byte); the checkpoint converts, inspects, verifies, re-lays out losslessly,
dequantizes, reads a checkpoint compressed-tensors itself wrote, and loads in transformers."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantcli.formats.layouts import DEFAULT_LAYOUT, get_layout, layouts_for
from quantcli.recipes import get_recipe
from quantcli.testing import make_llama

RECIPE = get_recipe("int8-channel")
CT = pytest.importorskip("compressed_tensors")


def ct_int8(w: torch.Tensor):
    """compressed-tensors' W8A8 preset on `w`: calculate_qparams (scale = amax / 127.5) and
    quantize (round half to even, clamp to [-128, 127]) -> (int8 codes, FP32 scale [N, 1])."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("W8A8", ["Linear"]).weights
    scale, zero = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), args)
    return quantize(w, scale, zero, args, dtype=torch.int8), scale


@pytest.mark.parametrize("seed", range(4))
def test_codes_and_scales_equal_compressed_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 160, generator=g) * torch.exp(torch.randn(96, 1, generator=g) * 3)
    w[0, :3] = torch.tensor([w[0].abs().max(), -w[0].abs().max(), 0.0])  # the +-127.5 ties
    codes, scale = ct_int8(w)
    q = RECIPE.quantize("w", w)
    assert torch.equal(q.codes.view(torch.int8), codes)
    assert torch.equal(q.scale, scale.reshape(-1))
    assert q.codes.view(torch.int8).min() == -128  # -amax / (amax / 127.5) = -127.5 -> -128 (even)


def test_zero_row_and_expert_stack():
    w = torch.zeros(2, 4, 32)
    w[1, 2, 5] = -3.0
    q = RECIPE.quantize("experts", w)
    assert q.scale.shape == (2, 4) and q.scale[0, 0] == 1.0  # all-zero row: scale 1.0, codes 0
    assert q.codes.view(torch.int8)[1, 2, 5] == -128
    assert torch.equal(RECIPE.dequantize(q)[0], torch.zeros(4, 32))


def test_scheme_facts():
    assert (RECIPE.element_bits, RECIPE.block, RECIPE.k_multiple, RECIPE.scale_encoding) == (8, (1, 0), 1, "f32")
    assert RECIPE.codes_dtype == torch.int8 and RECIPE.storage_bytes((16, 64)) == 16 * 64 + 16 * 4
    assert RECIPE.manifest_fields()["element"] == "int8"
    assert RECIPE.manifest_fields()["scale_rule"] == "amax/127.5"
    assert layouts_for("int8-channel") == ["compressed-tensors"] \
        and DEFAULT_LAYOUT["int8-channel"] == "compressed-tensors"


def test_compressed_tensors_layout_round_trip():
    layout = get_layout("compressed-tensors")
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    q = RECIPE.quantize("m.weight", w)
    disk = layout.to_disk("m", q)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in disk.items()} == {
        "m.weight": (torch.int8, (48, 64)), "m.weight_scale": (torch.float32, (48, 1))}
    back = layout.from_disk("m", RECIPE, disk.__getitem__, disk)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scale, q.scale) and back.shape == q.shape
    assert [(d.role, d.encoding, d.direction) for d in layout.describe("m", RECIPE)] == [
        ("codes", "int8", None), ("block_scale", "f32", "multiply")]
    assert layout.module_recipe("m", disk,
                                {"quantization_config": layout.quantization_config({"int8-channel": ["m"]}, [])}) \
        == "int8-channel"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    src = make_llama(root / "src", hidden=64, layers=1, shards=1)
    return root, src


def test_convert_inspect_verify_relayout_dequantize(converted, run_cli):
    root, src = converted
    out = root / "out"
    code, _, err = run_cli("convert", src, out, "--recipe", "int8-channel")
    assert code == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    group = qc["config_groups"]["group_0"]
    assert qc["format"] == group["format"] == "int-quantized"
    assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False,
                                "strategy": "channel"}
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
                                          "strategy": "token"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "I8"
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (64, 1)
    code, text, err = run_cli("inspect", out, "--json")
    assert code == 0, err
    assert {m["recipe"] for m in json.loads(text)["modules"]} == {"int8-channel"}
    code, _, err = run_cli("verify", out, "--reference", src, "--exact")
    assert code == 0, err
    code, _, err = run_cli("convert", out, root / "re", "--recipe", "int8-channel")
    assert code == 0, err
    assert (root / "re" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    code, _, err = run_cli("convert", out, root / "deq", "--recipe", "bf16")
    assert code == 0, err


def test_reads_a_checkpoint_compressed_tensors_wrote(converted, run_cli):
    """The W8A8 preset through compressed-tensors' own int-quantized compressor and config."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    root, src = converted
    dst = root / "ct"
    dst.mkdir()
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("int-quantized")
    state = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            if name.endswith("proj.weight"):
                codes, scale = ct_int8(w.float())
                sd = compressor.compress({"weight": w.float(), "weight_scale": scale}, scheme)
                state[name], state[name + "_scale"] = sd["weight"], scale
                assert torch.equal(sd["weight"], codes)
            else:
                state[name] = w
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QuantizationConfig(config_groups={"group_0": scheme}, format="int-quantized",
                                                       ignore=["lm_head"],
                                                       quant_method="compressed-tensors").model_dump()
    (dst / "config.json").write_text(json.dumps(config, default=str))
    code, text, err = run_cli("inspect", dst, "--json")
    assert code == 0, err
    assert {m["recipe"] for m in json.loads(text)["modules"]} == {"int8-channel"}
    code, _, err = run_cli("verify", dst, "--reference", src, "--exact")
    assert code == 0, err


def test_transformers_decompresses_it(converted, run_cli):
    transformers = pytest.importorskip("transformers")
    root, src = converted
    out, deq = root / "tf-out", root / "tf-deq"
    assert run_cli("convert", src, out, "--recipe", "int8-channel")[0] == 0
    assert run_cli("convert", out, deq, "--recipe", "bf16")[0] == 0
    config = transformers.CompressedTensorsConfig(run_compressed=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, quantization_config=config)
    ours = transformers.AutoModelForCausalLM.from_pretrained(deq, dtype=torch.bfloat16)
    for name, p in ours.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p), name
