"""Resolve a checkpoint source: a local folder, one .safetensors file, or a Hub repo id.

Only safetensors are ever read (no pickle, no remote code). Every file name an index gives must
stay inside the checkpoint folder as written (the check is on the name, not on where a symlink
points: the Hub cache links every snapshot file into its blobs/ folder). Which shard each tensor
is read from is settled here, once, for inspect, verify and convert alike. Hub sources fetch
the small files first, read shard headers (remotely when online, from the local cache when
offline) and download each shard only when it is needed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from quantcli.checkpoint.config_files import _load_json, load_config  # noqa: F401  (load_config: re-exported)
from quantcli.checkpoint.hub import cache_folder, current, download_kwargs, quiet_retries
from quantcli.checkpoint.manifest import unfinished_conversion
from quantcli.checkpoint.safetensors_io import Header, parse_header, read_header
from quantcli.errors import CheckpointError, did_you_mean

# huggingface_hub is imported inside the Hub functions: a local checkpoint never loads it.

INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files never copied to the output: weights (rewritten or pickled) and code (no remote code).
SKIP_COPY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".py", ".msgpack", ".h5")
# Written anew by convert (from the plan), never copied from a source.
REWRITTEN_FILES = (INDEX, "config.json", "hf_quant_config.json", "quantcli_manifest.json")
SMALL_FILE_PATTERNS = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.md", "tokenizer*", "vocab*",
                       "merges*"]
# What a single .safetensors file's folder holds for it, copied beside the output's weights: the
# folder may hold anything else (a downloads folder), so only these names, at its top level.
COMPANION_FILES = ("tokenizer*", "vocab*", "merges*", "special_tokens_map.json", "added_tokens.json", "*.tiktoken",
                   "*.model", "chat_template*", "generation_config.json", "preprocessor_config.json",
                   "processor_config.json", "README.md", "LICENSE*", "modules.json", "sentence_bert_config.json",
                   "config_sentence_transformers.json")
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
    # tensor name -> the shard it is read from. Empty when there is no index (each tensor is in
    # exactly one file); with an index, completed by `assign_owners` with tensors the index misses.
    weight_map: dict[str, str] = field(default_factory=dict)
    single_file: bool = False
    commit: str | None = None  # Hub: the snapshot the small files came from; shards come from it too
    warnings: list[str] = field(default_factory=list)  # found while opening; shown by convert

    def shard_path(self, shard: str) -> Path:
        if self.repo_id is None:
            return self.root / shard
        return hub_file(self.repo_id, shard, self.commit or self.revision, self.label)

    def owners(self) -> dict[str, str]:
        """tensor name -> the shard it is read from, in shard order (see `assign_owners`)."""
        return {name: shard for shard in self.shards for name in self.headers[shard].tensors
                if not self.weight_map or self.weight_map.get(name) == shard}

    def local_header(self, shard: str) -> Header:
        """The shard's header with file offsets: a Hub header read remotely (no offsets) is
        replaced by the downloaded shard's own on first use."""
        header = self.headers[shard]
        if header.data_offset < 0:
            header = self.headers[shard] = read_header(self.shard_path(shard))
        return header

    def other_files(self) -> list[str]:
        """Small files to copy to the output (tokenizer, generation config, chat template...); for
        a single file, the COMPANION_FILES beside it."""
        if self.single_file:
            return sorted({p.name for pattern in COMPANION_FILES for p in self.root.glob(pattern)
                           if p.is_file() and not p.name.startswith(".") and p.name not in REWRITTEN_FILES})
        out = []
        for p in sorted(self.root.rglob("*")):
            rel = p.relative_to(self.root).as_posix()
            if (p.is_file() and not rel.startswith(".") and "/." not in rel and rel not in REWRITTEN_FILES
                    and not rel.endswith(SKIP_COPY_SUFFIXES)):
                out.append(rel)
        return out

    def describe(self) -> dict:
        """Where the source came from: a path, or a Hub repo id, the revision asked for (None:
        the default branch) and the commit that resolved to (the snapshot that was read)."""
        where = {"path": None if self.repo_id else
                 str(self.root if not self.single_file else self.root / self.shards[0]),
                 "repo_id": self.repo_id, "revision": self.revision}
        return {**where, "commit": self.commit} if self.repo_id else where


