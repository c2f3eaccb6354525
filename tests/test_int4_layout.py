"""int4 in the compressed-tensors `pack-quantized` layout, as llm-compressor writes W4A16 and vLLM,
SGLang and transformers load it: `weight_packed` I32 [N, K/8], `weight_scale` in the weight's
dtype [N, K/128], `weight_shape` I64 [2], and llm-compressor's config group. Every tensor is
compared with what compressed-tensors' own pack-quantized compressor writes for the same weights,
the config is parsed by compressed-tensors' QuantizationConfig, and the checkpoint converts,
inspects, verifies (--exact), re-lays out, dequantizes, re-quantizes from another recipe and
loads in transformers with the logits of quantcli's own decode."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import LayoutError
from quantcli.formats.detect import detect, recipes_the_tensors_allow
from quantcli.formats.layouts import DEFAULT_LAYOUT, get_layout, layouts_for
from quantcli.planning.from_quantized import requantize_dtype
from quantcli.recipes import get_recipe
from quantcli.testing import make_llama

CT = pytest.importorskip("compressed_tensors")
RECIPE = get_recipe("int4")
LAYOUT = get_layout("compressed-tensors")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
IDS = ["bf16", "fp16", "fp32"]
# The group llm-compressor 0.14.0.1 (with compressed-tensors 0.19.0) writes for
# QuantizationModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]), key for key.
LLMC_W4A16_GROUP = {
    "format": "pack-quantized", "input_activations": None, "output_activations": None, "targets": ["Linear"],
    "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 128, "num_bits": 4,
                "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "group",
                "symmetric": True, "type": "int", "zp_dtype": None}}


def ct_pack_quantized(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' W4A16 on one Linear weight: the scale as llm-compressor's min-max
    observer and calculate_qparams make it (group min / max in the weight's dtype), then its
    pack-quantized compressor -> {weight_packed, weight_scale, weight_shape}."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    groups = w.unflatten(-1, (w.shape[-1] // 128, 128))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    return dict(compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme))


def weights(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    w[0, :128] = 0.0  # an all-zero group: eps scale, codes 0 (nibble 8)
    w[1, :2] = torch.tensor([3.0, -3.0])  # +-amax: the -7.5 tie -> -8
    return w.to(dtype)


# ---------------------------------------------------------------- the layout's tensors


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_tensors_equal_the_pack_quantized_compressor(dtype):
    w = weights((48, 384), dtype)
    q = RECIPE.quantize("m.weight", w)
    disk = LAYOUT.to_disk("m", q)
    ours = {name.split(".", 1)[1]: t for name, t in disk.items()}
    theirs = ct_pack_quantized(w)
    assert sorted(ours) == sorted(theirs) == ["weight_packed", "weight_scale", "weight_shape"]
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name
    assert ours["weight_packed"].shape == (48, 48) and ours["weight_scale"].dtype == dtype
    assert torch.equal(ours["weight_packed"], q.codes.view(torch.int32))
    assert ours["weight_shape"].tolist() == [48, 384]
    # and compressed-tensors decompresses our bytes to quantcli's decode, rounded to the weight dtype
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    back = BaseCompressor.get_value_from_registry("pack-quantized").decompress(
        ours, preset_name_to_scheme("W4A16", ["Linear"]))["weight"]
    assert torch.equal(back, RECIPE.dequantize(q).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_from_disk_describe_and_output_specs(dtype):
    q = RECIPE.quantize("m.weight", weights((64, 256), dtype))
    disk = LAYOUT.to_disk("m", q)
    back = LAYOUT.from_disk("m", RECIPE, disk.__getitem__, disk)
    assert torch.equal(back.codes, q.codes) and back.shape == (64, 256)
    assert back.scale.dtype == dtype and torch.equal(back.scale, q.scale)  # kept, never widened
    assert LAYOUT.logical_shape(RECIPE, tuple(disk["m.weight_packed"].shape)) == (64, 256)
    specs = LAYOUT.output_specs("m", RECIPE, (64, 256), dtype)
    assert specs == [(n, t.dtype, tuple(t.shape)) for n, t in disk.items()]
    assert [(d.name, d.role, d.encoding, d.direction) for d in LAYOUT.describe("m", RECIPE)] == [
        ("m.weight_packed", "codes", "int4x2_offset8", None),
        ("m.weight_scale", "block_scale", "weight_dtype", "multiply"),
        ("m.weight_shape", "shape", "int64", None)]
    with pytest.raises(ValueError, match="raw_dtype_for"):
        RECIPE.scale_codec.raw_dtype  # a meta stand-in needs the weight's dtype


def test_a_wrong_weight_shape_or_codes_dtype_is_refused():
    q = RECIPE.quantize("m.weight", weights((16, 256), torch.bfloat16))
    disk = LAYOUT.to_disk("m", q)
    bad = {**disk, "m.weight_shape": torch.tensor([16, 512])}
    with pytest.raises(LayoutError, match=r"m.weight_shape: holds .*\[16, 512\], but the codes hold a \[16, 256\]"):
        LAYOUT.from_disk("m", RECIPE, bad.__getitem__, bad)
    bad = {**disk, "m.weight_scale": disk["m.weight_scale"].view(torch.int16)}
    with pytest.raises(LayoutError, match="expected a float scale"):
        LAYOUT.from_disk("m", RECIPE, bad.__getitem__, bad)
    # I32 words are code bytes for int4 only: an nvfp4 module stored as I32 is still refused
    nv = get_recipe("nvfp4")
    nv_disk = LAYOUT.to_disk("m", nv.quantize("m.weight", weights((16, 256), torch.bfloat16)))
    nv_disk["m.weight_packed"] = nv_disk["m.weight_packed"].view(torch.int32)
    with pytest.raises(LayoutError, match="expected an 8-bit type"):
        LAYOUT.from_disk("m", nv, nv_disk.__getitem__, nv_disk)


def test_registry_engines_and_storage():
    from quantcli.cli.options import RECIPE_NAMES
    from quantcli.formats.engines import loads_in

    assert layouts_for("int4") == ["compressed-tensors"] and DEFAULT_LAYOUT["int4"] == "compressed-tensors"
    assert "int4" in RECIPE_NAMES and loads_in("int4", "compressed-tensors") == ("vLLM", "SGLang", "transformers")
    assert RECIPE.storage_bytes((4096, 4096)) * 8 / 4096**2 == 4.125  # BF16 / FP16 scales


# ---------------------------------------------------------------- the config group


def test_config_group_is_llm_compressors_and_compressed_tensors_parses_it():
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    qc = LAYOUT.quantization_config({"int4": ["model.layers.0.mlp.down_proj"]}, ["lm_head"])
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"] == LLMC_W4A16_GROUP
    parsed = QuantizationConfig.model_validate(qc)
    preset = preset_name_to_scheme("W4A16", ["Linear"]).weights
    got = parsed.config_groups["group_0"].weights
    for key in ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "actorder"):
        assert getattr(got, key) == getattr(preset, key), key
    assert parsed.format == "pack-quantized" and parsed.config_groups["group_0"].input_activations is None


def test_module_recipe_from_the_config_group():
    disk = {"m.weight_packed": 0, "m.weight_scale": 0, "m.weight_shape": 0}
    config = {"quantization_config": LAYOUT.quantization_config({"int4": ["m"]}, [])}
    assert LAYOUT.module_recipe("m", disk, config) == "int4"
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["weights"] = {**group["weights"], "symmetric": False, "zp_dtype": "torch.int8"}  # W4A16_ASYM
    assert LAYOUT.module_recipe("m", disk, config) is None  # zero points: no recipe decodes them
    group["weights"] = {**LLMC_W4A16_GROUP["weights"], "group_size": 32}  # an int group of 32 is not mxfp4
    assert LAYOUT.module_recipe("m", disk, config) is None
    assert LAYOUT.config_problems(config, {}) == []  # pack-quantized fixes no group size


def test_requantize_dtype_follows_the_config():
    class Src:
        def __init__(self, config):
            self.config = config

    assert requantize_dtype(Src({"torch_dtype": "float16"})) == "F16"
    assert requantize_dtype(Src({"dtype": "float32"})) == "F32"
    assert requantize_dtype(Src({"torch_dtype": "bfloat16"})) == "BF16"
    assert requantize_dtype(Src({})) == requantize_dtype(Src({"torch_dtype": "int8"})) == "BF16"


# ---------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny BF16 Llama (hidden 128: every K is a multiple of 128), converted with --recipe int4."""
    import sys

    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("int4")
    src = make_llama(root / "src", hidden=128, layers=1, shards=2)
    old = sys.argv
    sys.argv = ["quantcli", "convert", str(src), str(root / "out"), "--recipe", "int4", "--quiet"]
    try:
        with pytest.raises(SystemExit) as exc:
            main()
    finally:
        sys.argv = old
    assert not exc.value.code
    return root, src, root / "out"


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def test_written_tensors_equal_compressed_tensors_and_config_parses(converted):
    from compressed_tensors.quantization import QuantizationConfig

    _, src, out = converted
    source, written = _tensors(src), _tensors(out)
    modules = [n[: -len(".weight_packed")] for n in written if n.endswith(".weight_packed")]
    assert len(modules) == 7  # q, k, v, o, gate, up, down of the one layer; lm_head stays dense
    for module in modules:
        theirs = ct_pack_quantized(source[f"{module}.weight"])
        for name, t in theirs.items():
            ours = written[f"{module}.{name}"]
            assert ours.dtype == t.dtype and torch.equal(ours, t), f"{module}.{name}"
        assert f"{module}.weight" not in written
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"] == LLMC_W4A16_GROUP and qc["ignore"] == ["lm_head"]
    QuantizationConfig.model_validate(qc)
    with CheckpointTensors(open_source(str(out))) as ct:
        assert all(recipes_the_tensors_allow(m, ct) == {"int4"} for m in modules)
    assert detect(open_source(str(out))).modules == dict.fromkeys(modules, "int4")


