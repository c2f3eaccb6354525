"""The Hub side: `quantcli push` and `convert --push-to-hub` (huggingface_hub's HfApi methods
replaced by recorders, no network), and the model card (huggingface_hub's ModelCard) every
conversion writes: base_model, tags, title, serving commands, no local paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from faults import assert_one_line_error
from huggingface_hub import HfApi, ModelCard
from test_json_schema import validate

from quantcli.formats.engines import TABLE, loads_in
from quantcli.testing import make_llama

REPO = "me/llama-nvfp4"


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    src = make_llama(tmp_path_factory.mktemp("push") / "llama", hidden=64, layers=1, shards=1)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": "meta-llama/Llama-3.2-1B"}))
    return src


@pytest.fixture
def nvfp4(llama, tmp_path, run_cli) -> Path:
    dst = tmp_path / "llama-nvfp4"
    code, _, err = run_cli("convert", llama, dst, "--recipe", "nvfp4", "--quiet")
    assert code == 0, err
    return dst


@pytest.fixture
def hub(monkeypatch):
    """HfApi's methods record their calls; a token is set, offline mode is off."""
    calls: list[tuple[str, dict]] = []

    def recorder(name, result=None):
        def method(self, *args, **kwargs):
            folder = kwargs.get("folder_path")
            if folder is not None:  # what the folder held when it was uploaded
                kwargs["_seen"] = {"manifest": (Path(folder) / "quantcli_manifest.json").is_file(),
                                   "readme": (Path(folder) / "README.md").read_text()}
            calls.append((name, dict(kwargs, _args=args)))
            return result
        return method

    monkeypatch.setattr(HfApi, "whoami", recorder("whoami", {"name": "me"}))
    monkeypatch.setattr(HfApi, "create_repo", recorder("create_repo", SimpleNamespace(repo_id=REPO)))
    monkeypatch.setattr(HfApi, "create_branch", recorder("create_branch"))
    monkeypatch.setattr(HfApi, "upload_folder", recorder("upload_folder", SimpleNamespace(oid="c0ffee")))
    monkeypatch.setattr(HfApi, "upload_large_folder", recorder("upload_large_folder"), raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def names(calls) -> list[str]:
    return [name for name, _ in calls]


# ---------------------------------------------------------------- push


def test_push_creates_the_repo_and_branch_then_uploads_the_verified_folder(nvfp4, hub, run_cli):
    code, out, err = run_cli("push", nvfp4, REPO, "--private", "--revision", "v1", "--json")
    assert code == 0, err
    assert names(hub) == ["whoami", "create_repo", "create_branch", "upload_folder"]
    create, branch, upload = (kw for _, kw in hub[1:])
    assert create["_args"] == (REPO,) and create["private"] is True and create["exist_ok"] is True
    assert branch["branch"] == "v1" and upload["revision"] == "v1" and upload["repo_id"] == REPO
    assert Path(upload["folder_path"]) == nvfp4 and upload["_seen"]["manifest"]
    # the card's serving commands name the repo, not a placeholder or a local path
    assert f"vllm serve {REPO}\n" in upload["_seen"]["readme"] and "MODEL" not in upload["_seen"]["readme"]
    doc = validate("push", json.loads(out))
    assert doc["source"] == str(nvfp4) and doc["destination"] == REPO
    assert doc["pushed"] == {"repo_id": REPO, "revision": "v1", "private": True, "url": f"https://huggingface.co/{REPO}/tree/v1",
                             "commit": "c0ffee", "files": doc["pushed"]["files"], "bytes": doc["pushed"]["bytes"],
                             "method": "upload_folder"}
    assert doc["pushed"]["files"] == sum(1 for p in nvfp4.rglob("*") if p.is_file())


def test_large_folders_use_the_resumable_large_folder_upload(nvfp4, hub, run_cli, monkeypatch):
    monkeypatch.setattr("quantcli.cli.push.LARGE_FOLDER_BYTES", 0)
    code, out, err = run_cli("push", nvfp4, REPO)
    assert code == 0 and out.strip() == f"https://huggingface.co/{REPO}", err
    assert names(hub) == ["whoami", "create_repo", "upload_large_folder"]
    assert hub[-1][1]["repo_type"] == "model" and hub[-1][1]["private"] is False


def test_convert_push_to_hub_uploads_after_the_output_is_complete(llama, hub, run_cli, tmp_path):
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", llama, dst, "--recipe", "fp8", "--push-to-hub", REPO, "--push-revision",
                             "fp8", "--json")
    assert code == 0, err
    assert names(hub) == ["whoami", "create_repo", "create_branch", "upload_folder"]
    assert hub[-1][1]["_seen"]["manifest"] and not dst.with_name("out.partial").exists()
    doc = validate("convert", json.loads(out))
    assert doc["pushed"]["repo_id"] == REPO and doc["pushed"]["revision"] == "fp8"