def hub_file(repo_id: str, filename: str, revision: str | None, label: str) -> Path:
    """One file of a Hub repo through the local cache (downloaded unless HF_HUB_OFFLINE=1)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        with quiet_retries():
            return Path(hf_hub_download(repo_id, filename, revision=revision, **download_kwargs()))
    except (EntryNotFoundError, OSError, ValueError) as exc:  # hub errors are OSErrors or EntryNotFound
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{label}: cannot get {filename} ({first}); is it in the local cache {cache_folder()} "
                              f"(--cache-dir, else HF_HUB_CACHE)? Set HF_HUB_OFFLINE=0 to download it") from None


def safe_member(name: object, what: str) -> str:
    """An index's file name, checked as written: relative, '/'-separated, no '..', '.' or empty
    parts, no drive letter or backslash. The name alone decides, so a symlink inside the folder
    (the Hub cache's snapshot -> blob links) is followed like any file."""
    if not isinstance(name, str):
        raise CheckpointError(f"{what}: a weight_map value is {name!r}, not a file name; the index is malformed")
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or ":" in name
            or any(part in ("", ".", "..") for part in parts)):
        raise CheckpointError(f"{what}: file name {name!r} points outside the checkpoint folder (only plain "
                              f"relative names are allowed); refusing to read it")
    return PurePosixPath(name).as_posix()


def _shards_from_folder(root: Path, label: str) -> tuple[list[str], dict[str, str]]:
    index_path = root / INDEX
    if index_path.is_symlink() and not index_path.exists():
        raise CheckpointError(f"{index_path}: is a symlink to a missing file; re-download the checkpoint")
    if index_path.exists():
        index = _load_json(index_path)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            problem = ("is missing" if wm is None else "is empty" if isinstance(wm, dict)
                       else f"is a JSON {type(wm).__name__}")
            raise CheckpointError(f"{index_path}: 'weight_map' {problem}; it must map tensor names to shard "
                                  f"files. The index is malformed")
        weight_map = {k: safe_member(v, str(index_path)) for k, v in wm.items()}
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


def assign_owners(source: Source) -> None:
    """Decide, once, which shard each tensor is read from.

    - The same name in two shards is refused (naming both) unless the index assigns it to one of
      them: serving engines load every tensor of every shard, so two copies mean the served model
      depends on load order; the index is the only record of which copy was meant. The output
      holds that one copy, and a warning names the other.
    - A tensor in a shard but missing from the index is kept, read from its shard, with a warning:
      consumers load it (they read whole shards, the index only lists files), so dropping it would
      change the model; the output's index then lists it.
    - A tensor the index names but its shard lacks stays an error (`_check_weight_map`)."""
    holders: dict[str, list[str]] = {}
    for shard in source.shards:
        for name in source.headers[shard].tensors:
            holders.setdefault(name, []).append(shard)
    _check_weight_map(source)
    unindexed = []
    for name, shards in holders.items():
        chosen = source.weight_map.get(name)
        if len(shards) > 1 and chosen is None:
            why = f"and {INDEX} does not list it" if source.weight_map else f"and there is no {INDEX} to say which"
            raise CheckpointError(f"{source.label}: tensor {name!r} is in both {shards[0]} and {shards[1]}, {why}; "
                                  f"remove the stale copy (or list the right shard in the index)")
        if len(shards) > 1:
            others = ", ".join(s for s in shards if s != chosen)
            source.warnings.append(f"{name}: also in {others}; using the copy in {chosen}, which the index names")
        if source.weight_map and chosen is None:
            source.weight_map[name] = shards[0]
            unindexed.append(name)
    if unindexed:
        shown = ", ".join(unindexed[:3]) + (f" and {len(unindexed) - 3} more" if len(unindexed) > 3 else "")
        source.warnings.append(f"{len(unindexed)} tensor(s) in the shards are missing from {INDEX} ({shown}); "
                               f"kept, read from the shard that holds them (the index is stale)")


def _refuse_one_shard(path: Path, label: str) -> None:
    """A single file that its folder's index lists among two or more shards is half a model."""
    try:  # a broken index next to a lone file: the file opens as it always did
        wm = _load_json(path.parent / INDEX).get("weight_map") if (path.parent / INDEX).is_file() else None
    except CheckpointError:
        wm = None
    shards = {v for v in wm.values() if isinstance(v, str)} if isinstance(wm, dict) else set()
    if path.name in shards and len(shards) >= 2:
        folder = path.parent.as_posix() if str(path.parent) else "."
        raise CheckpointError(f"{label}: is one shard of the sharded checkpoint in {folder} (the index lists "
                              f"{len(shards)} shards); pass the folder {folder}")