def test_inspect_verify_exact_and_dry_run_sizes(converted, run_cli):
    root, src, out = converted
    code, text, err = run_cli("inspect", out, "--json")
    assert code == 0, err
    mods = json.loads(text)["modules"]
    assert {m["recipe"] for m in mods} == {"int4"} and {m["bits_per_param"] for m in mods} == {4.125}
    assert {(t["role"], t["dtype"], t["encoding"]) for m in mods for t in m["tensors"]} == {
        ("codes", "I32", "int4x2_offset8"), ("block_scale", "BF16", "weight_dtype"), ("shape", "I64", "int64")}
    code, text, err = run_cli("verify", out, "--reference", src, "--exact", "--json")
    assert code == 0, err
    rows = json.loads(text)["tensors"]
    assert len(rows) == 7 and {r["exact_identical_fraction"] for r in rows} == {1.0}
    code, text, err = run_cli("convert", src, root / "dry", "--recipe", "int4", "--dry-run", "--json")
    assert code == 0, err
    plan = json.loads(text)
    written = {}
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            written.update({n: f.get_slice(n).get_dtype() for n in f.keys()})
    planned = [o for t in plan["tensors"] for o in t["outputs"]]
    assert sorted(planned) == sorted(written)
    nbytes = sum(s.stat().st_size for s in out.glob("*.safetensors"))
    assert plan["bytes_out"] <= nbytes < plan["bytes_out"] + 2 * 8192  # tensor bytes, plus two headers


