"""Calibration samples: a local .txt (one sample per line, or blank-line separated when the file
has blank lines) or .jsonl (`text`, `messages` rendered with the source's chat template, or
`input_ids`), tokenized with the source's tokenizer, truncated to seq_len, the first N kept."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import QuantcliError
from ..facts import Calibration

EXTRA = "pip install 'quantcli[calibrate]'"


def read_samples(cal: Calibration) -> list:
    """The first `cal.samples` raw samples (str, messages list or token-id list); refused when
    the file is missing, of another kind, or holds no text."""
    path = Path(cal.data)
    where = f"--calibration {cal.data}"
    if not path.is_file():
        raise QuantcliError(f"{where}: no such file (a local .txt or .jsonl; Hub datasets are not supported yet)")
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as exc:
        raise QuantcliError(f"{where}: cannot read it as UTF-8 text ({exc})") from None
    if path.suffix == ".jsonl":
        samples = [_jsonl_sample(line, i, where) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    elif path.suffix == ".txt":
        chunks = text.split("\n\n") if "\n\n" in text.strip() else text.splitlines()
        samples = [c.strip() for c in chunks if c.strip()]
    else:
        raise QuantcliError(f"{where}: unknown kind {path.suffix or '(no suffix)'!r}; use .txt or .jsonl")
    samples = [s for s in samples if s]
    if not samples:
        raise QuantcliError(f"{where}: holds no text (no non-empty sample)")
    return samples[: cal.samples]


def _jsonl_sample(line: str, i: int, where: str):
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise QuantcliError(f"{where}: line {i} is not JSON ({exc.msg})") from None
    if isinstance(obj, dict):
        for key in ("input_ids", "messages", "text"):
            if key in obj:
                value = obj[key]
                ok = (all(isinstance(v, int) for v in value) if key == "input_ids" and isinstance(value, list)
                      else isinstance(value, list) if key == "messages" else isinstance(value, str))
                if ok:
                    return value
                raise QuantcliError(f"{where}: line {i}: {key!r} has the wrong type")
    raise QuantcliError(f"{where}: line {i} has none of 'text', 'messages', 'input_ids'")


def token_ids(cal: Calibration, source_root: Path) -> list[list[int]]:
    """Every sample as token ids, at most `cal.seq_len` long."""
    samples = read_samples(cal)
    tokenizer = None
    out = []
    for s in samples:
        if not (isinstance(s, list) and all(isinstance(v, int) for v in s)):
            tokenizer = tokenizer or _tokenizer(source_root, cal)
            if isinstance(s, list):
                s = tokenizer.apply_chat_template(s, tokenize=False)
            s = tokenizer(s, add_special_tokens=True)["input_ids"]
        if s:
            out.append(list(s[: cal.seq_len]))
    return out


def _tokenizer(source_root: Path, cal: Calibration):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise QuantcliError(f"--calibration needs transformers and tokenizers: {EXTRA}") from None
    try:
        return AutoTokenizer.from_pretrained(str(source_root))
    except (OSError, ValueError) as exc:
        raise QuantcliError(f"--calibration {cal.data}: text samples need the source's tokenizer, which "
                            f"{source_root} lacks ({str(exc).splitlines()[0][:120]}); or give input_ids") from None
