"""verify items of issue 21 found by the fault-injection sweep and by a new user:

- a checkpoint with zero-size tensors ([0, 128], [64, 0], [0]) beside ordinary ones: convert
  leaves the empty Linears dense and excluded, and verify (with and without --reference) and
  inspect --stats pass instead of an internal error;
- `verify --exact -q` says which modules' bytes it could not check (activation-weighted scale
  search without --calibration) on its one verdict line, not only in the notes -q hides.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantcli.testing import make_llama

LAYER = "model.layers.0"


def _zero_size_source(root: Path) -> Path:
    src = root / "zs"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {f"{LAYER}.mlp.down_proj.weight": (torch.randn(64, 128, generator=g) * 0.02).bfloat16(),
               f"{LAYER}.self_attn.q_proj.weight": (torch.randn(128, 128, generator=g) * 0.02).bfloat16(),
               f"{LAYER}.mlp.up_proj.weight": torch.zeros(0, 128, dtype=torch.bfloat16),
               f"{LAYER}.mlp.gate_proj.weight": torch.zeros(64, 0, dtype=torch.bfloat16),
               f"{LAYER}.input_layernorm.weight": torch.zeros(0, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(128, dtype=torch.bfloat16)}
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1,
                                                 "architectures": ["LlamaForCausalLM"]}))
    return src


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8-block"])
def test_zero_size_tensors_convert_verify_and_inspect(recipe, tmp_path, run_cli):
    src = _zero_size_source(tmp_path)
    dst = tmp_path / "out"
    code, _, err = run_cli("convert", src, dst, "--recipe", recipe, "-q")
    assert code == 0, err
    out = load_file(str(next(dst.glob("*.safetensors"))))
    for name, shape in ((f"{LAYER}.mlp.up_proj.weight", (0, 128)), (f"{LAYER}.mlp.gate_proj.weight", (64, 0)),
                        (f"{LAYER}.input_layernorm.weight", (0,))):
        assert tuple(out[name].shape) == shape and out[name].dtype == torch.bfloat16  # left dense, as they were
    for args in (("--reference", src), ()):
        code, out_text, err = run_cli("verify", dst, *args, "--json")
        assert "internal error" not in err and code == 0, (args, err, out_text)
        doc = json.loads(out_text)
        assert doc["passed"] and doc["modules"] == 2
    code, _, err = run_cli("inspect", dst, "--stats")
    assert code == 0 and "internal error" not in err


def test_exact_quiet_says_which_bytes_it_did_not_check(run_cli, tmp_path):
    pytest.importorskip("transformers")
    from test_calibrate_verify import _tokenizer, _words

    src = make_llama(tmp_path / "llama", hidden=64, layers=1, shards=1)
    _tokenizer(src)
    data = tmp_path / "cal.txt"
    data.write_text("\n".join(_words(i) for i in range(6)) + "\n")
    dst = tmp_path / "w"
    code, _, err = run_cli("convert", src, dst, "--recipe", "nvfp4", "--scale-search", "mse", "--calibration", data,
                           "-q")
    assert code == 0, err
    modules = len(json.loads((dst / "quantcli_manifest.json").read_text())["modules"])
    code, out, _ = run_cli("verify", dst, "--reference", src, "--exact", "-q")
    assert code == 0 and out.strip() == f"PASS ({modules} module(s) not byte-checked: need --calibration)"
    code, out, _ = run_cli("verify", dst, "--reference", src, "--exact", "--json")
    assert len(json.loads(out)["not_byte_checked"]) == modules
    code, out, _ = run_cli("verify", dst, "--reference", src, "--exact", "--calibration", data, "-q")
    assert code == 0 and out.strip() == "PASS"
