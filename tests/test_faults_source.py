"""Fault injection: corrupt or hostile sources (safetensors headers, index and config files, special
files, truncation, duplicate and unindexed tensors, one shard of a sharded checkpoint given as the
whole model). Each must end in one line, exit 2, with the source unchanged and nothing written, for
`convert`, `inspect` and `verify --reference` alike."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import sys
from pathlib import Path

import pytest
import torch
from faults import assert_nothing_left, assert_one_line_error, tree_state

from quantcli.checkpoint.safetensors_io import read_header, write_file
from quantcli.checkpoint.source import open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import CheckpointError

W = "model.layers.0.mlp.down_proj.weight"  # a Linear weight every recipe quantizes
CONFIG = {"model_type": "llama"}  # the least config.json an engine needs (convert refuses a source without)
N = "model.norm.weight"


def good_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {W: torch.randn(64, 64, generator=g).bfloat16(), N: torch.ones(64, dtype=torch.bfloat16)}


def good_entries() -> tuple[dict, bytes]:
    """The header entries and data section of a valid file holding good_tensors(), W first."""
    t = good_tensors()
    w, n = t[W].view(torch.uint8).numpy().tobytes(), t[N].view(torch.uint8).numpy().tobytes()
    header = {W: {"dtype": "BF16", "shape": [64, 64], "data_offsets": [0, len(w)]},
              N: {"dtype": "BF16", "shape": [64], "data_offsets": [len(w), len(w) + len(n)]}}
    return header, w + n


def raw_file(path: Path, header: object, data: bytes = b"") -> Path:
    """A safetensors file written by hand: 8-byte little-endian length, header bytes, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def with_entry(name: str, **fields) -> tuple[dict, bytes]:
    header, data = good_entries()
    header[name] = {**header[name], **fields}
    return header, data


# name -> (header, data, words the one error line must hold besides the file name)
def header_cases() -> dict[str, tuple[object, bytes, tuple[str, ...]]]:
    header, data = good_entries()
    w_bytes = header[W]["data_offsets"][1]
    overlap = dict(header)
    overlap[N] = {**header[N], "data_offsets": [w_bytes - 2, w_bytes - 2 + 128]}
    gap = {W: header[W], N: {**header[N], "data_offsets": [w_bytes + 8, w_bytes + 8 + 128]}}
    return {
        "array": ([1, 2], data, ("JSON list", "corrupt")),
        "number": (7, data, ("JSON int", "corrupt")),
        "string": ("x", data, ("JSON str", "corrupt")),
        "not-json": (b"{not json", data, ("not valid JSON", "corrupt")),
        "not-utf8": (b'{"\xff\xfe": 1}  ', data, ("not UTF-8", "corrupt")),
        "duplicate-key": (json.dumps(header).encode()[:-1] + b', "' + W.encode() + b'": '
                          + json.dumps(header[W]).encode() + b"}", data, ("appears twice", W)),
        "metadata-not-str": ({"__metadata__": {"format": 1}, **header}, data, ("__metadata__",)),
        "entry-not-object": ({**header, N: [1]}, data, (N, "not an object")),
        "unknown-dtype": (*with_entry(N, dtype="F7"), (N, "unknown dtype 'F7'")),
        "dtype-not-string": (*with_entry(N, dtype=None), (N, "dtype None")),
        "complex": (*with_entry(N, dtype="C64", shape=[32]), (N, "C64", "cannot read")),
        "negative-shape": (*with_entry(N, shape=[-64]), (N, "shape [-64]")),
        "shape-not-list": (*with_entry(N, shape="64"), (N, "shape '64'")),
        "offsets-null": (*with_entry(N, data_offsets=None), (N, "data_offsets None")),
        "offsets-negative": (*with_entry(W, data_offsets=[-8, w_bytes - 8]), (W, "data_offsets [-8")),
        "offsets-reversed": (*with_entry(N, data_offsets=[w_bytes + 128, w_bytes]), (N, "begin <= end")),
        "offsets-one": (*with_entry(N, data_offsets=[w_bytes]), (N, "data_offsets")),
        "bytes-mismatch": (*with_entry(N, shape=[32]), (N, "needs 64")),
        "overlap": (overlap, data[:w_bytes - 2] + data[w_bytes:] + b"\0\0", (N, "overlaps", W)),
        "gap": (gap, data[:w_bytes] + bytes(8) + data[w_bytes:], ("belong to no tensor", N)),
        "uncovered-tail": (header, data + bytes(16), ("holds", "cover")),
        "truncated-data": (header, data[:-10], (N, "truncated")),
    }


