"""Resolve a checkpoint source: a local folder, one .safetensors file, or a Hub repo id.

Only safetensors are ever read (no pickle, no remote code). Every file named by an index must
stay inside the checkpoint folder. Hub sources fetch the small files first, read shard headers
(remotely when online, from the local cache when offline) and download each shard only when
it is needed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .errors import CheckpointError
from .safetensors_io import Header, parse_header, read_header

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files never copied to the output: weights (rewritten or pickled) and code (no remote code).
SKIP_COPY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".py", ".msgpack", ".h5")
# Written anew by convert (from the plan), never copied from a source.
REWRITTEN_FILES = (INDEX, "config.json", "hf_quant_config.json", "quantcli_manifest.json")
SMALL_FILE_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.md", "tokenizer*", "vocab*",
                       "merges*"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class Source:
    label: str  # what the user named, for messages and the manifest
    root: Path  # local folder holding the small files (and the shards, for local sources)
    shards: list[str]  # shard file names, relative to root, in order
    headers: dict[str, Header]
    config: dict
    repo_id: str | None = None
    revision: str | None = None
    weight_map: dict[str, str] = field(default_factory=dict)
    single_file: bool = False

    def shard_path(self, shard: str) -> Path:
        if self.repo_id is None:
            return self.root / shard
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(self.repo_id, shard, revision=self.revision))

    def local_header(self, shard: str) -> Header:
        """The shard's header with file offsets: a Hub header read remotely (no offsets) is
        replaced by the downloaded shard's own on first use."""
        header = self.headers[shard]
        if header.data_offset < 0:
            header = self.headers[shard] = read_header(self.shard_path(shard))
        return header

    def other_files(self) -> list[str]:
        """Small files to copy to the output (tokenizer, generation config, chat template...)."""
        if self.single_file:
            return []
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if (p.is_file() and not rel.startswith(".") and "/." not in rel and rel not in REWRITTEN_FILES
                    and not rel.endswith(SKIP_COPY_SUFFIXES)):
                out.append(rel)
        return out

    def describe(self) -> dict:
        return {"path": None if self.repo_id else str(self.root if not self.single_file else self.root / self.shards[0]),
                "repo_id": self.repo_id, "revision": self.revision}


def safe_member(root: Path, name: str, what: str) -> str:
    """Reject names that would escape the checkpoint folder (absolute, '..', drive letters)."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name or ":" in name:
        raise CheckpointError(f"{what}: file name {name!r} points outside the checkpoint folder; refusing to read it")
    resolved = (root / name).resolve()
    if root.resolve() not in resolved.parents and resolved != root.resolve():
        raise CheckpointError(f"{what}: file name {name!r} resolves outside the checkpoint folder; refusing to read it")
    return p.as_posix()


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot parse JSON ({exc})") from None


def _shards_from_folder(root: Path, label: str) -> tuple[list[str], dict[str, str]]:
    index_path = root / INDEX
    if index_path.exists():
        index = _load_json(index_path)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index_path}: has no weight_map; the index is malformed")
        weight_map = {k: safe_member(root, v, str(index_path)) for k, v in wm.items()}
        shards = sorted(set(weight_map.values()))
        return shards, weight_map
    singles = sorted(p.name for p in root.glob("*.safetensors"))
    if singles:
        return singles, {}
    pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise CheckpointError(f"{label}: holds only pickle weights ({pickles[0]}); quantcli never unpickles. "
                              f"Convert it to safetensors first (e.g. transformers save_pretrained)")
    raise CheckpointError(f"{label}: no .safetensors files and no {INDEX}; point at a checkpoint folder, "
                          f"a .safetensors file or a Hub repo id")


def _check_weight_map(source: Source) -> None:
    for name, shard in source.weight_map.items():
        header = source.headers.get(shard)
        if header is None or name not in header.tensors:
            raise CheckpointError(f"{source.label}: the index maps {name!r} to {shard}, which does not hold it; "
                                  f"the index is stale or the shard is missing")


def open_local(path: Path, label: str) -> Source:
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            if path.name.endswith(PICKLE_SUFFIXES):
                raise CheckpointError(f"{label}: is a pickle file; quantcli never unpickles. Convert it to safetensors first")
            raise CheckpointError(f"{label}: not a .safetensors file")
        header = read_header(path)
        config = _load_json(path.parent / "config.json")
        return Source(label, path.parent, [path.name], {path.name: header}, config, single_file=True)
    shards, weight_map = _shards_from_folder(path, label)
    headers = {s: read_header(path / s) for s in shards}
    source = Source(label, path, shards, headers, _load_json(path / "config.json"), weight_map=weight_map)
    _check_weight_map(source)
    return source


def _remote_headers(repo_id: str, revision: str | None, shards: list[str]) -> dict[str, Header] | None:
    """Shard headers through HTTP range reads, without downloading weights (online only)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None
    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(repo_id, revision=revision)
    except Exception:
        return None
    out = {}
    for shard in shards:
        fm = meta.files_metadata.get(shard)
        if fm is None:
            return None
        raw = {n: {"dtype": t.dtype, "shape": t.shape, "data_offsets": list(t.data_offsets)}
               for n, t in fm.tensors.items()}
        raw["__metadata__"] = fm.metadata or {}
        out[shard] = parse_header(json.dumps(raw).encode(), f"{repo_id}/{shard}", -1)
    return out


def open_hub(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    label = f"{repo_id}@{revision}" if revision else repo_id
    try:
        root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=SMALL_FILE_PATTERNS))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{label}: no such local folder, and no such repo in the Hub or the local cache "
                              f"({first}); check the path, or the repo id and --revision") from None
    if (root / INDEX).exists():
        shards, weight_map = _shards_from_folder(root, label)
    else:
        shards, weight_map = ["model.safetensors"], {}
    headers = _remote_headers(repo_id, revision, shards)
    source = Source(label, root, shards, {}, _load_json(root / "config.json"), repo_id=repo_id,
                    revision=revision, weight_map=weight_map)
    if headers is None:
        try:
            headers = {s: read_header(source.shard_path(s)) for s in shards}
        except Exception as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{label}: cannot fetch shard headers ({type(exc).__name__}); is the repo "
                                  f"in the local cache? Set HF_HUB_OFFLINE=0 to download") from None
    source.headers = headers
    if weight_map:
        _check_weight_map(source)
    return source


def open_source(src: str, revision: str | None = None) -> Source:
    path = Path(src).expanduser()
    if path.exists():
        if revision:
            raise CheckpointError(f"--revision {revision}: only applies to Hub repo ids, but {src} is a local path")
        return open_local(path, src)
    if REPO_ID.match(src) and not src.startswith((".", "/")):
        return open_hub(src, revision)
    raise CheckpointError(f"{src}: no such file or folder, and not a Hub repo id (owner/name)")
