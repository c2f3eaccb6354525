"""Mixed-recipe checkpoints (`[[override]]`) and the layouts that can hold them."""

from pathlib import Path

import pytest
from faults import assert_nothing_left, assert_one_line_error

from quantcli.formats.layouts import layouts_holding
from quantcli.testing import make_llama


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("mix") / "llama", hidden=128, layers=1, shards=1)


@pytest.mark.parametrize("layout, default, override", [("fp8", "mxfp8", "fp8-block"),
                                                       ("modelopt", "nvfp4", "fp8-channel")])
@pytest.mark.parametrize("dry_run", [True, False])
def test_mix_a_layout_cannot_hold_is_refused_before_any_tensor(layout, default, override, dry_run, llama, tmp_path,
                                                               run_cli):
    cfg = tmp_path / "mix.toml"
    cfg.write_text(f'recipe = "{default}"\n[[override]]\npattern = "re:.*self_attn.*"\nrecipe = "{override}"\n')
    args = ["--dry-run"] if dry_run else []
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--config", cfg, "--layout", layout, *args)
    assert_one_line_error(code, out, err, f"--layout {layout} cannot hold the mix", "layouts that can: "
                          "compressed-tensors")
    assert_nothing_left(tmp_path / "o")


def test_layouts_holding():
    assert layouts_holding({"nvfp4"}) == ["modelopt", "compressed-tensors"]
    assert layouts_holding({"nvfp4", "fp8-block"}) == ["compressed-tensors"]