def file_cases() -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """Files too broken to have a header at all."""
    return {
        "empty": (b"", ("too short",)),
        "short": (b"\x10\x00\x00", ("too short",)),
        "length-past-end": (struct.pack("<Q", 4096) + b"{}", ("header length 4096",)),
        "length-huge": (struct.pack("<Q", 2**63) + b"{}", ("header length",)),
    }


@pytest.fixture(scope="module")
def quant(tmp_path_factory) -> Path:
    """A valid fp8 checkpoint of the good source, for `verify QUANT --reference CORRUPT`."""
    from quantcli.cli.app import main

    root = tmp_path_factory.mktemp("quant")
    src = root / "src"
    src.mkdir()
    write_file(src / "model.safetensors", good_tensors())
    (src / "config.json").write_text(json.dumps(CONFIG))  # convert refuses a source no engine can load
    dst = root / "fp8"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as exc:
        mp.setattr(sys, "argv", ["quantcli", "convert", str(src), str(dst), "--recipe", "fp8", "--quiet"])
        main()
    assert not exc.value.code and (dst / "config.json").exists()
    return dst


def assert_refused_everywhere(run_cli, src: Path, quant: Path, tmp_path: Path, *needles: str) -> None:
    """convert, inspect and verify --reference all refuse SRC with one line; nothing changes."""
    before, quant_before = tree_state(src), tree_state(quant)
    dst = tmp_path / "out"
    commands = [("convert", src, dst, "--recipe", "fp8"), ("inspect", src), ("verify", quant, "--reference", src)]
    for args in commands:
        code, out, err = run_cli(*args)
        assert_one_line_error(code, out, err, *needles)
        assert tree_state(src) == before and tree_state(quant) == quant_before
        assert_nothing_left(dst)


@pytest.mark.parametrize("case", sorted(header_cases()))
def test_corrupt_header_refused(case, quant, tmp_path, run_cli):
    header, data, needles = header_cases()[case]
    src = tmp_path / "src"
    src.mkdir()
    raw_file(src / "model.safetensors", header, data)
    assert_refused_everywhere(run_cli, src, quant, tmp_path, "model.safetensors", *needles)


@pytest.mark.parametrize("case", sorted(file_cases()))
def test_headerless_file_refused(case, quant, tmp_path, run_cli):
    content, needles = file_cases()[case]
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(content)
    assert_refused_everywhere(run_cli, src, quant, tmp_path, "model.safetensors", *needles)


def test_zero_size_tensors_and_metadata_are_valid(tmp_path):
    header, data = good_entries()
    end = header[N]["data_offsets"][1]
    header["empty.a"] = {"dtype": "F32", "shape": [0, 64], "data_offsets": [end, end]}
    header["empty.b"] = {"dtype": "BF16", "shape": [3, 0], "data_offsets": [0, 0]}
    header["__metadata__"] = {"format": "pt"}
    h = read_header(raw_file(tmp_path / "z.safetensors", header, data))
    assert h.tensors["empty.a"].nbytes == 0 and h.tensors["empty.b"].shape == (3, 0)
    assert h.metadata == {"format": "pt"} and h.data_size == len(data)


