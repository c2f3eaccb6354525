"""Every byte quantcli writes is pinned: for each (recipe, layout) pair it supports, on a small
Llama-, Mixtral- and gpt-oss-style checkpoint, and for every re-layout, dequantize and
re-quantize path, the SHA-256 of each output file must equal tests/data/output_pins.json.

A refactor must not change these. A deliberate change of output regenerates the file with
`QUANTCLI_REPIN=1 python -m pytest tests/test_output_pins.py` and says why in the commit.

The sources are built from torch's seeded generator and written with quantcli's own writer (not
transformers, whose random init may change between releases), so the pins depend only on the
pinned torch version and on quantcli.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from quantcli.checkpoint.safetensors_io import write_file
from quantcli.formats.layouts import layouts_for
from quantcli.recipes import RECIPES

PINS = Path(__file__).parent / "data" / "output_pins.json"
# Files whose content names the machine or the version, not the conversion.
VOLATILE_MANIFEST_KEYS = ("quantcli_version", "source", "fingerprint")


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 0.02).bfloat16()


def _llama_tensors(g: torch.Generator, hidden: int = 128) -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": _randn(g, 256, hidden),
        p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": _randn(g, hidden, hidden),
        p + "self_attn.k_proj.weight": _randn(g, 64, hidden),  # N = 64: no whole 128x128 block
        p + "self_attn.v_proj.weight": _randn(g, 64, hidden),
        p + "self_attn.o_proj.weight": _randn(g, hidden, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": _randn(g, 256, hidden),
    }


def _write(root: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict) -> Path:
    root.mkdir(parents=True)
    for shard, tensors in shards.items():
        write_file(root / shard, tensors)
    if len(shards) > 1:
        weight_map = {n: s for s, ts in shards.items() for n in ts}
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(config))
    return root


def make_sources(root: Path) -> dict[str, Path]:
    g = torch.Generator().manual_seed(1234)
    llama = _llama_tensors(g)
    llama.update({"model.layers.0.mlp.gate_proj.weight": _randn(g, 256, 128),
                  "model.layers.0.mlp.up_proj.weight": _randn(g, 256, 128),
                  "model.layers.0.mlp.down_proj.weight": _randn(g, 128, 256)})
    names = sorted(llama)
    llama_cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                 "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    moe = _llama_tensors(g)
    moe["model.layers.0.mlp.gate.weight"] = _randn(g, 4, 128)
    for e in range(4):
        for w, shape in (("w1", (256, 128)), ("w3", (256, 128)), ("w2", (128, 256))):
            moe[f"model.layers.0.mlp.experts.{e}.{w}.weight"] = _randn(g, *shape)
    moe_names = sorted(moe)
    goss = {"model.layers.0.mlp.experts.gate_up_proj": _randn(g, 4, 64, 128),  # [E, in, out]
            "model.layers.0.mlp.experts.down_proj": _randn(g, 4, 64, 64),
            "model.layers.0.mlp.router.weight": _randn(g, 4, 64),
            "model.layers.0.self_attn.q_proj.weight": _randn(g, 64, 64),
            "model.layers.0.self_attn.o_proj.weight": _randn(g, 64, 64)}
    return {
        "llama": _write(root / "llama", {"model-00001-of-00002.safetensors": {n: llama[n] for n in names[:6]},
                                         "model-00002-of-00002.safetensors": {n: llama[n] for n in names[6:]}},
                        llama_cfg),
        "moe": _write(root / "moe", {"model-00001-of-00002.safetensors": {n: moe[n] for n in moe_names[:10]},
                                     "model-00002-of-00002.safetensors": {n: moe[n] for n in moe_names[10:]}},
                      {**llama_cfg, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                       "num_local_experts": 4}),
        "gpt-oss": _write(root / "goss", {"model.safetensors": goss},
                          {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 1}),
    }


def file_digests(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == "quantcli_manifest.json":
            doc = json.loads(data)
            for key in VOLATILE_MANIFEST_KEYS:
                doc.pop(key, None)
            data = json.dumps(doc, sort_keys=True).encode()
        elif p.name == "README.md":  # the model card names the source path and the version
            continue
        out[p.relative_to(folder).as_posix()] = hashlib.sha256(data).hexdigest()
    return out


def conversions() -> list[tuple[str, str, str, str]]:
    """(case id, source id, recipe, layout); sources named 'q:<case>' are outputs of that case."""
    cases = []
    for src in ("llama", "moe", "gpt-oss"):
        for recipe in RECIPES:
            for layout in layouts_for(recipe):
                if layout == "gpt-oss" and src != "gpt-oss":
                    continue  # gpt-oss quantizes 3-D expert stacks only
                cases.append((f"{src}/{recipe}/{layout}", src, recipe, layout))
    # From quantized sources: every re-layout between the layouts a recipe has, dequantize, re-quantize.
    for recipe in RECIPES:
        layouts = layouts_for(recipe)
        for a in layouts:
            for b in layouts:
                if a != b and "gpt-oss" not in (a, b):
                    cases.append((f"llama/{recipe}/{a}->{b}", f"q:llama/{recipe}/{a}", recipe, b))
            if a != "gpt-oss":
                cases.append((f"llama/{recipe}/{a}->bf16", f"q:llama/{recipe}/{a}", "bf16", ""))
    cases.append(("gpt-oss/mxfp4/gpt-oss->compressed-tensors", "q:gpt-oss/mxfp4/gpt-oss", "mxfp4",
                  "compressed-tensors"))
    cases.append(("gpt-oss/mxfp4/gpt-oss->bf16", "q:gpt-oss/mxfp4/gpt-oss", "bf16", ""))
    cases.append(("moe/nvfp4/modelopt->fp8-block", "q:moe/nvfp4/modelopt", "fp8-block", "fp8"))
    return cases


@pytest.fixture(scope="module")
def all_outputs(tmp_path_factory) -> dict[str, dict[str, str]]:
    import sys

    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("pins")
    sources = {k: str(v) for k, v in make_sources(root / "src").items()}
    digests: dict[str, dict[str, str]] = {}
    for i, (case, src, recipe, layout) in enumerate(conversions()):
        out = root / "out" / str(i)
        if src.startswith("q:") and src[2:] not in sources:
            continue  # its quantized source was refused (pinned as such)
        args = ["quantcli", "convert", sources[src[2:]] if src.startswith("q:") else sources[src], str(out),
                "--recipe", recipe, "--quiet"] + (["--layout", layout] if layout else [])
        old = sys.argv
        sys.argv = args
        try:
            with pytest.raises(SystemExit) as exc:
                main()
        finally:
            sys.argv = old
        code = exc.value.code or 0
        # A refusal is pinned too (e.g. modelopt fp8-block needs whole 128x128 blocks): its exit code.
        digests[case] = {"exit": str(code), **(file_digests(out) if code == 0 else {})}
        if code == 0:
            sources[case] = str(out)
    return digests


def test_outputs_are_byte_identical_to_the_pins(all_outputs):
    if os.environ.get("QUANTCLI_REPIN") == "1":
        PINS.parent.mkdir(exist_ok=True)
        PINS.write_text(json.dumps(all_outputs, indent=1, sort_keys=True) + "\n")
    pinned = json.loads(PINS.read_text())
    assert sorted(all_outputs) == sorted(pinned), "the set of conversions that ran changed"
    changed = [f"{case}: {f}" for case, files in all_outputs.items() for f, h in files.items()
               if pinned[case].get(f) != h]
    changed += [f"{case}: {f} missing" for case, files in pinned.items() for f in files if f not in all_outputs[case]]
    assert not changed, "output bytes changed:\n" + "\n".join(changed)
