"""verify's verdicts on what real producers write, and on corruptions of it.

Checkpoints are made with the producers' own arithmetic: compressed-tensors' quantization
functions and compressors (llm-compressor's flow, BF16 intermediates and BF16 FP8 scales) and
ModelOpt's MXFP4 export arithmetic (docs/formats.md, "ModelOpt MXFP4 export"). Each must pass; each corruption of them
must fail (exit 1) naming the tensor. The tolerance table in quantcli/verify/ was measured with
these same producers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import get_layout
from quantcli.verify.findings import REF_ERROR

pytest.importorskip("compressed_tensors")

LAYER = "model.layers.0"
SHAPES = {f"{LAYER}.self_attn.q_proj": (128, 128), f"{LAYER}.self_attn.k_proj": (64, 128),
          f"{LAYER}.self_attn.v_proj": (64, 128), f"{LAYER}.self_attn.o_proj": (128, 128),
          f"{LAYER}.mlp.gate_proj": (256, 128), f"{LAYER}.mlp.up_proj": (256, 128),
          f"{LAYER}.mlp.down_proj": (128, 256)}
UP, GATE, DOWN = f"{LAYER}.mlp.up_proj", f"{LAYER}.mlp.gate_proj", f"{LAYER}.mlp.down_proj"
QPROJ, OPROJ = f"{LAYER}.self_attn.q_proj", f"{LAYER}.self_attn.o_proj"


# ---------------------------------------------------------------- producers' arithmetic


def _ct_scheme(preset: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme(preset, ["Linear"])


def ct_nvfp4(w: torch.Tensor, group_amax: torch.Tensor | None = None) -> dict:
    """llm-compressor NVFP4A16: amax in the weight dtype, CT's generate_gparam (fused groups share
    the group's amax) and calculate_qparams, CT's NVFP4 compressor."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = _ct_scheme("NVFP4A16")
    amax = w.abs().amax() if group_amax is None else group_amax.to(w.dtype)
    gs = generate_gparam(-amax, amax)
    b = w.reshape(*w.shape[:-1], -1, 16)
    scale, _ = calculate_qparams(b.amin(-1), b.amax(-1), scheme.weights, global_scale=gs)
    sd = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized").compress(
        {"weight": w, "weight_scale": scale, "weight_global_scale": gs}, scheme)
    return {"weight_packed": sd["weight_packed"], "weight_scale": sd["weight_scale"],
            "weight_global_scale": gs.to(torch.float32).reshape(1)}


def ct_mx(w: torch.Tensor, preset: str = "MXFP4A16") -> dict:
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme(preset)
    b = w.reshape(*w.shape[:-1], -1, 32)
    scale, _ = calculate_qparams(b.amin(-1), b.amax(-1), scheme.weights)
    fmt = "mxfp4-pack-quantized" if preset.startswith("MXFP4") else "mxfp8-quantized"
    sd = BaseCompressor.get_value_from_registry(fmt).compress({"weight": w, "weight_scale": scale}, scheme)
    return {k: v for k, v in sd.items() if k in ("weight", "weight_packed", "weight_scale")}


