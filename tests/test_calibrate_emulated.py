"""Emulated W4A4 / W8A8-static inference of quantcli's calibrated compressed-tensors output.

transformers decodes the weights with compressed-tensors' own decompressor; each quantized
Linear's input is then fake-quantized by compressed-tensors' own functions
(compute_dynamic_scales_and_zp + fake_quantize) with the activation arguments of our
config.json and the activation scale we wrote. Logits must stay close to the original model,
and an inverted activation scale (the classic direction bug) must visibly wreck them: so the
test proves the scale is read, and read the way we wrote it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantcli.testing import make_llama

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("emu") / "llama", hidden=64, layers=2, shards=1)


def _ids() -> torch.Tensor:
    return torch.tensor([[(13 * i + 7 * j + 1) % 512 for j in range(16)] for i in range(3)])


def _fake_quant_hooks(model, out: Path, scale_name: str, invert: bool = False) -> list:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    from safetensors.torch import load_file

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["input_activations"])
    stored = {k: v.float() for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    hooks = []
    for name, mod in model.named_modules():
        scale = stored.get(f"{name}.{scale_name}")
        if scale is None:
            continue
        scale = 1.0 / scale if invert else scale

        def hook(module, inputs, scale=scale):
            x = inputs[0]
            if args.dynamic:  # NVFP4: per-16 scales on the fly under our global scale
                local, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module(),
                                                          global_scale=scale)
                return (fake_quantize(x=x, scale=local, zero_point=zp, args=args, global_scale=scale),)
            return (fake_quantize(x=x, scale=scale, zero_point=None, args=args),)  # static FP8

        hooks.append(mod.register_forward_pre_hook(hook))
    return hooks


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("recipe,scale_name,floor", [("nvfp4", "input_global_scale", 0.97),
                                                     ("fp8", "input_scale", 0.995)])
def test_emulated_activation_quantization_close_to_original(src, tmp_path, run_cli, recipe, scale_name, floor):
    data = tmp_path / "ids.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in _ids().tolist()))
    out = tmp_path / "out"
    code, _, err = run_cli("convert", str(src), str(out), "--recipe", recipe, "--layout", "compressed-tensors",
                           "--activations", "static", "--calibration", str(data), "--quiet")
    assert code == 0, err
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)).eval()
    ids = _ids()
    with torch.no_grad():
        base, weight_only = ref(ids).logits, model(ids).logits
        hooks = _fake_quant_hooks(model, out, scale_name)
        assert len(hooks) == 2 * 7  # every quantized Linear of both layers
        emulated = model(ids).logits
        for h in hooks:
            h.remove()
        hooks = _fake_quant_hooks(model, out, scale_name, invert=True)
        inverted = model(ids).logits
        for h in hooks:
            h.remove()
    cos_w, cos_wa, cos_bad = _cosine(base, weight_only), _cosine(base, emulated), _cosine(base, inverted)
    assert floor < cos_wa < 1.0, cos_wa  # close to the original, and really quantized
    assert cos_wa < cos_w + 1e-6  # activation quantization adds error, never removes it
    assert cos_bad < cos_wa - 0.05, (cos_bad, cos_wa)  # the scale matters, in the direction we wrote