def test_relayout_dequantize_and_requantize(converted, run_cli):
    root, src, out = converted
    assert run_cli("convert", out, root / "re", "--recipe", "int4")[0] == 0  # lossless, byte for byte
    for shard in out.glob("*.safetensors"):
        assert (root / "re" / shard.name).read_bytes() == shard.read_bytes()
    code, _, err = run_cli("convert", out, root / "deq", "--recipe", "bf16")
    assert code == 0, err
    dense, written = _tensors(root / "deq"), _tensors(out)
    det = detect(open_source(str(out)))
    for module in det.modules:
        q = LAYOUT.from_disk(module, RECIPE, written.__getitem__, written)
        assert torch.equal(dense[f"{module}.weight"], RECIPE.dequantize(q).bfloat16()), module
    code, _, err = run_cli("verify", root / "deq", "--reference", out)
    assert code == 0, err
    # re-quantize from nvfp4: the FP32 decode is cast to the config's BF16 first, so the scales are BF16
    assert run_cli("convert", src, root / "nv", "--recipe", "nvfp4", "--quiet")[0] == 0
    code, _, err = run_cli("convert", root / "nv", root / "nv-int4", "--recipe", "int4")
    assert code == 0, err
    assert {t.dtype for n, t in _tensors(root / "nv-int4").items() if n.endswith("weight_scale")} == {torch.bfloat16}
    code, text, err = run_cli("verify", root / "nv-int4", "--reference", root / "nv", "--exact", "--json")
    assert code == 0, err
    assert {r["exact_identical_fraction"] for r in json.loads(text)["tensors"]} == {1.0}
    code, _, err = run_cli("verify", root / "nv-int4", "--reference", src)
    assert code == 0, err