def ct_fp8(w: torch.Tensor, strategy: str) -> dict:
    """llm-compressor FP8_BLOCK / FP8_DYNAMIC: scales computed and stored in the weight dtype (BF16)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = _ct_scheme("FP8_BLOCK" if strategy == "block" else "FP8_DYNAMIC")
    n, k = w.shape
    if strategy == "block":
        nb, kb = -(-n // 128), -(-k // 128)
        pad = torch.zeros(nb * 128, kb * 128, dtype=w.dtype)
        pad[:n, :k] = w
        b = pad.reshape(nb, 128, kb, 128)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    else:
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale, _ = calculate_qparams(lo, hi, scheme.weights)
    sd = BaseCompressor.get_value_from_registry("float-quantized").compress({"weight": w, "weight_scale": scale},
                                                                            scheme)
    return {"weight": sd["weight"], "weight_scale": scale}


def mo_mxfp4(w: torch.Tensor) -> dict:
    """ModelOpt MXFP4QTensor as exported (docs/formats.md, "ModelOpt MXFP4 export" and
    "E2M1 rounding: ties to the even code"): RCEIL exponent and the division in
    the weight dtype, elements with ties toward zero and 0.0 -> 0x8; `weight` U8 + `weight_scale` U8."""
    x = w.reshape(-1, 32)
    descale = x.abs().amax(-1, keepdim=True) / 6.0
    e = torch.ceil(torch.maximum(torch.log2(descale), torch.tensor(-127.0, dtype=descale.dtype)))
    y = (x / torch.exp2(e)).reshape(w.shape).float()
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    mag = ((y.abs().unsqueeze(-1) - bounds) > 0).sum(-1)
    q = (((2 - torch.sign(y)) // 2).to(torch.int64) * 8 + mag).to(torch.uint8)
    return {"weight": q[..., 0::2] | (q[..., 1::2] << 4),
            "weight_scale": (e + 127).to(torch.uint8).reshape(*w.shape[:-1], -1)}


def ct_nvfp4_fused(weights: dict[str, torch.Tensor]) -> dict[str, dict]:
    groups: dict[str, torch.Tensor] = {}
    for m, w in weights.items():
        g = fused_group_of(m) or m
        groups[g] = torch.maximum(groups.get(g, torch.zeros((), dtype=w.dtype)), w.abs().amax())
    return {m: ct_nvfp4(w, groups[fused_group_of(m) or m]) for m, w in weights.items()}


CT = get_layout("compressed-tensors")
PRODUCERS = {  # name -> (recipe, per-checkpoint producer, config, hf_quant_config)
    "ct-nvfp4": ("nvfp4", ct_nvfp4_fused),
    "ct-mxfp4": ("mxfp4", lambda ws: {m: ct_mx(w) for m, w in ws.items()}),
    "ct-mxfp8": ("mxfp8", lambda ws: {m: ct_mx(w, "MXFP8A16") for m, w in ws.items()}),
    "ct-fp8-block": ("fp8-block", lambda ws: {m: ct_fp8(w, "block") for m, w in ws.items()}),
    "ct-fp8-channel": ("fp8-channel", lambda ws: {m: ct_fp8(w, "channel") for m, w in ws.items()}),
}
MO_MXFP4_CONFIG = {"producer": {"name": "modelopt", "version": "0.37.0"},
                   "quantization": {"quant_algo": "MXFP4", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}


def reference_weights(seed: int = 0, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """Heavy-tailed BF16 weights (Student-t, 3 dof), like real checkpoints' outliers."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m, shape in SHAPES.items():
        t = torch.randn(shape, generator=g) / torch.sqrt(torch.rand(shape, generator=g).clamp_min(0.02) * 3)
        out[m] = (t * scale).to(torch.bfloat16)
    return out


