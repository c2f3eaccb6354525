"""Fault injection for `convert`'s destination handling: staging, --resume, locks, filesystem
faults, refusals that must leave nothing, zero-size tensors and patterns that match nothing.

Every case asserts the exit code, one `error:` line naming the file or option and the fix, no
traceback, the source unchanged, DST and unrelated files unchanged, and, where a run was
interrupted, that --resume gives the same bytes as an uninterrupted run."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import torch
from faults import after_each_shard, assert_nothing_left, assert_one_line_error, run_subprocess, tree_state

import quantcli.convert.shard as shard_mod
from quantcli.checkpoint.safetensors_io import ShardWriter, write_file
from quantcli.convert import LOCK_NAME, PROGRESS_NAME, StagingLock
from quantcli.convert.progress import ProgressFile
from quantcli.errors import CheckpointError
from quantcli.testing import make_llama

RECIPE = "nvfp4"  # fused q/k/v and gate/up groups: the fused-amax pass runs too


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """3 source shards (so a run can be stopped between them)."""
    return make_llama(tmp_path_factory.mktemp("fc") / "llama", hidden=64, layers=1, shards=2)


@pytest.fixture
def src(llama, tmp_path) -> Path:
    """A private copy, for tests that change the source."""
    return Path(shutil.copytree(llama, tmp_path / "src"))


def convert(run_cli, src: Path, dst: Path, *flags: str, recipe: str = RECIPE):
    return run_cli("convert", src, dst, "--recipe", recipe, "--quiet", "--device", "cpu", *flags)


def clean_output(run_cli, src: Path, where: Path) -> dict[str, str]:
    code, _, err = convert(run_cli, src, where)
    assert code == 0, err
    return tree_state(where)


def interrupt_after_shards(run_cli, monkeypatch, src: Path, dst: Path, n: int = 1, *flags: str) -> None:
    """Ctrl-C right after the n-th shard is recorded (exit 130, staging folder kept)."""
    def stop(written: int) -> None:
        if written == n:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        after_each_shard(m, stop)
        code, _, err = convert(run_cli, src, dst, *flags)
    assert code == 130 and "Traceback" not in err, err
    stage = dst.with_name(dst.name + ".partial")
    assert stage.is_dir() and (stage / PROGRESS_NAME).exists() and not (stage / LOCK_NAME).exists()


def stage_of(dst: Path) -> Path:
    return dst.with_name(dst.name + ".partial")


# ------------------------------------------------------------------ --resume never replaces what it did not write


def test_resume_into_unrelated_nonempty_dst_refused(llama, tmp_path, run_cli):
    src_before = tree_state(llama)
    dst = tmp_path / "mine"
    dst.mkdir()
    (dst / "notes.txt").write_text("my files")
    before = tree_state(dst)
    code, out, err = convert(run_cli, llama, dst, "--resume")
    assert_one_line_error(code, out, err, str(dst), "no interrupted run", "delete it yourself")
    assert tree_state(dst) == before and not stage_of(dst).exists()
    assert tree_state(llama) == src_before


def test_resume_on_finished_dst_says_done_and_touches_nothing(llama, tmp_path, run_cli):
    dst = tmp_path / "out"
    done = clean_output(run_cli, llama, dst)
    code, out, err = convert(run_cli, llama, dst, "--resume")
    assert code == 0 and "already complete" in err and out == f"{dst}\n", (out, err)  # --quiet: stdout is the path
    assert tree_state(dst) == done and not stage_of(dst).exists()
    code, out, err = convert(run_cli, llama, dst, "--resume", recipe="fp8")  # another plan: refused
    assert_one_line_error(code, out, err, str(dst), "--overwrite")
    assert tree_state(dst) == done
    code, out, err = convert(run_cli, llama, dst, "--resume", "--overwrite", recipe="fp8")  # ... unless asked
    assert code == 0 and json.loads((dst / "quantcli_manifest.json").read_text())["recipe"] == "fp8", err


def test_resume_with_partial_into_a_folder_quantcli_did_not_write_is_refused(llama, tmp_path, run_cli, monkeypatch):
    dst = tmp_path / "out"
    interrupt_after_shards(run_cli, monkeypatch, llama, dst)
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    stage = tree_state(stage_of(dst))
    for flags in (["--resume"], ["--resume", "--overwrite"]):
        code, out, err = convert(run_cli, llama, dst, *flags)
        assert_one_line_error(code, out, err, str(dst), "quantcli did not write", "keep.txt")
    assert tree_state(dst) == {"keep.txt": tree_state(dst)["keep.txt"]} and tree_state(stage_of(dst)) == stage


# ------------------------------------------------------------------ interruption and --resume


@pytest.mark.parametrize("where", ["writer thread", "main thread"])
def test_ctrl_c_mid_shard_keeps_consistent_staging_and_resume_is_identical(llama, tmp_path, run_cli, monkeypatch,
                                                                           where):
    clean = clean_output(run_cli, llama, tmp_path / "clean")
    dst = tmp_path / "out"
    threads = threading.active_count()
    calls = {"recorded": 0, "n": 0}
    real_write, real_record = ShardWriter.write, ProgressFile.record
    real_produce = shard_mod.produce

    def record(self, *args):
        calls["recorded"] += 1
        return real_record(self, *args)

    def write(self, name, data):  # runs on the background writer thread
        calls["n"] += calls["recorded"] > 0 and where == "writer thread"
        if calls["n"] == 2:  # the second tensor of the second shard
            raise KeyboardInterrupt
        return real_write(self, name, data)

    def produce(*args):  # runs on the main thread while writes are queued
        calls["n"] += calls["recorded"] > 0 and where == "main thread"
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_produce(*args)

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "write", write)
        m.setattr(shard_mod, "produce", produce)
        m.setattr(ProgressFile, "record", record)
        code, _, err = convert(run_cli, llama, dst)
    assert code == 130 and "Traceback" not in err
    assert threading.active_count() == threads  # the writer thread was stopped, not left running
    stage = stage_of(dst)
    names = {p.name for p in stage.iterdir()}
    assert not any(n.endswith(".tmp") for n in names), names  # no half-written shard
    assert LOCK_NAME not in names  # released on the way out
    state = json.loads((stage / PROGRESS_NAME).read_text())
    assert set(state["shards"]) <= names and not dst.exists()
    code, out, err = convert(run_cli, llama, dst, "--resume", "--json")
    assert code == 0, err
    assert json.loads(out)["shards_resumed"] == len(state["shards"]) >= 1
    assert tree_state(dst) == clean and not stage.exists()


def test_resume_after_source_bytes_changed_names_the_shard(src, tmp_path, run_cli, monkeypatch):
    dst = tmp_path / "out"
    interrupt_after_shards(run_cli, monkeypatch, src, dst)
    stage = tree_state(stage_of(dst))
    shard = sorted(src.glob("*.safetensors"))[0]
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40  # tensor bytes change; the header, size and mtime stay the same
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, out, err = convert(run_cli, src, dst, "--resume")
    assert_one_line_error(code, out, err, shard.name, "changed since the interrupted run", "its content",
                          "--overwrite")
    assert tree_state(stage_of(dst)) == stage and not dst.exists()
    code, _, err = convert(run_cli, src, dst, "--overwrite")
    assert code == 0, err
    assert tree_state(dst) == clean_output(run_cli, src, tmp_path / "clean")


@pytest.mark.parametrize("garbage", ["{not json", json.dumps({"fingerprint": 5, "shards": []}),
                                     json.dumps({"fingerprint": "x", "replace_dst": False, "sources": {},
                                                 "shards": {"a": {"size": "big"}}})])
def test_corrupt_progress_file_refused_untouched(llama, tmp_path, run_cli, monkeypatch, garbage):
    dst = tmp_path / "out"
    interrupt_after_shards(run_cli, monkeypatch, llama, dst)
    (stage_of(dst) / PROGRESS_NAME).write_text(garbage)
    stage = tree_state(stage_of(dst))
    code, out, err = convert(run_cli, llama, dst, "--resume")
    assert_one_line_error(code, out, err, PROGRESS_NAME, "corrupt", "--overwrite")
    assert tree_state(stage_of(dst)) == stage and not dst.exists()


def test_stage_without_progress_file_is_not_resumed(llama, tmp_path, run_cli):
    dst = tmp_path / "out"
    stage_of(dst).mkdir()
    (stage_of(dst) / "someones.txt").write_text("x")
    for flags in (["--resume"], ["--overwrite"], ["--resume", "--overwrite"]):  # not quantcli's: never emptied
        code, out, err = convert(run_cli, llama, dst, *flags)
        assert_one_line_error(code, out, err, str(stage_of(dst)), "quantcli did not write", "someones.txt",
                              "delete it yourself")
        assert (stage_of(dst) / "someones.txt").read_text() == "x" and not dst.exists()


# ------------------------------------------------------------------ one run at a time


def write_lock(stage: Path, pid: int, host: str | None = None) -> None:
    stage.mkdir(exist_ok=True)
    (stage / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "token": "t"}))


def test_live_lock_refuses_every_mode_and_dead_lock_is_taken_over(llama, tmp_path, run_cli, monkeypatch):
    clean = clean_output(run_cli, llama, tmp_path / "clean")
    dst = tmp_path / "out"
    interrupt_after_shards(run_cli, monkeypatch, llama, dst)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        write_lock(stage_of(dst), sleeper.pid)
        stage = tree_state(stage_of(dst))
        for flags in ((), ("--resume",), ("--overwrite",)):
            code, out, err = convert(run_cli, llama, dst, *flags)
            assert_one_line_error(code, out, err, f"pid {sleeper.pid}", str(dst))
            assert tree_state(stage_of(dst)) == stage and not dst.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    # The pid is gone now: the lock is stale and --resume takes it over.
    code, out, err = convert(run_cli, llama, dst, "--resume", "--json")
    assert code == 0 and json.loads(out)["shards_resumed"] == 1, err
    assert tree_state(dst) == clean and not stage_of(dst).exists()


def test_lock_from_another_host_is_respected(llama, tmp_path, run_cli, monkeypatch):
    dst = tmp_path / "out"
    interrupt_after_shards(run_cli, monkeypatch, llama, dst)
    write_lock(stage_of(dst), 4242, host="elsewhere.example")
    code, out, err = convert(run_cli, llama, dst, "--resume")
    assert_one_line_error(code, out, err, "pid 4242 on elsewhere.example", "delete")


def test_lock_is_exclusive_and_stale_takeover_is_atomic(tmp_path):
    stage = tmp_path / "x.partial"
    stage.mkdir()
    first, second = StagingLock(stage), StagingLock(stage)
    first.acquire(tmp_path / "x")
    with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):
        second.acquire(tmp_path / "x")
    first.release()
    assert not (stage / LOCK_NAME).exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_lock(stage, dead.pid)
    second.acquire(tmp_path / "x")  # stale: taken over
    assert json.loads((stage / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert [p.name for p in stage.iterdir()] == [LOCK_NAME]  # the moved stale lock is gone
    second.release()


# ------------------------------------------------------------------ destinations refused before any work


def test_destination_refusals_write_nothing(llama, tmp_path, run_cli, monkeypatch):
    src_before = tree_state(llama)
    target = tmp_path / "target"
    target.mkdir()
    (target / "precious.txt").write_text("keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    to_src = tmp_path / "to-src"
    to_src.symlink_to(llama)
    a_file = tmp_path / "file"
    a_file.write_text("a file")
    blocked = tmp_path / "blocked"
    stage_of(blocked).write_text("a file where the staging folder goes")
    cases = [
        ((link, "--overwrite"), (str(link), "symbolic link", str(target))),
        ((link,), (str(link), "symbolic link")),
        ((to_src, "--overwrite"), (str(to_src), "symbolic link")),
        ((a_file / "out",), (str(a_file), "not a folder")),
        ((blocked,), (str(stage_of(blocked)), "not a folder")),
    ]
    before = tree_state(tmp_path)
    for (dst, *flags), needles in cases:
        code, out, err = convert(run_cli, llama, dst, *flags)
        assert_one_line_error(code, out, err, *needles)
        assert tree_state(tmp_path) == before, dst
    assert tree_state(llama) == src_before
    # A folder we may not write in (root ignores modes, so the check itself is made to fail).
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == ro else real_access(p, mode, **kw))
    code, out, err = convert(run_cli, llama, ro / "sub" / "out")
    assert_one_line_error(code, out, err, str(ro), "permission denied")
    assert list(ro.iterdir()) == []


def test_overwrite_replaces_dst_and_missing_parents_are_created(llama, tmp_path, run_cli):
    clean = clean_output(run_cli, llama, tmp_path / "clean")
    dst = tmp_path / "old"
    assert convert(run_cli, llama, dst, recipe="fp8")[0] == 0  # an earlier quantcli output: --overwrite replaces it
    (tmp_path / "neighbour.txt").write_text("n")
    code, _, err = convert(run_cli, llama, dst, "--overwrite")
    assert code == 0, err
    assert tree_state(dst) == clean and (tmp_path / "neighbour.txt").read_text() == "n"
    assert not any(p.name.startswith("old.") for p in tmp_path.iterdir())  # no .partial, no set-aside copy
    deep = tmp_path / "a" / "b" / "out"
    assert convert(run_cli, llama, deep)[0] == 0 and tree_state(deep) == clean


def test_crash_inside_the_final_swap_leaves_both_and_resume_finishes(llama, tmp_path, run_cli, monkeypatch):
    clean = clean_output(run_cli, llama, tmp_path / "clean")
    dst = tmp_path / "out"
    assert convert(run_cli, llama, dst, recipe="fp8")[0] == 0  # an earlier quantcli output: --overwrite replaces it
    old = tree_state(dst)
    real_rename = os.rename
    calls = []

    def rename(a, b):
        calls.append((a, b))
        if Path(a) == stage_of(dst):  # old DST already set aside, new one not yet in
            raise KeyboardInterrupt
        return real_rename(a, b)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", rename)
        code, _, err = convert(run_cli, llama, dst, "--overwrite")
    assert code == 130
    aside = tmp_path / "out.quantcli-replaced"
    assert not dst.exists() and tree_state(aside) == old  # nothing lost
    assert tree_state(stage_of(dst)) == clean
    code, out, err = convert(run_cli, llama, dst)
    assert_one_line_error(code, out, err, str(aside), "--resume")
    code, _, err = convert(run_cli, llama, dst, "--resume")
    assert code == 0, err
    assert tree_state(dst) == clean and not aside.exists() and not stage_of(dst).exists()


# ------------------------------------------------------------------ filesystem faults while writing


@pytest.mark.parametrize("code_, words", [(errno.ENOSPC, "disk full"), (errno.EACCES, "permission denied"),
                                          (errno.EFBIG, "file size limit")])
def test_write_fault_is_one_line_and_resume_continues(llama, tmp_path, run_cli, monkeypatch, code_, words):
    clean = clean_output(run_cli, llama, tmp_path / "clean")
    dst = tmp_path / "out"
    calls = {"n": 0}
    real_emit = ShardWriter._emit

    def emit(self, data):
        calls["n"] += 1
        if calls["n"] == 20:  # a data write inside a later shard, on the writer thread
            raise OSError(code_, os.strerror(code_))
        return real_emit(self, data)

    with monkeypatch.context() as m:
        m.setattr(ShardWriter, "_emit", emit)
        code, out, err = convert(run_cli, llama, dst)
    line = assert_one_line_error(code, out, err, words, ".safetensors", "--resume", str(stage_of(dst)))
    assert str(stage_of(dst)) in line
    stage = stage_of(dst)
    assert stage.is_dir() and not dst.exists() and not any(p.name.endswith(".tmp") for p in stage.iterdir())
    code, _, err = convert(run_cli, llama, dst, "--resume")
    assert code == 0, err
    assert tree_state(dst) == clean


@pytest.mark.slow
def test_file_size_limit_in_a_real_process(llama, tmp_path, run_cli):
    """RLIMIT_FSIZE: writes past it fail with EFBIG (Python starts with SIGXFSZ ignored, so the
    process is not killed); the run says so in one line and --resume finishes the job."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    clean = clean_output(run_cli, llama, tmp_path / "clean")
    dst = tmp_path / "out"
    limit = 24 * 1024  # above the small JSON files, below a shard

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = run_subprocess("convert", llama, dst, "--recipe", RECIPE, "--quiet", "--device", "cpu", preexec_fn=cap)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "file size limit", ".safetensors", "--resume")
    assert stage_of(dst).is_dir() and not dst.exists()
    code, _, err = convert(run_cli, llama, dst, "--resume")
    assert code == 0, err
    assert tree_state(dst) == clean


