"""Hub repo ids read from the standard Hugging Face cache, offline.

The cache is laid out as huggingface_hub lays it out: models--OWNER--NAME/{blobs,refs,snapshots},
blob names are the sha256 of LFS files (safetensors) and the git blob sha1 of small files, every
snapshot file is a relative symlink into blobs/, and refs/BRANCH holds the commit. The first test
checks with huggingface_hub's own scanner and downloader that the layout is what it reads.

huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE into `huggingface_hub.constants` when first
imported and its functions read those module attributes at call time, so in-process tests patch the
attributes (and the environment, which quantcli itself reads); one test sets only the environment
of a fresh process, as a user would."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from faults import assert_nothing_left, assert_one_line_error, tree_state

COMMIT = "0123456789abcdef0123456789abcdef01234567"
COMMIT2 = "89abcdef0123456789abcdef0123456789abcdef"


def blob_name(rel: str, content: bytes) -> str:
    if rel.endswith(".safetensors"):  # stored through LFS: named by the content's sha256
        return hashlib.sha256(content).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()  # git's blob id


def put_in_cache(cache: Path, repo_id: str, files: dict[str, bytes], commit: str,
                 refs: tuple[str, ...] = ("main",)) -> Path:
    owner, name = repo_id.split("/")
    repo = cache / f"models--{owner}--{name}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot = repo / "snapshots" / commit
    for rel, content in files.items():
        blob = repo / "blobs" / blob_name(rel, content)
        blob.write_bytes(content)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))  # as huggingface_hub links them
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def comparable(tree: dict[str, str]) -> dict[str, str]:
    """Output files that do not mention where the source came from."""
    return {k: v for k, v in tree.items() if k not in ("README.md", "quantcli_manifest.json")}


def test_cache_layout_is_what_huggingface_hub_reads(tiny_llama, hub_cache):
    from huggingface_hub import hf_hub_download, scan_cache_dir

    put_in_cache(hub_cache, "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    info = scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert repo.repo_id == "acme/tiny-llama" and revision.commit_hash == COMMIT and revision.refs == {"main"}
    assert revision.nb_files == len(list(tiny_llama.iterdir()))
    shard = Path(hf_hub_download("acme/tiny-llama", "model-00001-of-00002.safetensors"))
    assert shard.is_symlink() and shard.parent.name == COMMIT and shard.resolve().parent.name == "blobs"


def test_sharded_repo_converts_inspects_and_verifies(tiny_llama, hub_cache, tmp_path, run_cli):
    put_in_cache(hub_cache, "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    assert json.loads((tiny_llama / "model.safetensors.index.json").read_text())["weight_map"]  # sharded
    cache_before = tree_state(hub_cache)
    code, _, err = run_cli("convert", "acme/tiny-llama", tmp_path / "hub", "--recipe", "fp8-block", "--quiet")
    assert code == 0, err
    assert run_cli("convert", tiny_llama, tmp_path / "local", "--recipe", "fp8-block", "--quiet")[0] == 0
    assert comparable(tree_state(tmp_path / "hub")) == comparable(tree_state(tmp_path / "local"))
    manifest = json.loads((tmp_path / "hub" / "quantcli_manifest.json").read_text())
    assert manifest["source"]["repo_id"] == "acme/tiny-llama"
    code, out, err = run_cli("inspect", "acme/tiny-llama", "--json")
    assert code == 0, err
    hub_report = json.loads(out)
    local_report = json.loads(run_cli("inspect", tiny_llama, "--json")[1])
    assert hub_report.pop("source") == "acme/tiny-llama" and local_report.pop("source") == str(tiny_llama)
    assert hub_report == local_report
    code, out, err = run_cli("verify", tmp_path / "hub", "--reference", "acme/tiny-llama")
    assert code == 0, out + err
    assert tree_state(hub_cache) == cache_before  # reading never touches the cache


def test_single_file_repo(tiny_llama, hub_cache, tmp_path, run_cli):
    from quantcli.checkpoint.source import open_source
    from quantcli.checkpoint.tensors import CheckpointTensors

    single = tmp_path / "single"
    single.mkdir()
    from quantcli.checkpoint.safetensors_io import write_file

    with CheckpointTensors(open_source(str(tiny_llama))) as t:
        write_file(single / "model.safetensors", {n: t.get(n).clone() for n in t.where})
    (single / "config.json").write_bytes((tiny_llama / "config.json").read_bytes())
    put_in_cache(hub_cache, "acme/one-file", folder_files(single), COMMIT)
    code, _, err = run_cli("convert", "acme/one-file", tmp_path / "o", "--recipe", "fp8", "--quiet")
    assert code == 0, err
    assert not (tmp_path / "o" / "model.safetensors.index.json").exists()
    code, out, err = run_cli("verify", tmp_path / "o", "--reference", "acme/one-file")
    assert code == 0, out + err


def test_revision_selects_a_second_ref(tiny_llama, hub_cache, tmp_path, run_cli):
    files = folder_files(tiny_llama)
    put_in_cache(hub_cache, "acme/tiny-llama", files, COMMIT)
    config = json.loads(files["config.json"])
    files2 = {**files, "config.json": json.dumps({**config, "rope_theta": 1234.0}).encode()}
    put_in_cache(hub_cache, "acme/tiny-llama", files2, COMMIT2, refs=("v2",))
    for revision in ("v2", COMMIT2):
        dst = tmp_path / f"o-{revision[:4]}"
        code, _, err = run_cli("convert", "acme/tiny-llama", dst, "--recipe", "fp8", "--revision", revision, "--quiet")
        assert code == 0, err
        assert json.loads((dst / "config.json").read_text())["rope_theta"] == 1234.0
        assert json.loads((dst / "quantcli_manifest.json").read_text())["source"]["revision"] == revision
    code, _, err = run_cli("convert", "acme/tiny-llama", tmp_path / "main", "--recipe", "fp8", "--quiet")
    assert code == 0 and json.loads((tmp_path / "main" / "config.json").read_text()).get("rope_theta") != 1234.0
    code, out, err = run_cli("inspect", "acme/tiny-llama", "--revision", "v2")
    assert code == 0, err


@pytest.fixture(scope="module")
def tiny_fp8(tiny_llama, tmp_path_factory) -> Path:
    """A quantized checkpoint, for `verify QUANT --reference REPO`."""
    from quantcli.cli.app import main

    dst = tmp_path_factory.mktemp("fp8") / "fp8"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exc:
        mp.setattr(sys, "argv", ["quantcli", "convert", str(tiny_llama), str(dst), "--recipe", "fp8", "--quiet"])
        main()
    assert not exc.value.code
    return dst


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_missing_repo_or_revision_is_one_line(command, tiny_llama, tiny_fp8, hub_cache, tmp_path, run_cli):
    put_in_cache(hub_cache, "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    dst = tmp_path / "o"
    for repo, extra, needle in (("acme/missing", (), "acme/missing"),
                                ("acme/tiny-llama", ("--revision", "nope"), "acme/tiny-llama@nope")):
        args = {"convert": ("convert", repo, dst, "--recipe", "fp8"), "inspect": ("inspect", repo),
                "verify": ("verify", tiny_fp8, "--reference", repo)}[command]
        code, out, err = run_cli(*args, *extra)
        assert_one_line_error(code, out, err, needle, "--revision", f"local Hugging Face cache {hub_cache} ")
        assert_nothing_left(dst)


def test_shard_missing_from_cache_is_one_line(tiny_llama, hub_cache, tmp_path, run_cli):
    snapshot = put_in_cache(hub_cache, "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    code, out, err = run_cli("convert", "acme/tiny-llama", tmp_path / "o", "--recipe", "fp8")
    assert_one_line_error(code, out, err, "acme/tiny-llama", "model-00002-of-00002.safetensors", "HF_HUB_OFFLINE=0",
                          f"local cache {hub_cache}")
    assert_nothing_left(tmp_path / "o")


def test_escaping_index_name_in_cache_still_refused(tiny_llama, hub_cache, tmp_path, run_cli):
    files = folder_files(tiny_llama)
    index = json.loads(files["model.safetensors.index.json"])
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../blobs/" + blob_name("x.safetensors", files["model-00001-of-00002.safetensors"])
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    put_in_cache(hub_cache, "acme/tiny-llama", files, COMMIT)
    for args in (("convert", "acme/tiny-llama", tmp_path / "o", "--recipe", "fp8"), ("inspect", "acme/tiny-llama")):
        code, out, err = run_cli(*args)
        assert_one_line_error(code, out, err, "model.safetensors.index.json", "../../blobs/", "outside")
    assert_nothing_left(tmp_path / "o")


@pytest.mark.slow
def test_fresh_process_reads_the_cache_from_hf_home(tiny_llama, tmp_path):
    """The environment alone, as a user sets it: HF_HOME/hub is the cache, HF_HUB_OFFLINE=1."""
    home = tmp_path / "hf-home"
    put_in_cache(home / "hub", "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    result = subprocess.run([sys.executable, "-m", "quantcli", "inspect", "acme/tiny-llama", "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)


def test_the_manifest_records_the_commit_the_default_branch_resolved_to(tiny_llama, hub_cache, tmp_path, run_cli):
    put_in_cache(hub_cache, "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    code, _, err = run_cli("convert", "acme/tiny-llama", tmp_path / "o", "--recipe", "fp8", "--quiet")
    assert code == 0, err
    source = json.loads((tmp_path / "o" / "quantcli_manifest.json").read_text())["source"]
    assert source["repo_id"] == "acme/tiny-llama" and source["revision"] is None and source["commit"] == COMMIT