@pytest.mark.parametrize("case", ["offline", "no token", "unreachable", "refused"])
def test_convert_push_refusals_come_before_any_work(llama, hub, run_cli, tmp_path, monkeypatch, case):
    from huggingface_hub.errors import HfHubHTTPError

    # the transport error of the HTTP client this huggingface_hub uses (httpx2, httpx or requests)
    client = next((m for m in ("httpx2", "httpx", "requests") if __import__("importlib").util.find_spec(m)), None)
    connect_error = getattr(__import__(client), "ConnectError", None) or getattr(__import__(client), "ConnectionError")

    needle = {"offline": "HF_HUB_OFFLINE", "no token": "hf auth login", "unreachable": "cannot reach",
              "refused": "token was refused"}[case]
    if case == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    elif case == "no token":
        monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    else:
        error = (connect_error("no route to host") if case == "unreachable" else
                 HfHubHTTPError("401 Unauthorized", response=SimpleNamespace(status_code=401, headers={},
                                                                                    request=None)))

        def fail(self, *a, **k):
            raise error
        monkeypatch.setattr(HfApi, "whoami", fail)
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", llama, dst, "--recipe", "fp8", "--push-to-hub", REPO)
    assert_one_line_error(code, out, err, REPO, needle)
    assert not dst.exists() and not dst.with_name("out.partial").exists()
    assert "upload_folder" not in names(hub) and "create_repo" not in names(hub)


def test_push_refuses_unfinished_unverified_or_misnamed_outputs(nvfp4, hub, run_cli, tmp_path):
    stage = tmp_path / "x.partial"
    shutil.copytree(nvfp4, stage)
    assert_one_line_error(*run_cli("push", stage, REPO), "x.partial", "--resume")
    (nvfp4.with_name(nvfp4.name + ".partial")).mkdir()
    assert_one_line_error(*run_cli("push", nvfp4, REPO), "llama-nvfp4.partial", "--resume")
    (nvfp4.with_name(nvfp4.name + ".partial")).rmdir()
    bare = tmp_path / "bare"
    shutil.copytree(nvfp4, bare)
    (bare / "quantcli_manifest.json").unlink()
    assert_one_line_error(*run_cli("push", bare, REPO), "quantcli_manifest.json")
    assert_one_line_error(*run_cli("push", nvfp4, "not a repo"), "OWNER/NAME")
    assert hub == []  # nothing reached the Hub
    manifest = json.loads((nvfp4 / "quantcli_manifest.json").read_text())
    manifest["modules"][0]["tensors"][0]["dtype"] = "F32"  # disagrees with the header: verify fails
    (nvfp4 / "quantcli_manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(*run_cli("push", nvfp4, REPO), "verify found", "quantcli verify")
    assert "upload_folder" not in names(hub)


def test_push_to_hub_with_dry_run_is_refused(llama, run_cli, tmp_path):
    assert_one_line_error(*run_cli("convert", llama, tmp_path / "o", "--recipe", "fp8", "--dry-run",
                                   "--push-to-hub", REPO), "--dry-run")


# ---------------------------------------------------------------- the model card


def test_card_metadata_title_table_and_serving_commands(nvfp4, tmp_path):
    text = (nvfp4 / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.base_model == "meta-llama/Llama-3.2-1B" and card.data.base_model_relation == "quantized"
    assert card.data.library_name == "transformers"
    assert {"quantcli", "quantized", "nvfp4", "modelopt"} <= set(card.data.tags)
    assert card.text.lstrip().startswith("# Llama-3.2-1B (NVFP4, quantized with quantcli)\n")
    assert "| nvfp4 | 7 | - | quantized |" in text and "`lm_head`" in text
    assert "vllm serve MODEL\n" in text and "--model-path MODEL --quantization modelopt_fp4\n" in text
    assert str(tmp_path) not in text and "/tmp" not in text  # no absolute local path


def test_card_base_model_only_from_a_hub_id_and_the_source_card_is_kept(llama, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "_name_or_path": str(tmp_path / "local" / "model")}))
    (src / "README.md").write_text("---\nlicense: mit\nbase_model: other/parent\ntags:\n- chat\n---\n\n"
                                   "# Mine\n\nHello.\n")
    code, _, err = run_cli("convert", src, tmp_path / "out", "--recipe", "fp8-block", "--quiet")
    assert code == 0, err
    card = ModelCard((tmp_path / "out" / "README.md").read_text())
    # the source fine-tuned other/parent: that is not what this output quantizes, and no id names the source
    assert card.data.get("base_model") is None and card.data.get("base_model_relation") is None
    assert card.data.license == "mit" and card.data.tags[:1] == ["chat"] and "fp8" in card.data.tags
    assert "# Mine\n\nHello." in card.text and "# src (FP8-BLOCK, quantized with quantcli)" in card.text
    assert "--quantization" not in card.text  # SGLang reads the fp8 config itself


