"""How quantcli reaches the Hugging Face Hub for one command: the token and cache folder given on
the command line (--token, --cache-dir; default: huggingface_hub's own, HF_TOKEN / `hf auth
login` and HF_HUB_CACHE), whether the Hub is to be used at all (HF_HUB_OFFLINE), the exceptions
that mean it cannot be reached, and huggingface_hub's retry warnings kept off the terminal (the
command says what failed in one line)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# huggingface_hub is imported inside the functions: `quantcli --help` imports this module.


@dataclass(frozen=True)
class HubAccess:
    token: str | None = None
    cache_dir: str | None = None


# Set for the length of one command (hub_access); a plain global, not a context variable, so
# that the threads that download shards see it too.
_current = HubAccess()


@contextlib.contextmanager
def hub_access(token: str | None = None, cache_dir: str | None = None) -> Iterator[HubAccess]:
    """Every Hub call inside uses `token` and `cache_dir` (None: huggingface_hub's defaults)."""
    global _current
    previous, _current = _current, HubAccess(token or None, str(cache_dir) if cache_dir else None)
    try:
        yield _current
    finally:
        _current = previous


def current() -> HubAccess:
    return _current


def download_kwargs() -> dict[str, str]:
    """token= and cache_dir= for hf_hub_download / snapshot_download, where given."""
    return {k: v for k, v in (("token", _current.token), ("cache_dir", _current.cache_dir)) if v}


def cache_folder() -> str:
    """The Hub cache folder the downloads read and fill: --cache-dir, else huggingface_hub's
    HF_HUB_CACHE (read at call time, as hf_hub_download does), absolute as it resolves it."""
    from huggingface_hub import constants

    return str(Path(_current.cache_dir or constants.HF_HUB_CACHE).expanduser().resolve())


def offline() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE, TRANSFORMERS_OFFLINE) set: read the caches only."""
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().lower() in ("1", "true", "yes", "on") for f in flags)


def network_errors() -> tuple[type[BaseException], ...]:
    """The exceptions huggingface_hub's HTTP clients raise when the Hub cannot be reached."""
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    # huggingface_hub 2.x uses httpx2, 1.x httpx, 0.x requests
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError"),
                         ("requests", "Timeout")):
        try:
            errors.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


@contextlib.contextmanager
def quiet_retries() -> Iterator[None]:
    """huggingface_hub's and datasets' 'Retrying in 1s [Retry 1/5]' warnings off the terminal."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets", "fsspec")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


__all__ = ["HubAccess", "cache_folder", "current", "download_kwargs", "hub_access", "network_errors", "offline",
           "quiet_retries"]
