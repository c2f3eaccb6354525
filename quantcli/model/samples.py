"""Calibration samples: a local .txt (one sample per line, or blank-line separated when the file
has blank lines) or .jsonl (`text`, `messages` rendered with the source's chat template, or
`input_ids`), or a Hub dataset `OWNER/NAME[:SPLIT]` / `OWNER/NAME:CONFIG:SPLIT` (rows with the
same keys, streamed with the optional `datasets` package, offline from its cache under
HF_DATASETS_OFFLINE=1); tokenized with the source's tokenizer, truncated to seq_len, the first
N kept (`samples_held`: how many there were)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
from importlib.metadata import PackageNotFoundError, requires
from pathlib import Path

from quantcli.checkpoint import hub
from quantcli.errors import QuantcliError
from quantcli.formats.facts import Calibration

# huggingface_hub, datasets and transformers are imported where they are used: datasets and
# transformers are optional (the calibrate extra), and a local .txt or .jsonl needs none of them.

# The name `quantcli` on PyPI is another project, so the hint names the extra's own packages,
# which install alike under an editable and a regular install.
CALIBRATE_PACKAGES = ("transformers>=4.56", "tokenizers", "datasets>=2.16")  # pyproject.toml's calibrate extra


def extra_hint(extra: str = "calibrate") -> str:
    """How to install an extra's packages, read from the installed quantcli's metadata."""
    try:
        reqs = [r.split(";")[0].strip() for r in requires("quantcli") or [] if f'extra == "{extra}"' in r]
    except PackageNotFoundError:  # run from a source tree that was never installed
        reqs = []
    packages = " ".join(shlex.quote(r.replace(" ", "")) for r in reqs or CALIBRATE_PACKAGES)
    return (f"install the {extra} extra's packages: pip install {packages} (from a quantcli source checkout, "
            f"pip install -e '.[{extra}]' does the same)")


EXTRA = extra_hint()
HUB_DATASET = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+){0,2}$")
KEYS = ("input_ids", "messages", "text")
KIND_OK = {"input_ids": lambda v: isinstance(v, list) and all(is_token_id(t) for t in v),
           "messages": lambda v: isinstance(v, list) and all(isinstance(m, dict) for m in v),
           "text": lambda v: isinstance(v, str)}
KIND_SAID = {"input_ids": "a list of integer token ids", "messages": "a list of {role, content} objects",
             "text": "a string"}
KIND_EXAMPLE = {"input_ids": "[1, 2]", "messages": '[{"role": "user", "content": "..."}]', "text": '"..."'}
# A list of the wrong elements: which element, and how to fix it.
ITEM_OK = {"input_ids": lambda v: is_token_id(v), "messages": lambda v: isinstance(v, dict)}
ITEM_SAID = {"input_ids": "an integer token id", "messages": "a {role, content} object"}
ITEM_FIX = {"input_ids": "write every token id as a whole number, e.g. [1, 2]",
            "messages": 'write each message as {"role": ..., "content": ...}'}


def is_token_id(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not token 1


def check_token_ids(samples: list, cal: Calibration, vocab_size: int | None) -> None:
    """Every pre-tokenized id inside the model's vocabulary (an embedding lookup would fail deep in
    the forward otherwise)."""
    for i, s in enumerate(samples, 1):
        if isinstance(s, list) and all(is_token_id(v) for v in s):
            bad = next((v for v in s if v < 0 or (vocab_size is not None and v >= vocab_size)), None)
            if bad is not None:
                raise QuantcliError(f"--calibration {cal.data}: sample {i} has token id {bad}, outside the model's "
                                    f"vocabulary (0..{(vocab_size or 0) - 1}, config.json vocab_size)")


def is_hub_dataset(data: str) -> bool:
    """A Hub dataset id, not a local path: OWNER/NAME[:CONFIG][:SPLIT] naming no existing file."""
    return bool(HUB_DATASET.match(data)) and not Path(data).exists() and not data.endswith((".txt", ".jsonl"))


def data_digest(cal: Calibration) -> str:
    """SHA-256 of the data a run uses: a local file's bytes; for a Hub dataset, of the samples read."""
    if is_hub_dataset(cal.data):
        return hashlib.sha256(json.dumps(read_samples(cal)).encode()).hexdigest()
    digest = hashlib.sha256()
    with open(cal.data, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_samples(cal: Calibration) -> list:
    """The first `cal.samples` raw samples (str, messages list or token-id list); refused when
    the file is missing, of another kind, or holds no samples. Read once per process and version of
    the file (size, mtime): the plan's checks, the resume fingerprint, the engine and the
    manifest all ask for them, and a Hub dataset would otherwise be streamed each time."""
    return list(_read_samples(cal, _version(cal.data))[: cal.samples])


def samples_held(cal: Calibration) -> int | None:
    """How many samples the data holds, however many `cal.samples` keeps (reports say N of M): a
    local file's count; a Hub dataset is streamed only up to `cal.samples`, so its count when it
    ran out before that, else None (not known)."""
    held = len(_read_samples(cal, _version(cal.data)))
    return None if is_hub_dataset(cal.data) and held >= cal.samples else held


def _version(data: str) -> tuple[int, int] | None:
    try:
        st = os.stat(data)
    except OSError:
        return None  # a Hub dataset id, or a missing file (refused when read)
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _read_samples(cal: Calibration, version: tuple[int, int] | None) -> tuple:
    path = Path(cal.data)
    where = f"--calibration {cal.data}"
    if is_hub_dataset(cal.data):
        return tuple(_hub_samples(cal, where))
    if not path.is_file():
        raise QuantcliError(f"{where}: no such file (a local .txt or .jsonl, or a Hub dataset OWNER/NAME[:SPLIT])")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise QuantcliError(f"{where}: cannot read it as UTF-8 text ({exc})") from None
    if path.suffix == ".jsonl":
        rows = [_jsonl_sample(line, i, where) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not rows:
            raise QuantcliError(f"{where}: holds no samples (the file is empty); write one JSON object per line "
                                f"with 'text', 'messages' or 'input_ids'")
        samples = [value for _, value in rows if value]
        if not samples:
            raise QuantcliError(f"{where}: holds no samples (every row's {_keys_said(k for k, _ in rows)} is empty); "
                                f"fill at least one")
    elif path.suffix == ".txt":
        chunks = text.split("\n\n") if "\n\n" in text.strip() else text.splitlines()
        samples = [c.strip() for c in chunks if c.strip()]
        if not samples:
            raise QuantcliError(f"{where}: holds no text (the file is empty or blank); write one sample per line")
    else:
        raise QuantcliError(f"{where}: unknown kind {path.suffix or '(no suffix)'!r}; use .txt or .jsonl")
    return tuple(samples)  # all of them: read_samples keeps cal.samples, samples_held counts them


def _keys_said(keys) -> str:
    """The rows' `keys`, as a message says them: 'input_ids', or 'messages' or 'text'."""
    used = set(keys)
    return " or ".join(repr(k) for k in KEYS if k in used)


def _jsonl_sample(line: str, i: int, where: str):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise QuantcliError(f"{where}: line {i} is not JSON ({exc.msg})") from None
    return _row_sample(obj, f"{where}: line {i}")


def _row_sample(obj, where: str) -> tuple[str, object]:
    """(key, sample) of one row: its input_ids, messages or text (the first of these it has)."""
    if isinstance(obj, dict):
        for key in KEYS:
            if key in obj:
                value = obj[key]
                if KIND_OK[key](value):
                    return key, value
                raise QuantcliError(f"{where}: {_kind_fault(key, value)}")
    raise QuantcliError(f"{where} has none of 'text', 'messages', 'input_ids'")


def _kind_fault(key: str, value: object) -> str:
    """What is wrong with a row's `value` under `key`: the value's own type, or (for a list) the
    first element of the wrong kind."""
    if isinstance(value, list) and key in ITEM_OK:
        k, item = next((k, v) for k, v in enumerate(value) if not ITEM_OK[key](v))
        shown = json.dumps(item, default=str)
        shown = shown if len(shown) <= 24 else shown[:20] + "..."
        return f"{key!r}[{k}] is {shown} ({_json_type(item)}), not {ITEM_SAID[key]}; {ITEM_FIX[key]}"
    return f"{key!r} must be {KIND_SAID[key]}, not {_json_type(value)}; write e.g. {KIND_EXAMPLE[key]}"


def _json_type(value: object) -> str:
    """A value's JSON type, as the file's author wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "an integer" if isinstance(value, int) else "a float"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _reachable(repo: str, where: str) -> None:
    """One request for the dataset's page, without huggingface_hub's retries: a Hub that cannot be
    reached (or a dataset it does not have) is said now, not after half a minute of retries.
    Offline (HF_HUB_OFFLINE), datasets reads its cache and nothing is asked."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if hub.offline():
        return
    try:
        HfApi().dataset_info(repo, token=hub.current().token, timeout=10)
    except RepositoryNotFoundError:
        raise QuantcliError(f"{where}: no such dataset on the Hub (or it is private or gated: log in with "
                            f"`hf auth login`, or pass --token)") from None
    except hub.network_errors() as exc:
        raise QuantcliError(f"{where}: cannot reach the Hugging Face Hub ({type(exc).__name__}); check the network "
                            f"(or HF_ENDPOINT), set HF_HUB_OFFLINE=1 to read the dataset from the datasets cache, or "
                            f"pass a local .txt or .jsonl") from None
    except HfHubHTTPError:  # anything else the Hub says, load_dataset says again in full
        pass


def _hub_samples(cal: Calibration, where: str) -> list:
    try:
        import datasets
    except ImportError:
        raise QuantcliError(f"{where}: a Hub dataset needs the datasets package ({EXTRA}); or pass a local "
                            f".txt or .jsonl") from None
    repo, *rest = cal.data.split(":")
    config, split = (None, rest[0]) if len(rest) == 1 else (rest[0], rest[1]) if rest else (None, "train")
    not_found = getattr(getattr(datasets, "exceptions", None), "DatasetNotFoundError", OSError)
    _reachable(repo, where)
    try:
        with hub.quiet_retries():  # the rows stream from the Hub too
            token = {"token": hub.current().token} if hub.current().token else {}  # --token, else datasets' own
            rows = datasets.load_dataset(repo, config, split=split, streaming=True, **token)
            samples = []
            seen = set()  # the keys of the rows read
            for i, row in enumerate(rows):
                key, sample = _row_sample(row, f"{where}: row {i}")
                seen.add(key)
                if sample:
                    samples.append(sample)
                if len(samples) == cal.samples:
                    break
    except (not_found, OSError, ValueError, ConnectionError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise QuantcliError(f"{where}: cannot read the Hub dataset {repo} (config {config}, split {split}): {first}; "
                            f"offline, it must be in the datasets cache") from None
    if not samples:
        said = f"every row's {_keys_said(seen)} is empty" if seen else "no rows"
        raise QuantcliError(f"{where}: holds no samples in split {split} ({said}); name a split with some")
    return samples


def token_ids(cal: Calibration, source_root: Path) -> list[list[int]]:
    """Every sample as token ids, at most `cal.seq_len` long. Tokenized once per process and version
    of the data and of the tokenizer's files: the summary's count, the dry-run estimate and the
    layer walk each ask for them."""
    tokenizer_version = tuple(_version(str(Path(source_root) / name)) for name in TOKENIZER_FILES + TOKENIZER_SETTINGS)
    return [list(s) for s in _token_ids(cal, Path(source_root), _version(cal.data), tokenizer_version)]


@functools.lru_cache(maxsize=8)
def _token_ids(cal: Calibration, source_root: Path, version, tokenizer_version) -> tuple[tuple[int, ...], ...]:
    samples = read_samples(cal)
    tokenizer = None
    out = []
    for s in samples:
        if not (isinstance(s, list) and all(is_token_id(v) for v in s)):
            tokenizer = tokenizer or _tokenizer(source_root, cal)
            if isinstance(s, list):
                s = tokenizer.apply_chat_template(s, tokenize=False)
            # cut by the tokenizer, which keeps the special tokens it adds at both ends (an encoder's
            # [CLS] ... [SEP], as sentence-transformers cuts; a decoder's BOS as a slice would)
            s = tokenizer(s, add_special_tokens=True, truncation=True, max_length=cal.seq_len,
                          verbose=False)["input_ids"]
        if s:
            out.append(tuple(s[: cal.seq_len]))
    return tuple(out)


def check_tokenizer(samples: list, cal: Calibration, source_root: Path) -> None:
    """Refuse up front text samples without a tokenizer, and messages without a chat template."""
    if all(isinstance(s, list) and all(is_token_id(v) for v in s) for s in samples):
        return
    tokenizer = _tokenizer(source_root, cal)
    if any(isinstance(s, list) and not all(is_token_id(v) for v in s) for s in samples) \
            and not getattr(tokenizer, "chat_template", None):
        raise QuantcliError(f"--calibration {cal.data}: 'messages' samples need the source's chat template, which "
                            f"{source_root}'s tokenizer lacks; give 'text' or 'input_ids' instead")


# The files a tokenizer is built from (a fast tokenizer's own file, or a slow one's vocabulary);
# tokenizer_config.json alone only configures one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt")
TOKENIZER_SETTINGS = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # change the ids too


def _tokenizer(source_root: Path, cal: Calibration):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise QuantcliError(f"--calibration needs transformers and tokenizers: {EXTRA}") from None
    try:
        return AutoTokenizer.from_pretrained(str(source_root))
    except (OSError, ValueError) as exc:  # transformers' own text names no file; ours says what is missing
        raise QuantcliError(f"--calibration {cal.data}: text samples need the source's tokenizer, but "
                            f"{_tokenizer_problem(source_root, exc)}; copy the tokenizer files there, or give token "
                            f"ids ({{\"input_ids\": [...]}} per .jsonl line)") from None


def _tokenizer_problem(root: Path, exc: Exception) -> str:
    """Why no tokenizer could be built from `root`, by the files it holds."""
    present = [f for f in TOKENIZER_FILES if (root / f).is_file()]
    if present:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"transformers could not build one from {root}'s {', '.join(present)} ({first})"
    if (root / "tokenizer_config.json").is_file():
        return (f"{root} has a tokenizer_config.json and no file to build the tokenizer from "
                f"({', '.join(TOKENIZER_FILES)})")
    return f"{root} has no tokenizer files (tokenizer.json, or tokenizer_config.json with its vocabulary)"