def test_second_conversion_replaces_title_tags_and_keeps_the_base(nvfp4, tmp_path, run_cli):
    code, _, err = run_cli("convert", nvfp4, tmp_path / "ct", "--layout", "compressed-tensors", "--quiet")
    assert code == 0, err
    text = (tmp_path / "ct" / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.base_model == "meta-llama/Llama-3.2-1B" and card.data.base_model_relation == "quantized"
    assert "modelopt" not in card.data.tags and card.data.tags.count("quantcli") == 1
    assert text.count("quantized with quantcli)") == 1 and text.count("## Quantization (quantcli)") == 1
    assert "carried over byte for byte" in text and "--quantization" not in text


def test_second_conversion_replaces_the_card(nvfp4, tmp_path, run_cli):
    src = tmp_path / "src"
    shutil.copytree(nvfp4, src)
    (src / "README.md").write_text((nvfp4 / "README.md").read_text() + "\n## License\n\nMIT\n")
    out = tmp_path / "out"
    code, _, err = run_cli("convert", src, out, "--recipe", "fp8-block", "--quiet")
    assert code == 0, err
    text = (out / "README.md").read_text()
    assert text.count("## Quantization (quantcli)") == 1, text
    assert "fp8-block" in text and text.rstrip().endswith("MIT")


def test_card_section_replaced_up_to_next_heading():
    from quantcli.convert.model_card import with_model_card

    card = "\n## Quantization (quantcli)\n\nnew\n"
    assert with_model_card("# M\n\nhi", card) == "# M\n\nhi\n" + card
    old = "# M\n\n## Quantization (quantcli)\n\nold\n\n## License\nMIT\n"
    assert with_model_card(old, card) == "# M\n" + card + "\n## License\nMIT\n"


def test_every_recipe_layout_pair_has_its_engines():
    from quantcli.formats.layouts import layouts_for
    from quantcli.recipes import RECIPES

    pairs = {(r, layout) for r in RECIPES for layout in layouts_for(r)}
    assert pairs == set(TABLE) and all(loads_in(*p) for p in pairs)


# ---------------------------------------------------------------- scripts/make_checkpoint.py


def test_make_checkpoint_writes_exactly_the_shards_asked_also_over_an_earlier_run(tmp_path, monkeypatch, capsys):
    import runpy
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "make_checkpoint.py"
    out = tmp_path / "ck"
    for shards in (5, 4):
        monkeypatch.setattr(sys, "argv", [str(script), str(out), "--shards", str(shards), "--hidden", "64",
                                          "--layers", "1"])
        runpy.run_path(str(script), run_name="__main__")
        files = sorted(p.name for p in out.glob("*.safetensors"))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert files == [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        assert sorted(set(index["weight_map"].values())) == files


# ---------------------------------------------------------------- push options as `hf upload` has them (item 16)


def test_push_takes_token_commit_message_pull_request_and_repo_type(nvfp4, hub, run_cli, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")  # the --token is the only one
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    tokens = []
    real_init = HfApi.__init__
    monkeypatch.setattr(HfApi, "__init__", lambda self, *a, **kw: (tokens.append(kw.get("token")),
                                                                     real_init(self, *a, **kw))[1])
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: (hub.append(("upload_folder", kw)), SimpleNamespace(
        oid="c0ffee", pr_url=f"https://huggingface.co/datasets/{REPO}/discussions/1"))[1])
    monkeypatch.setattr("quantcli.cli.push.LARGE_FOLDER_BYTES", 0)  # a PR or a message: one commit all the same
    code, out, err = run_cli("push", nvfp4, REPO, "--token", "hf_given", "--commit-message", "NVFP4 weights",
                             "--create-pr", "--repo-type", "dataset")
    assert code == 0, err
    assert tokens == ["hf_given"] and names(hub) == ["whoami", "create_repo", "upload_folder"]
    create, upload = hub[1][1], hub[2][1]
    assert create["repo_type"] == "dataset" and upload["repo_type"] == "dataset"
    assert upload["commit_message"] == "NVFP4 weights" and upload["create_pr"] is True
    assert out.strip() == f"https://huggingface.co/datasets/{REPO}/discussions/1"


def test_push_refuses_a_space_repo_type(nvfp4, hub, run_cli):
    assert_one_line_error(*run_cli("push", nvfp4, REPO, "--repo-type", "space"), "--repo-type space", "model")


def test_push_given_in_hf_upload_order_reads_it_the_push_way(nvfp4, hub, run_cli):
    code, out, err = run_cli("push", REPO, nvfp4)
    assert code == 0 and "warning: push takes DST first" in err, err
    assert hub[-1][1]["repo_id"] == REPO and Path(hub[-1][1]["folder_path"]) == nvfp4