def sharded(root: Path, index: object | None = None, shards: dict[str, dict[str, torch.Tensor]] | None = None,
            config: object = None) -> Path:
    """A folder with shards (default: W in a.safetensors, N in b.safetensors) and an index."""
    root.mkdir()
    t = good_tensors()
    shards = shards if shards is not None else {"a.safetensors": {W: t[W]}, "b.safetensors": {N: t[N]}}
    for name, tensors in shards.items():
        write_file(root / name, tensors)
    if index is not None:
        text = index if isinstance(index, (str, bytes)) else json.dumps(index)
        (root / "model.safetensors.index.json").write_bytes(text.encode() if isinstance(text, str) else text)
    config = CONFIG if config is None else config  # convert refuses a source without one
    (root / "config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    return root


INDEX = "model.safetensors.index.json"
GOOD_MAP = {W: "a.safetensors", N: "b.safetensors"}


@pytest.mark.parametrize("case,index,config,needles", [
    ("index-array", [GOOD_MAP], None, (INDEX, "JSON list")),
    ("index-string", '"a.safetensors"', None, (INDEX, "JSON str")),
    ("index-not-utf8", b"\xff\xfe{}", None, (INDEX, "not UTF-8")),
    ("index-not-json", "{weight_map:", None, (INDEX, "cannot parse JSON")),
    ("weight-map-list", {"weight_map": [W]}, None, (INDEX, "'weight_map' is a JSON list")),
    ("weight-map-missing", {"metadata": {}}, None, (INDEX, "'weight_map' is missing")),
    ("weight-map-value-int", {"weight_map": {**GOOD_MAP, N: 3}}, None, (INDEX, "3, not a file name")),
    ("name-dotdot", {"weight_map": {**GOOD_MAP, N: "../b.safetensors"}}, None, (INDEX, "'../b.safetensors'")),
    ("name-inner-dotdot", {"weight_map": {**GOOD_MAP, N: "x/../../b.safetensors"}}, None, (INDEX, "outside")),
    ("name-absolute", {"weight_map": {**GOOD_MAP, N: "/etc/b.safetensors"}}, None, (INDEX, "outside")),
    ("name-backslash", {"weight_map": {**GOOD_MAP, N: "..\\b.safetensors"}}, None, (INDEX, "outside")),
    ("name-drive", {"weight_map": {**GOOD_MAP, N: "C:b.safetensors"}}, None, (INDEX, "outside")),
    ("name-empty-part", {"weight_map": {**GOOD_MAP, N: "x//b.safetensors"}}, None, (INDEX, "outside")),
    ("name-empty", {"weight_map": {**GOOD_MAP, N: ""}}, None, (INDEX, "outside")),
    ("index-names-missing-tensor", {"weight_map": {**GOOD_MAP, "ghost.weight": "a.safetensors"}}, None,
     ("'ghost.weight'", "stale")),
    ("config-array", {"weight_map": GOOD_MAP}, [1], ("config.json", "JSON list")),
    ("config-string", {"weight_map": GOOD_MAP}, "llama", ("config.json", "JSON str")),
    ("config-not-utf8", {"weight_map": GOOD_MAP}, b'{"a": "\xff"}', ("config.json", "not UTF-8")),
])
def test_bad_index_or_config_refused(case, index, config, needles, quant, tmp_path, run_cli):
    src = sharded(tmp_path / "src", index, config=config)
    assert_refused_everywhere(run_cli, src, quant, tmp_path, *needles)


def test_same_tensor_in_two_shards_without_index_refused(quant, tmp_path, run_cli):
    t = good_tensors()
    src = sharded(tmp_path / "src", None, {"a.safetensors": t, "b.safetensors": {W: t[W] * 2}})
    assert_refused_everywhere(run_cli, src, quant, tmp_path, repr(W), "a.safetensors", "b.safetensors",
                              "remove the stale copy")


def test_same_tensor_in_two_shards_unindexed_refused(quant, tmp_path, run_cli):
    t = good_tensors()
    src = sharded(tmp_path / "src", {"weight_map": {N: "a.safetensors", "x": "b.safetensors"}},
                  {"a.safetensors": t, "b.safetensors": {W: t[W] * 2, "x": t[N]}})
    assert_refused_everywhere(run_cli, src, quant, tmp_path, repr(W), "a.safetensors", "b.safetensors",
                              "does not list it")


def test_duplicate_assigned_by_index_uses_that_copy_and_warns(tmp_path, run_cli):
    t = good_tensors()
    stale = t[N] * 2
    src = sharded(tmp_path / "src", {"weight_map": {W: "a.safetensors", N: "b.safetensors"}},
                  {"a.safetensors": {W: t[W], N: stale}, "b.safetensors": {N: t[N]}})
    code, _, err = run_cli("convert", src, tmp_path / "o", "--recipe", "fp8", "--quiet")
    assert code == 0, err
    assert f"warning: {N}: also in a.safetensors; using the copy in b.safetensors" in err
    with CheckpointTensors(open_source(str(tmp_path / "o"))) as out:
        assert torch.equal(out.get(N), t[N])  # the index's copy, not the stale one
        assert out.where[N] == "b.safetensors"


def test_tensor_missing_from_index_kept_with_warning(tmp_path, run_cli):
    t = good_tensors()
    extra = torch.arange(8, dtype=torch.float32)
    src = sharded(tmp_path / "src", {"weight_map": GOOD_MAP},
                  {"a.safetensors": {W: t[W], "model.extra": extra}, "b.safetensors": {N: t[N]}})
    code, out, err = run_cli("convert", src, tmp_path / "o", "--recipe", "fp8", "--dry-run")
    assert code == 0 and "missing from model.safetensors.index.json (model.extra)" in out + err
    code, _, err = run_cli("convert", src, tmp_path / "o", "--recipe", "fp8", "--quiet")
    assert code == 0 and "warning: 1 tensor(s) in the shards are missing" in err
    index = json.loads((tmp_path / "o" / INDEX).read_text())
    assert index["weight_map"]["model.extra"] == "a.safetensors"
    with CheckpointTensors(open_source(str(tmp_path / "o"))) as o:
        assert torch.equal(o.get("model.extra"), extra)
    code, out, _ = run_cli("inspect", src)  # inspect shows what opening the source found
    assert code == 0 and "warning: 1 tensor(s) in the shards are missing" in out
    code, out, _ = run_cli("inspect", src, "--json")
    assert any("model.extra" in w for w in json.loads(out)["warnings"])


def _special_shard(kind: str, path: Path):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        return s
    elif kind == "directory":
        path.mkdir()
    elif kind == "device":
        path.symlink_to("/dev/zero")
    return None


@pytest.mark.parametrize("kind,word", [("fifo", "FIFO"), ("socket", "socket"), ("directory", "folder"),
                                       ("device", "device")])
@pytest.mark.parametrize("named_by", ["index", "glob"])
def test_special_file_shard_refused_without_hanging(kind, word, named_by, quant, tmp_path, run_cli):
    src = sharded(tmp_path / "src", {"weight_map": GOOD_MAP} if named_by == "index" else None)
    (src / "b.safetensors").unlink()
    if len(str(src / "b.safetensors")) > 100 and kind == "socket":
        pytest.skip("socket path too long for AF_UNIX")
    held = _special_shard(kind, src / "b.safetensors")
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading a special file hung"))
    signal.alarm(20)
    try:
        assert_refused_everywhere(run_cli, src, quant, tmp_path, "b.safetensors", word, "not a regular file")
    finally:
        signal.alarm(0)
        if held is not None:
            held.close()


def test_special_file_given_as_source_refused(quant, tmp_path, run_cli):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code, out, err = run_cli("inspect", fifo)
    assert_one_line_error(code, out, err, str(fifo), "neither a regular file nor a folder")


def test_config_fifo_refused(quant, tmp_path, run_cli):
    src = sharded(tmp_path / "src", {"weight_map": GOOD_MAP})
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    assert_refused_everywhere(run_cli, src, quant, tmp_path, "config.json", "FIFO")


@pytest.mark.parametrize("change", ["truncate", "grow"])
def test_shard_changed_after_header_read_refused_before_mapping(change, tmp_path):
    """The header was validated against the old size; reading must not fault (SIGBUS) on the
    mapped file if it shrank, and must not read a different file if it grew."""
    src = sharded(tmp_path / "src", {"weight_map": GOOD_MAP})
    source = open_source(str(src))
    shard = src / "a.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        if change == "truncate":
            f.truncate(size - 100)
        else:
            f.seek(0, 2)
            f.write(bytes(64))
    with CheckpointTensors(source) as tensors, pytest.raises(CheckpointError) as exc:
        tensors.get(W)
    message = str(exc.value)
    assert str(shard) in message and "\n" not in message
    assert ("truncated" if change == "truncate" else "changed") in message


def test_truncated_shard_refused_by_verify_before_reading(quant, tmp_path, run_cli):
    """A quantized shard cut short: verify refuses it (it would SIGBUS if it mapped and read it)."""
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in quant.iterdir():
        (cut / f.name).write_bytes(f.read_bytes())
    shard = next(p for p in cut.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    before = tree_state(cut)
    code, out, err = run_cli("verify", cut)
    assert_one_line_error(code, out, err, shard.name, "truncated")
    assert tree_state(cut) == before


# ---------------------------------------------------------------- one shard of a sharded checkpoint


@pytest.fixture(scope="module")
def two_shard_llama(tmp_path_factory) -> Path:
    from quantcli.testing import make_llama

    return make_llama(tmp_path_factory.mktemp("src") / "llama", hidden=64, layers=1, shards=2)


@pytest.fixture(scope="module")
def two_shard_nvfp4(two_shard_llama, tmp_path_factory) -> Path:
    from quantcli.cli.app import main

    out = tmp_path_factory.mktemp("q") / "nvfp4"
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(two_shard_llama), str(out), "--recipe", "nvfp4", "--layout", "compressed-tensors",
              "--quiet"])
    assert not exc.value.code
    return out


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[0]