def test_reads_what_llm_compressor_writes(converted, run_cli):
    """A checkpoint as llm-compressor 0.14 writes W4A16: compressed-tensors' compressor per Linear,
    its config as update_config writes it (version, transform_config, sorted keys)."""
    root, src, _ = converted
    dst = root / "llmc"
    dst.mkdir()
    state = {}
    for name, w in _tensors(src).items():
        if name.endswith("proj.weight"):
            state.update({f"{name[:-len('.weight')]}.{k}": t for k, t in ct_pack_quantized(w).items()})
        else:
            state[name] = w
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "config_groups": {"group_0": LLMC_W4A16_GROUP}, "format": "pack-quantized", "global_compression_ratio": None,
        "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}
    (dst / "config.json").write_text(json.dumps(config, sort_keys=True))
    code, text, err = run_cli("inspect", dst, "--json")
    assert code == 0, err
    assert {m["recipe"] for m in json.loads(text)["modules"]} == {"int4"}
    code, _, err = run_cli("verify", dst, "--reference", src, "--exact")
    assert code == 0, err


def test_transformers_loads_it_with_the_logits_of_our_decode(converted):
    """transformers' compressed-tensors integration decompresses weight_packed / weight_scale /
    weight_shape on the first forward; the decompressed weights equal quantcli's decode rounded
    to BF16 bit for bit, so the logits equal (tolerance 0) those of the source model run with
    quantcli's decoded weights in their place."""
    transformers = pytest.importorskip("transformers")
    _, src, out = converted
    ids = torch.arange(3, 19).reshape(1, 16)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(ids).logits
    ours = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    written, loaded, params = _tensors(out), model.state_dict(), ours.state_dict()
    det = detect(open_source(str(out)))
    for module in det.modules:
        decoded = RECIPE.dequantize(LAYOUT.from_disk(module, RECIPE, written.__getitem__, written)).bfloat16()
        assert torch.equal(loaded[f"{module}.weight"], decoded), module
        params[f"{module}.weight"].copy_(decoded)
    with torch.no_grad():
        expected = ours(ids).logits
    assert torch.equal(logits, expected), float((logits.float() - expected.float()).abs().max())


def test_verify_and_convert_refuse_corrupt_int4_tensors(converted, run_cli, tmp_path):
    """A NaN weight_scale is a scale fault (verify) and a corrupt source (convert); a weight_shape
    that disagrees with the codes makes the module unreadable (verify names it)."""
    import shutil

    _, _, out = converted
    module = "model.layers.0.mlp.down_proj"
    edits = {"nan": (f"{module}.weight_scale", lambda t: t.index_fill(1, torch.tensor([1]), float("nan"))),
             "shape": (f"{module}.weight_shape", lambda t: t.flip(0))}
    for case, (name, edit) in edits.items():
        bad = tmp_path / case
        shutil.copytree(out, bad)
        for shard in bad.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                tensors = {n: f.get_tensor(n) for n in f.keys()}
            if name in tensors:
                tensors[name] = edit(tensors[name])
                save_file(tensors, str(shard), metadata={"format": "pt"})
        (bad / "quantcli_manifest.json").unlink()  # read it as another producer's checkpoint
        code, text, err = run_cli("verify", bad, "--json")
        assert code != 0
        faults = {(f["tensor"], f["fault"].split(" at ")[0].split(":")[0]) for f in json.loads(text)["faults"]}
        expected = (module, "block scale nan") if case == "nan" else (module, "cannot be read back")
        assert expected in faults, faults
        if case == "nan":
            code, _, err = run_cli("convert", bad, tmp_path / "from-nan", "--recipe", "bf16")
            assert code != 0 and f"{module}.weight_scale" in err and "corrupt" in err
