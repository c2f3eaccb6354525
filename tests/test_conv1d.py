"""GPT-2 and kin store attention and MLP weights as transformers' Conv1D, [in, out]: quantizing
them along a Linear's input axis would write garbage that engines read silently, so they stay
dense, named in the exclusion list, and a checkpoint with nothing else is refused before work."""

import pytest

from quantcli.planning.consumer_names import transposed_modules


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2") / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(folder)
    return folder


def test_a_gpt2_is_refused_in_one_line_naming_conv1d(run_cli, gpt2, tmp_path):
    code, _, err = run_cli("convert", str(gpt2), str(tmp_path / "out"), "--recipe", "nvfp4")
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Conv1D" in lines[0], err
    assert not (tmp_path / "out").exists()


def test_without_transformers_the_model_type_names_the_conv1d_modules():
    found = transposed_modules({"model_type": "gpt2"}, None)
    assert found("h.0.attn.c_attn") and found("transformer.h.3.mlp.c_proj") and not found("lm_head")
    assert not transposed_modules({"model_type": "llama"}, None)("model.layers.0.mlp.c_fc")