# ------------------------------------------------------------------ refusals found while converting leave nothing


def write_source(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir()
    write_file(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1}))
    return folder


def test_nan_in_fused_group_names_tensor_and_leaves_nothing(tmp_path, run_cli):
    g = torch.Generator().manual_seed(0)
    bad = torch.randn(64, 64, generator=g)
    bad[3, 5] = float("nan")
    src = write_source(tmp_path / "nan", {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16(),
        "model.layers.0.self_attn.k_proj.weight": bad.bfloat16(),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(64, 64, generator=g).bfloat16()})
    before = tree_state(src)
    dst = tmp_path / "new" / "parents" / "out"
    for recipe in ("nvfp4", "fp8"):  # fused-amax pass, and the per-tensor pass
        code, out, err = convert(run_cli, src, dst, recipe=recipe)
        assert_one_line_error(code, out, err, "model.layers.0.self_attn.k_proj.weight", "NaN", "--ignore")
        assert_nothing_left(dst)
        assert not (tmp_path / "new").exists()  # the parents it created are gone too
    assert tree_state(src) == before


def test_triton_without_cuda_and_cuda_device_refused_up_front(llama, tmp_path, run_cli, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dst = tmp_path / "out"
    code, out, err = run_cli("convert", llama, dst, "--recipe", RECIPE, "--backend", "triton", "--quiet")
    assert_one_line_error(code, out, err, "--backend triton", "--backend torch")
    assert_nothing_left(dst)
    code, out, err = run_cli("convert", llama, dst, "--recipe", RECIPE, "--device", "cuda", "--quiet")
    assert_one_line_error(code, out, err, "--device cuda", "--device cpu")
    assert_nothing_left(dst)


# ------------------------------------------------------------------ the plan: empty tensors,
#                                                                    patterns that match nothing


@pytest.mark.parametrize("recipe", ["fp8", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4"])
def test_zero_size_linear_passes_through_as_excluded(tmp_path, run_cli, recipe):
    src = write_source(tmp_path / "zero", {
        "model.layers.0.mlp.down_proj.weight": torch.zeros(64, 0, dtype=torch.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": torch.zeros(0, 64, dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(0, 64, 128, dtype=torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(64, 64).bfloat16()})
    code, out, err = convert(run_cli, src, tmp_path / "o", "--dry-run", "--json", recipe=recipe)
    assert code == 0, err
    excluded = {e["module"]: e["reason"] for e in json.loads(out)["excluded"]}
    assert excluded["model.layers.0.mlp.down_proj"] == excluded["model.layers.0.mlp.gate_proj"] == "empty tensor"
    code, _, err = convert(run_cli, src, tmp_path / "o", recipe=recipe)
    assert code == 0, err
    from quantcli.checkpoint.source import open_source

    out_tensors = open_source(str(tmp_path / "o")).headers["model.safetensors"].tensors
    assert out_tensors["model.layers.0.mlp.down_proj.weight"].shape == (64, 0)
    assert out_tensors["model.layers.0.mlp.experts.gate_up_proj"].shape == (0, 64, 128)


def test_pattern_that_matches_nothing_is_a_warning(llama, tmp_path, run_cli):
    cfg = tmp_path / "r.toml"
    cfg.write_text('recipe = "fp8"\ntargets = ["*proj"]\n[[override]]\npattern = "*nothing_here*"\n'
                   'recipe = "fp8-block"\n')
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--config", cfg, "--ignore", "*q_porj", "--quiet")
    assert code == 0, err
    assert "'*q_porj' matches no Linear or expert module" in err and "'*nothing_here*'" in err
    assert "'*proj'" not in err  # a pattern that does match says nothing


@pytest.mark.parametrize("dst,needle", [(".", "not a new one"), ("..", "not a new one"), ("/", "root")])
def test_dst_without_a_name_is_refused(src, tmp_path, run_cli, monkeypatch, dst, needle):
    # '.', '..' and '/' have no name to put '.partial' beside: refused before anything is read
    work = tmp_path / "cwd" / "inner"
    work.mkdir(parents=True)
    (work / "mine.txt").write_text("keep")
    monkeypatch.chdir(work)
    before = tree_state(tmp_path)
    code, out, err = run_cli("convert", src, dst, "--recipe", RECIPE)
    assert_one_line_error(code, out, err, needle)
    assert tree_state(tmp_path) == before


def test_fused_group_with_a_dense_member_is_left_dense_whole(llama, tmp_path, run_cli):
    # vLLM refuses a fused qkv layer whose parts differ in precision: never write one
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--recipe", "nvfp4", "--ignore",
                             "model.layers.0.self_attn.q_proj", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    excluded = {e["module"]: e["reason"] for e in doc["excluded"]}
    for member in ("k_proj", "v_proj"):
        assert excluded[f"model.layers.0.self_attn.{member}"] == "fused with q_proj, which stay dense"
    assert any("left dense as a whole" in w for w in doc["warnings"])


def test_fused_group_given_two_recipes_is_refused(llama, tmp_path, run_cli):
    cfg = tmp_path / "r.toml"
    cfg.write_text('recipe = "nvfp4"\n[[override]]\npattern = "re:.*q_proj$"\nrecipe = "fp8-block"\n')
    before = tree_state(llama)
    code, out, err = run_cli("convert", llama, tmp_path / "o", "--config", cfg, "--layout", "compressed-tensors")
    assert_one_line_error(code, out, err, "q_proj,k_proj,v_proj", "one precision", "fp8-block, nvfp4")
    assert tree_state(llama) == before
    assert_nothing_left(tmp_path / "o")


def test_regex_pattern_that_matches_nothing_gets_no_name_hint(one_shard_moe, tmp_path, run_cli):
    code, out, err = run_cli("convert", str(one_shard_moe), str(tmp_path / "o"), "--recipe", "nvfp4", "--ignore",
                             "re:.*nothing$", "--dry-run", "--json")
    warnings = " ".join(json.loads(out)["warnings"])
    assert code == 0 and "matches no Linear" in warnings and "closest module name" not in warnings
    code, out, err = run_cli("convert", str(one_shard_moe), str(tmp_path / "o"), "--recipe", "nvfp4", "--ignore",
                             "q_prj", "--dry-run", "--json")
    assert code == 0 and "closest module name" in " ".join(json.loads(out)["warnings"])


def test_resume_after_a_copy_that_changed_only_the_time_says_how_to_restore_it(src, tmp_path, run_cli, monkeypatch):
    dst = tmp_path / "out"
    interrupt_after_shards(run_cli, monkeypatch, src, dst)
    shard = sorted(src.glob("*.safetensors"))[0]
    was = shard.stat().st_mtime_ns
    os.utime(shard, ns=(was, was + 5 * 10**9))  # copied again without keeping its time
    code, out, err = convert(run_cli, src, dst, "--resume")
    assert_one_line_error(code, out, err, shard.name, "only its modification time", "--overwrite")
    stamp = re.search(r"touch -d @(\d+)\.(\d{9}) FILE", err)
    assert stamp is not None, err
    os.utime(shard, ns=(was, int(stamp[1]) * 10**9 + int(stamp[2])))  # what `touch -d @S.N` does
    code, _, err = convert(run_cli, src, dst, "--resume")
    assert code == 0, err
    assert tree_state(dst) == clean_output(run_cli, src, tmp_path / "clean")
