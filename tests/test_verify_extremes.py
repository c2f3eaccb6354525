"""verify on inputs convert accepts at the edges: values at a dtype's largest finite magnitude, one
huge outlier among small weights, a whole row at the maximum, zero-size, one-row and
non-contiguous tensors, in every dtype a source may hold.

The crash these hold down: the per-block statistics (kernels/blockstats.py) prescaled the stored
scales in place when the values are near FP32 max. A per-tensor scale is one value expanded over
the rows (`more than one element of the written-to tensor refers to a single memory location`,
exit 3); a per-channel or block scale read from the checkpoint is a view of its read-only memory
map (a segmentation fault, exit -11). The statistics must leave their inputs untouched, and verify
must pass every fresh rounding of them. A segfault kills the process that has it, so the CLI checks
run verify as a separate process: a crash fails the test, not the run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantcli.kernels import quantize
from quantcli.kernels.blockstats import block_stats
from quantcli.recipes import RECIPES, get_recipe
from quantcli.verify.judge import judge

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("max", "outlier", "rowmax")
ROWS, K = 128, 256


def _weight(dtype: torch.dtype, kind: str, rows: int = ROWS, k: int = K) -> torch.Tensor:
    w = torch.randn(rows, k, generator=torch.Generator().manual_seed(0)) * 0.02
    big = torch.finfo(dtype).max
    if kind == "max":
        w[0, 0], w[min(5, rows - 1), min(7, k - 1)] = big, -big
    elif kind == "outlier":
        w[min(3, rows - 1), min(3, k - 1)] = 5000.0
    elif kind == "rowmax":
        w[min(1, rows - 1), :] = big
    return w.to(dtype)


def _stats(recipe_name: str, x: torch.Tensor):
    recipe = get_recipe(recipe_name)
    q = quantize(x.float() if x.dtype == torch.float16 else x, recipe.spec)
    scale_before = q.scale.clone()
    codes_before = q.codes.clone()
    st = block_stats(x, q, recipe.spec)
    assert torch.equal(q.scale.view(torch.uint8) if q.scale.dtype.itemsize == 1 else q.scale, scale_before.view(
        torch.uint8) if scale_before.dtype.itemsize == 1 else scale_before), "block_stats wrote into the scales"
    assert torch.equal(q.codes, codes_before), "block_stats wrote into the codes"
    return st, judge(st, recipe, tuple(x.shape))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_fresh_rounding_of_extreme_values_is_judged_without_crashing(recipe, dtype, kind):
    st, verdict = _stats(recipe, _weight(dtype, kind))
    assert st.nonfinite == 0
    assert not verdict.reasons, verdict.reasons


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_zero_size_one_row_and_strided_tensors(recipe):
    k = max(get_recipe(recipe).spec.k_multiple or 1, 128)
    for x in (torch.zeros(0, k), _weight(torch.float32, "outlier", 1, k),
              _weight(torch.bfloat16, "max", 2 * k, 2 * ROWS)[::2, ::2][:, :k],  # strided both ways
              _weight(torch.float32, "rowmax", k, ROWS).t()):  # transposed: [ROWS, k] with column strides
        st, verdict = _stats(recipe, x)
        assert st.nonfinite == 0
        assert not verdict.reasons, (tuple(x.shape), verdict.reasons)


# ---------------------------------------------------------------- the CLI, one process per run

def _llama(folder: Path, dtype: torch.dtype, kind: str) -> Path:
    """A one-layer Llama in `dtype` whose down_proj holds the extreme values."""
    folder.mkdir(parents=True)
    h, i = 128, 256
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": i, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "torch_dtype": names[dtype], "rms_norm_eps": 1e-5, "max_position_embeddings": 128}
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1)
    p = "model.layers.0."
    shapes = {"model.embed_tokens.weight": (256, h), "lm_head.weight": (256, h),
              p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h // 2, h),
              p + "self_attn.v_proj.weight": (h // 2, h), p + "self_attn.o_proj.weight": (h, h),
              p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)}
    tensors = {n: (torch.randn(*s, generator=g) * 0.02).to(dtype) for n, s in shapes.items()}
    for norm in ("model.norm", p + "input_layernorm", p + "post_attention_layernorm"):
        tensors[f"{norm}.weight"] = torch.ones(h, dtype=dtype)
    tensors[p + "mlp.down_proj.weight"] = _weight(dtype, kind, h, i)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "quantcli", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def _convert_and_verify(tmp_path: Path, dtype: torch.dtype, kind: str, recipe: str) -> None:
    src = _llama(tmp_path / "src", dtype, kind)
    dst = tmp_path / recipe
    done = _cli("convert", src, dst, "--recipe", recipe, "--quiet")
    assert done.returncode == 0, done.stderr
    checked = _cli("verify", dst, "--reference", src)
    assert checked.returncode == 0, f"verify exit {checked.returncode}: {checked.stdout[-2000:]}{checked.stderr}"
    assert "Traceback" not in checked.stderr


@pytest.mark.parametrize("recipe", ["fp8", "fp8-channel"])
def test_verify_of_fp32_max_values_exits_cleanly(tmp_path, recipe):
    """The two crashes (per-tensor: exit 3; per-channel, read from the mapped file: a segfault)."""
    _convert_and_verify(tmp_path, torch.float32, "max", recipe)


# the in-process matrix above covers every recipe x dtype x extreme; these read each from the mapped file
SLOW_CASES = [(r, torch.float32, "max") for r in ("fp8-block", "mxfp8", "mxfp4", "nvfp4", "int4")] + [
    (r, d, k) for r in ("fp8-channel", "fp8-block")
    for d, k in ((torch.bfloat16, "rowmax"), (torch.float16, "outlier"))]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, dtype, kind", SLOW_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_verify_of_extreme_sources_exits_cleanly(tmp_path, recipe, dtype, kind):
    _convert_and_verify(tmp_path, dtype, kind, recipe)


@pytest.mark.parametrize("recipe", ["fp8-channel", "fp8-block", "mxfp8", "mxfp4"])
def test_a_wrong_small_block_beside_fp32_max_is_caught(recipe):
    """A value near FP32 max once put the whole tensor's sums through a 2^-80 prescale, which
    flushed every ordinary block's squares to zero: those blocks went unjudged and a scale doubled
    there passed. Such a tensor's sums are now taken in FP64."""
    r = get_recipe(recipe)
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, 0] = torch.finfo(torch.float32).max
    q = quantize(w, r.spec)
    st = block_stats(w, q, r.spec)
    assert int((st.ss == 0).sum()) == 0 and not judge(st, r, tuple(w.shape)).reasons
    scale = q.scale.clone()
    if scale.dtype == torch.uint8:  # E8M0: one exponent up doubles the block
        scale.view(-1)[-1] += 1
    else:
        scale.view(-1)[-1] *= 2
    verdict = judge(block_stats(w, dataclasses.replace(q, scale=scale), r.spec), r, tuple(w.shape))
    assert any("1 of" in reason and "their scales are wrong" in reason for reason in verdict.reasons), verdict.reasons