@pytest.mark.parametrize("command", ["convert", "inspect", "verify"])
def test_one_shard_is_refused(command, two_shard_llama, two_shard_nvfp4, tmp_path, run_cli):
    shard = _shard(two_shard_llama)
    before = tree_state(two_shard_llama)
    dst = tmp_path / "out"
    args = {"convert": ("convert", shard, dst, "--recipe", "nvfp4"), "inspect": ("inspect", shard),
            "verify": ("verify", two_shard_nvfp4, "--reference", shard)}[command]
    code, out, err = run_cli(*args)
    assert_one_line_error(code, out, err, f"{shard}: is one shard of the sharded checkpoint in {two_shard_llama}",
                          "the index lists 2 shards", f"pass the folder {two_shard_llama}")
    assert tree_state(two_shard_llama) == before
    assert_nothing_left(dst)


def test_lone_file_without_index_or_unlisted_still_opens(two_shard_llama, tmp_path, run_cli):
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(_shard(two_shard_llama), lone / "model.safetensors")
    assert run_cli("inspect", lone / "model.safetensors")[0] == 0
    (lone / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x-1.safetensors",
                                                                                  "b": "x-2.safetensors"}}))
    assert run_cli("inspect", lone / "model.safetensors")[0] == 0


def test_two_tensors_on_the_same_bytes_are_both_named(tmp_path):
    """A copied data_offsets (k_proj given v_proj's bytes) also leaves k_proj's own bytes to no
    tensor; the overlap is the fault to name, with both tensors, as safetensors does."""
    g = torch.Generator().manual_seed(0)
    names = [f"model.layers.0.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
    tensors = {n: torch.randn(8, 8, generator=g).bfloat16() for n in names}
    header, data, start = {}, b"", 0
    for n in names:
        raw = tensors[n].view(torch.uint8).numpy().tobytes()
        header[n] = {"dtype": "BF16", "shape": [8, 8], "data_offsets": [start, start + len(raw)]}
        data, start = data + raw, start + len(raw)
    header[names[1]]["data_offsets"] = header[names[2]]["data_offsets"]
    with pytest.raises(CheckpointError) as exc:
        read_header(raw_file(tmp_path / "model.safetensors", header, data))
    message = str(exc.value)
    assert names[1] in message and names[2] in message and "same data_offsets" in message
    assert "belong to no tensor" not in message