def dense_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return {"model.embed_tokens.weight": (torch.randn(64, 128, generator=g) * 0.02).to(torch.bfloat16),
            "lm_head.weight": (torch.randn(64, 128, generator=g) * 0.02).to(torch.bfloat16),
            f"{LAYER}.input_layernorm.weight": torch.ones(128, dtype=torch.bfloat16),
            "model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}


def write_checkpoint(path: Path, modules: dict[str, dict], config: dict | None, hf_quant: dict | None = None,
                     dense: dict | None = None) -> Path:
    path.mkdir(parents=True)
    tensors = dict(dense_tensors() if dense is None else dense)
    for m, parts in modules.items():
        tensors.update({f"{m}.{k}": v.contiguous() for k, v in parts.items()})
    save_file(tensors, str(path / "model.safetensors"))
    cfg = {"model_type": "llama", "num_hidden_layers": 1}
    if config is not None:
        cfg["quantization_config"] = config
    (path / "config.json").write_text(json.dumps(cfg))
    if hf_quant is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ref") / "ref"
    write_checkpoint(d, {m: {"weight": w} for m, w in reference_weights().items()}, None)
    return d


@pytest.fixture(scope="module")
def produced(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("producers")
    ws = reference_weights()
    out = {}
    for name, (recipe, make) in PRODUCERS.items():
        out[name] = write_checkpoint(root / name, make(ws), CT.quantization_config({recipe: ["x"]}, ["lm_head"]))
    out["mo-mxfp4"] = write_checkpoint(root / "mo-mxfp4", {m: mo_mxfp4(w) for m, w in ws.items()}, None,
                                       MO_MXFP4_CONFIG)
    return out


def edited(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def verify_json(run_cli, *args) -> tuple[int, dict]:
    code, out, err = run_cli("verify", *map(str, args), "--json")
    assert "Traceback" not in err
    return code, json.loads(out)


# ---------------------------------------------------------------- correct producers pass


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_real_producers_checkpoints_pass(producer, produced, reference, run_cli):
    code, doc = verify_json(run_cli, produced[producer], "--reference", reference)
    assert code == 0 and doc["passed"], doc["faults"]
    assert len(doc["tensors"]) == len(SHAPES)
    assert all(c["passed"] for c in doc["checks"])


# ---------------------------------------------------------------- corruptions fail, naming the tensor


def _swap_nibbles(t, name):
    t[name] = ((t[name] >> 4) | (t[name] << 4)).to(torch.uint8)


def _transpose(t, name):
    s = t[name]
    t[name] = s.view(torch.uint8).t().contiguous().reshape(s.shape).view(s.dtype)


def _set(t, name, value):
    t[name] = value


CORRUPTIONS = {
    "nibbles swapped": ("ct-nvfp4", UP, lambda t: _swap_nibbles(t, f"{UP}.weight_packed")),
    "global inverted": ("ct-nvfp4", DOWN, lambda t: _set(t, f"{DOWN}.weight_global_scale",
                                                         1.0 / t[f"{DOWN}.weight_global_scale"])),
    "codes of another tensor": ("ct-nvfp4", GATE, lambda t: _set(t, f"{GATE}.weight_packed",
                                                                             t[f"{UP}.weight_packed"].clone())),
    "mx scales transposed": ("ct-mxfp4", QPROJ, lambda t: _transpose(t, f"{QPROJ}.weight_scale")),
    "mx scale exponent +1": ("ct-mxfp4", DOWN,
                             lambda t: _set(t, f"{DOWN}.weight_scale", t[f"{DOWN}.weight_scale"] + 1)),
    "mx scale exponent -1": ("ct-mxfp8", UP, lambda t: _set(t, f"{UP}.weight_scale", t[f"{UP}.weight_scale"] - 1)),
    "mx scales shifted": ("mo-mxfp4", DOWN, lambda t: _set(t, f"{DOWN}.weight_scale",
                                                           t[f"{DOWN}.weight_scale"].roll(1, -1))),
    "bf16 block scale x2": ("ct-fp8-block", DOWN,
                            lambda t: _set(t, f"{DOWN}.weight_scale", t[f"{DOWN}.weight_scale"] * 2)),
    "bf16 channel scales shifted": ("ct-fp8-channel", GATE, lambda t: _set(t, f"{GATE}.weight_scale",
                                                                        t[f"{GATE}.weight_scale"].roll(1, 0))),
    "nvfp4 scales one code high": ("ct-nvfp4", DOWN, lambda t: _scale_codes_up(t, f"{DOWN}.weight_scale")),
    "16 nvfp4 scales set to 448": ("ct-nvfp4", UP, lambda t: _scales_to_448(t, f"{UP}.weight_scale", 16)),
}


def _scale_codes_up(t, name):
    """Every E4M3 block scale one code higher (448 stays): each block decodes ~1.07-1.125 x."""
    codes = t[name].view(torch.uint8)
    t[name] = torch.where(codes < 0x7E, codes + 1, codes).to(torch.uint8).view(torch.float8_e4m3fn)


def _scales_to_448(t, name, count):
    """`count` block scales, spread over the module, set to 448 (a valid E4M3 value)."""
    s = t[name].float().flatten()
    s[torch.linspace(0, s.numel() - 1, count).long()] = 448.0
    t[name] = s.reshape(t[name].shape).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_each_corruption_fails_naming_the_tensor(corruption, produced, reference, tmp_path, run_cli):
    producer, module, edit = CORRUPTIONS[corruption]
    bad = edited(produced[producer], tmp_path / "bad", edit)
    code, doc = verify_json(run_cli, bad, "--reference", reference)
    assert code == 1 and not doc["passed"]
    named = [f for f in doc["faults"] if f["tensor"] == module]
    assert named, doc["faults"]
    if producer != "mo-mxfp4":  # (its only other fault is the unservable pair)
        assert all(f["tensor"] == module for f in doc["faults"]), doc["faults"]


def test_margin_threshold_still_overrides(produced, reference, run_cli):
    code, doc = verify_json(run_cli, produced["ct-fp8-block"], "--reference", reference, "--threshold", "margin=0")
    assert code == 1 and doc["faults"] and all("by more than 0%" in f["fault"] for f in doc["faults"])


# ---------------------------------------------------------------- BF16 scales: read, re-layout to F32 losslessly


@pytest.mark.parametrize("producer,recipe,layout,scale", [
    ("ct-fp8-block", "fp8-block", "fp8", "weight_scale_inv"),
    ("ct-fp8-channel", "fp8-channel", "modelopt", "weight_scale")])
def test_bf16_scales_relayout_losslessly_to_f32(producer, recipe, layout, scale, produced, reference, tmp_path,
                                                run_cli):
    src = produced[producer]
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", src, dst, "--recipe", recipe, "--layout", layout)
    assert code == 0, err
    assert "BF16" in err and "lossless" in err
    before, after = load_file(str(src / "model.safetensors")), load_file(str(dst / "model.safetensors"))
    for m in SHAPES:
        assert before[f"{m}.weight_scale"].dtype == torch.bfloat16 and after[f"{m}.{scale}"].dtype == torch.float32
        assert torch.equal(before[f"{m}.weight_scale"].float().flatten(), after[f"{m}.{scale}"].flatten())
        assert torch.equal(before[f"{m}.weight"].view(torch.uint8), after[f"{m}.weight"].view(torch.uint8))
    code, doc = verify_json(run_cli, dst, "--reference", reference)
    assert code == 0, doc["faults"]


# ---------------------------------------------------------------- ModelOpt's own MXFP4 export


def test_modelopt_mxfp4_is_recognised_decoded_and_reported_unservable(produced, reference, tmp_path, run_cli):
    src = produced["mo-mxfp4"]
    code, out, _ = run_cli("inspect", src, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["layout"] == "modelopt"
    assert {m["recipe"] for m in doc["modules"]} == {"mxfp4"} and len(doc["modules"]) == len(SHAPES)
    code, doc = verify_json(run_cli, src, "--reference", reference)
    assert code == 1
    (fault,) = doc["faults"]  # decoded within tolerance: only the pair is wrong
    assert "no serving engine loads" in fault["fault"] and "compressed-tensors, gpt-oss" in fault["fault"]
    code, out, _ = run_cli("inspect", src, "--json")  # inspect says it too, as a problem
    assert any("no serving engine loads mxfp4 in the modelopt layout" in p for p in json.loads(out)["problems"])
    dst = tmp_path / "ct"
    code, _, err = run_cli("convert", src, dst, "--recipe", "mxfp4", "--layout", "compressed-tensors")
    assert code == 0, err
    code, doc = verify_json(run_cli, dst, "--reference", reference)
    assert code == 0, doc["faults"]


# ---------------------------------------------------------------- global-scale direction without a reference


def _modelopt_nvfp4(tmp_path, run_cli, weights: dict[str, torch.Tensor]) -> Path:
    src = write_checkpoint(tmp_path / "src", {m: {"weight": w} for m, w in weights.items()}, None)
    dst = tmp_path / "nvfp4"
    code, _, err = run_cli("convert", src, dst, "--recipe", "nvfp4")
    assert code == 0, err
    return dst


def test_global_scale_direction_from_consistency_not_magnitude(tmp_path, run_cli):
    ws = reference_weights()
    ws[DOWN] = (torch.randn(SHAPES[DOWN]) * 1500).to(torch.bfloat16)  # amax ~6000: s2 > 1, legitimate
    path = _modelopt_nvfp4(tmp_path, run_cli, ws)
    t = load_file(str(path / "model.safetensors"))
    assert float(t[f"{DOWN}.weight_scale_2"]) > 1 and float(t[f"{OPROJ}.weight_scale_2"]) < 1e-3
    code, doc = verify_json(run_cli, path)
    assert code == 0, doc["faults"]
    for module in (OPROJ, DOWN):  # inverted: s2 < 1 stored as 1/s2, and s2 > 1 stored as 1/s2
        bad = edited(path, tmp_path / f"inv-{module.rsplit('.', 1)[1]}",
                     lambda t: _set(t, f"{module}.weight_scale_2", 1.0 / t[f"{module}.weight_scale_2"]))
        code, doc = verify_json(run_cli, bad)
        if module == OPROJ:
            assert code == 1 and [f["tensor"] for f in doc["faults"]] == [OPROJ], doc["faults"]
            assert "looks inverted" in doc["faults"][0]["fault"]
        else:  # 1/s2 ~ s2 for a tensor near 2688: only a reference can tell; nothing else is blamed
            assert all(f["tensor"] == DOWN for f in doc["faults"])


# ---------------------------------------------------------------- the config's recipe wins when consistent


def test_fp8_channel_with_k32_is_not_called_block(tmp_path, run_cli):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1, 32, generator=g) * 0.02).to(torch.bfloat16)  # 1x32: scale [1, 1] fits 3 recipes
    module = f"{LAYER}.mlp.up_proj"
    cfg = CT.quantization_config({"fp8-channel": ["x"]}, ["lm_head"])
    path = write_checkpoint(tmp_path / "k32", {module: ct_fp8(w, "channel")}, cfg)
    code, doc = verify_json(run_cli, path)
    assert code == 0, doc["faults"]
    # tensors that contradict the config are still reported
    w2 = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    path = write_checkpoint(tmp_path / "contra", {module: ct_fp8(w2, "block")}, cfg)
    code, doc = verify_json(run_cli, path)
    assert code == 1 and any("look like fp8-block" in f["fault"] for f in doc["faults"])


# ---------------------------------------------------------------- each check's result printed once known


def test_wrong_reference_reports_each_check_with_its_status(produced, tmp_path, run_cli):
    wrong = dict(dense_tensors())
    wrong["model.extra.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    wrong.update({f"{m}.weight": w for m, w in reference_weights(seed=5).items() if m != UP})
    ref = write_checkpoint(tmp_path / "wrong", {}, None, dense=wrong)
    code, out, err = run_cli("verify", produced["ct-fp8-block"], "--reference", ref)
    assert code == 1 and "Traceback" not in err
    lines = out.splitlines()
    status = {ln.split(None, 1)[1].split(") ", 1)[-1].strip(): ln.split()[0] for ln in lines
              if ln.startswith("  ok") or ln.startswith("  FAIL")}
    assert status["every reference tensor present in the checkpoint"] == "FAIL"
    assert status["every quantized module has a reference tensor of the same shape"] == "FAIL"
    assert status[REF_ERROR] == "FAIL"
    assert status["unquantized tensors bit-identical to the reference"] == "ok"
    assert not any("checked:" in ln for ln in lines)
    assert any("model.extra.weight" in ln and "missing" in ln for ln in lines)


# ---------------------------------------------------------------- non-finite decodes are findings, not crashes


@pytest.mark.parametrize("with_reference", [False, True])
def test_blocks_that_decode_to_inf_fail_naming_the_tensor(with_reference, produced, reference, tmp_path, run_cli):
    def overflow(t):  # E8M0 254 = 2^127 times code 448 overflows FP32
        s = t[f"{DOWN}.weight_scale"].clone()
        s[0, 0] = 254
        t[f"{DOWN}.weight_scale"] = s
        c = t[f"{DOWN}.weight"].clone()
        c[0, 0] = 448.0
        t[f"{DOWN}.weight"] = c

    bad = edited(produced["ct-mxfp8"], tmp_path / "inf", overflow)
    args = ("--reference", reference) if with_reference else ()
    code, doc = verify_json(run_cli, bad, *args)
    assert code == 1
    finite = [f for f in doc["faults"] if "non-finite" in f["fault"]]
    assert [f["tensor"] for f in finite] == [DOWN]
    assert math.isfinite(sum(r["rel_err"] for r in doc["tensors"]))


def test_fused_group_mixing_precisions_fails(tmp_path, run_cli):
    """A checkpoint (another producer's) whose q_proj is dense while k/v are NVFP4 does not load in
    vLLM; verify names the group even when the dense member is in the exclusion list."""
    from safetensors.torch import load_file, save_file

    from quantcli.testing import make_llama

    src = make_llama(tmp_path / "src", hidden=64, layers=1, shards=1)
    out = tmp_path / "q"
    assert run_cli("convert", src, out, "--recipe", "nvfp4", "--quiet")[0] == 0
    shard = out / "model.safetensors"
    tensors = load_file(shard)
    q = "model.layers.0.self_attn.q_proj"
    for suffix in (".weight", ".weight_scale", ".weight_scale_2"):
        tensors.pop(q + suffix)
    tensors[q + ".weight"] = load_file(src / "model.safetensors")[q + ".weight"]
    save_file(tensors, shard)
    (out / "quantcli_manifest.json").unlink()
    for name in ("config.json", "hf_quant_config.json"):
        doc = json.loads((out / name).read_text())
        section = doc["quantization_config"] if name == "config.json" else doc["quantization"]
        key = "ignore" if name == "config.json" else "exclude_modules"
        section[key] = section[key] + [q]
        (out / name).write_text(json.dumps(doc))
    code, doc = verify_json(run_cli, out)
    assert code == 1
    assert any("mixes precisions" in f["fault"] and "q_proj dense" in f["fault"] for f in doc["faults"]), doc["faults"]