def open_local(path: Path, label: str) -> Source:
    if not path.is_file() and not path.is_dir():
        raise CheckpointError(f"{label}: is neither a regular file nor a folder (a FIFO, socket or device?); "
                              f"point at a checkpoint folder or a .safetensors file")
    if path.is_file():
        if not path.name.endswith(".safetensors"):
            if path.name.endswith(PICKLE_SUFFIXES):
                raise CheckpointError(f"{label}: is a pickle file; quantcli never unpickles. "
                                      "Convert it to safetensors first")
            raise CheckpointError(f"{label}: not a .safetensors file")
        _refuse_one_shard(path, label)
        header = read_header(path)
        config = load_config(path.parent / "config.json")
        return Source(label, path.parent, [path.name], {path.name: header}, config, single_file=True)
    shards, weight_map = _shards_from_folder(path, label)
    headers = {s: read_header(path / s) for s in shards}
    source = Source(label, path, shards, headers, load_config(path / "config.json"), weight_map=weight_map)
    assign_owners(source)
    return source


def _remote_headers(repo_id: str, revision: str | None, shards: list[str]) -> dict[str, Header] | None:
    """Shard headers through HTTP range reads, without downloading weights (online only)."""
    from huggingface_hub import constants, get_safetensors_metadata

    if constants.HF_HUB_OFFLINE:  # what huggingface_hub made of HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE
        return None
    try:
        with quiet_retries():
            meta = get_safetensors_metadata(repo_id, revision=revision, token=current().token)
    except Exception:  # noqa: BLE001 - any failure to reach or parse the Hub (DNS, proxy, HTTP
        # client errors that are neither OSError nor ValueError) falls back to the shards' own
        # headers, read from the cache or once downloaded; a real problem surfaces there, by name.
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


def _hub_failure(exc: Exception) -> str:
    """What went wrong on the Hub, in our words (huggingface_hub's run to several lines)."""
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    if isinstance(exc, RepositoryNotFoundError):
        return "no such repo on the Hub (or it is private: log in with `hf auth login`)"
    if isinstance(exc, LocalEntryNotFoundError):
        return (f"not in the local Hugging Face cache {cache_folder()} (--cache-dir, else HF_HUB_CACHE), and the Hub "
                f"cannot be reached (offline or HF_HUB_OFFLINE=1)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"the Hub or the local cache could not provide it ({first[:100]})"


def open_hub(repo_id: str, revision: str | None) -> Source:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    label = f"{repo_id}@{revision}" if revision else repo_id
    try:
        with quiet_retries():
            root = Path(snapshot_download(repo_id, revision=revision, allow_patterns=SMALL_FILE_PATTERNS,
                                          **download_kwargs()))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise CheckpointError(f"{label}: no such local folder, and {_hub_failure(exc)}; check the path, or the "
                              f"repo id and --revision") from None
    if (root / INDEX).exists():
        shards, weight_map = _shards_from_folder(root, label)
    else:
        shards, weight_map = ["model.safetensors"], {}
    # snapshot_download returns snapshots/<commit>: reading shards at that commit keeps them from
    # the same revision as the index even if the branch moves meanwhile.
    commit = root.name if re.fullmatch(r"[0-9a-f]{40}", root.name) else None
    headers = _remote_headers(repo_id, commit or revision, shards)
    source = Source(label, root, shards, {}, load_config(root / "config.json"), repo_id=repo_id,
                    revision=revision, weight_map=weight_map, commit=commit)
    source.headers = headers if headers is not None else {s: read_header(source.shard_path(s)) for s in shards}
    assign_owners(source)
    return source


def open_source(src: str, revision: str | None = None) -> Source:
    path = Path(src).expanduser()
    unfinished = unfinished_conversion(path)
    if unfinished is not None:  # its shards hold codes, but no config declares them yet
        raise CheckpointError(unfinished)
    if path.exists():
        if revision:
            raise CheckpointError(f"--revision {revision}: only applies to Hub repo ids, but {src} is a local path")
        return open_local(path, src)
    near = _local_near_miss(path)
    if near is not None:  # `demo/tinyllama` next to `demo/tiny-llama`: a typo, not a Hub id
        raise CheckpointError(f"{src}: no such file or folder{near}")
    hub = REPO_ID.match(src) and not src.startswith((".", "/"))  # could name a Hub repo
    if path.parent.is_dir() and str(path.parent) not in ("", "."):  # `demo/` is here: a local path
        raise CheckpointError(f"{src}: no such file or folder in {path.parent.as_posix()}/" + (
            f" (to read the Hub repo {src} instead, run from a folder without "
            f"{path.parent.as_posix()}/)" if hub else ""))
    if hub:
        return open_hub(src, revision)
    raise CheckpointError(f"{src}: no such file or folder, and not a Hub repo id (owner/name)")


def _local_near_miss(path: Path) -> str | None:
    """'; did you mean ...' when `path`'s folder exists here and holds a close name, else None."""
    parent = path.parent
    if str(parent) in ("", ".") or not parent.is_dir():
        return None
    hint = did_you_mean(path.name, [p.name for p in parent.iterdir()])
    return hint.replace("did you mean '", f"did you mean '{parent.as_posix()}/") if hint else None
