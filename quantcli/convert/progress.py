"""The resume record: the plan's fingerprint, what each source shard was, and each finished
output shard's result, so --resume reuses only shards made from the same bytes and rebuilds the
same manifest from their recorded results."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from quantcli import __version__
from quantcli.atomic import write_atomic
from quantcli.checkpoint.source import Source
from quantcli.convert.records import ShardResult
from quantcli.errors import CheckpointError
from quantcli.model.samples import data_digest
from quantcli.planning.plan import Plan

PROGRESS_NAME = ".quantcli-progress.json"
SAMPLE_WINDOWS = 8  # the cheap source hash: header + this many 64 KiB windows spread over the file
SAMPLE_BYTES = 1 << 16


def fingerprint(plan: Plan) -> str:
    """Identifies (source headers and sizes, recipe choices, layout, quantcli version)."""
    h = hashlib.sha256()
    h.update(__version__.encode())
    h.update(plan.target.encode())
    for t in plan.tensors:
        h.update(f"{t.name}|{t.shard}|{t.dtype}|{t.shape}|{t.recipe}|{t.transpose}|{t.fused_group}|{t.action}|"
                 f"{t.source_recipe}".encode())
    for name, r in sorted(plan.recipes.items()):
        h.update(f"{name}:{r.scale_rule}".encode())
        if r.scale_search != "none":  # only then: absmax fingerprints (and manifests) keep their bytes
            h.update(f"{name}:search={r.scale_search}".encode())
    opts = plan.options
    if opts.calibration is not None:  # the data's bytes count, not only its name
        c = opts.calibration
        h.update(f"calibration|{opts.activations}|{opts.kv_cache}|{c.samples}|{c.seq_len}|{c.batch}".encode())
        h.update(data_digest(c).encode())
    if opts.rounding.data_aware:  # only then: round-to-nearest fingerprints keep their bytes
        h.update(f"rounding|{opts.rounding.fingerprint()}".encode())
    if plan.transforms:  # likewise: plans without a transform keep their fingerprints
        h.update(f"transforms|{opts.rotate}|{sorted((n, op.part, op.head) for n, op in plan.transforms.items())}"
                 .encode())
    if opts.auto_choice is not None:  # --auto: candidates, budget and choice (planning/auto.py)
        h.update(opts.auto_choice.identity().encode())
    for shard in plan.source.shards:
        header = plan.source.headers[shard]
        h.update(json.dumps({n: [i.start, i.end] for n, i in sorted(header.tensors.items())}).encode())
    return h.hexdigest()


# --- what each source shard was, so --resume never reuses shards made from other bytes


def source_identity(source: Source) -> dict[str, dict]:
    """Per local source shard: size, mtime_ns and a sampled content hash. Hub sources: none (a
    commit's files do not change, and hashing would download every shard up front)."""
    if source.repo_id is not None:
        return {}
    return {shard: shard_identity(source.root / shard) for shard in source.shards}


def shard_identity(path: Path) -> dict:
    """sha256 over the header and SAMPLE_WINDOWS 64 KiB windows spread over the data (all of a
    small file): a cheap check that also works for TB checkpoints, where a full hash would not."""
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(head)
        h.update(f.read(min(n, st.st_size)))
        start = f.tell()
        span = st.st_size - start
        if span <= SAMPLE_WINDOWS * SAMPLE_BYTES:
            h.update(f.read())
        else:
            for i in range(SAMPLE_WINDOWS):
                f.seek(start + (span - SAMPLE_BYTES) * i // (SAMPLE_WINDOWS - 1))
                h.update(f.read(SAMPLE_BYTES))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample_sha256": h.hexdigest()}


def changed_source_shard(recorded: dict[str, dict], now: dict[str, dict]) -> tuple[str, str] | None:
    """The first source shard that is not as the interrupted run recorded it, and what differs."""
    for shard in sorted(set(recorded) | set(now)):
        was, is_ = recorded.get(shard), now.get(shard)
        if was == is_:
            continue
        if was is None or is_ is None:
            return shard, "it was not a source shard then" if was is None else "it is gone"
        if was["size"] != is_["size"]:
            return shard, f"its size ({was['size']} bytes then, {is_['size']} now)"
        if was["sample_sha256"] != is_["sample_sha256"]:
            return shard, "its content (same size, other bytes)"
        ns = was["mtime_ns"]  # only the time: a copy that did not keep it, most likely
        return shard, (f"only its modification time (size and sampled content match: copied again?); if its "
                       f"bytes are the same, `touch -d @{ns // 10**9}.{ns % 10**9:09d} FILE` restores it and "
                       f"--resume continues")
    return None


# --- the progress file


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json_atomic(path: Path, obj: object) -> None:
    write_atomic(path, json.dumps(obj, indent=2) + "\n")


def _is_map(value: object, key_type: type = str, value_type: type | tuple = object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, key_type) and isinstance(v, value_type)
                                           for k, v in value.items())


def _valid_source(rec: dict) -> bool:
    return (isinstance(rec.get("size"), int) and isinstance(rec.get("mtime_ns"), int)
            and isinstance(rec.get("sample_sha256"), str))


def _valid_shard(rec: dict) -> bool:
    number = (int, float)
    return (isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)
            and _is_map(rec.get("globals"), str, number) and _is_map(rec.get("notes"), str, str)
            and _is_map(rec.get("errors"), str, number))


def _valid_progress(state: object) -> bool:
    if not (isinstance(state, dict) and isinstance(state.get("fingerprint"), str)
            and isinstance(state.get("replace_dst"), bool) and _is_map(state.get("sources"), str, dict)
            and _is_map(state.get("shards"), str, dict)):
        return False
    return all(map(_valid_source, state["sources"].values())) and all(map(_valid_shard, state["shards"].values()))


def load_progress(path: Path) -> dict:
    """The progress file of an interrupted run, checked field by field (it decides which shards
    are reused, so a damaged one is refused rather than guessed at)."""
    try:
        state = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the progress file ({exc.strerror}); rerun with --overwrite "
                              f"to start over") from None
    except ValueError:
        state = None
    if not _valid_progress(state):
        raise CheckpointError(f"{path}: the progress file is corrupt (not the JSON quantcli writes), so --resume "
                              f"cannot trust the shards beside it; rerun with --overwrite to start over")
    return state


class ProgressFile:
    """The record in the staging folder, rewritten atomically after every finished shard."""

    def __init__(self, path: Path, state: dict):
        self.path = path
        self.state = state

    @classmethod
    def new(cls, path: Path, fp: str, replace_dst: bool, sources: dict[str, dict]) -> ProgressFile:
        return cls(path, {"fingerprint": fp, "replace_dst": replace_dst, "sources": sources, "shards": {}})

    def save(self) -> None:
        write_json_atomic(self.path, self.state)

    def finished(self, shard: str, path: Path) -> ShardResult | None:
        """The recorded result of `shard`, if its file is there with the recorded size and hash."""
        rec = self.state["shards"].get(shard)
        if rec and path.exists() and path.stat().st_size == rec["size"] and sha256_file(path) == rec["sha256"]:
            return ShardResult.from_json(rec)
        return None

    def record(self, shard: str, result: ShardResult) -> None:
        self.state["shards"][shard] = result.to_json()
        self.save()
