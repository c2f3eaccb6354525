"""The Hub for a newcomer (issue 21 item 16): a Hub calibration dataset with no network fails in
one line at once (no half minute of huggingface_hub retry warnings first), the missing-extra hint
works for a regular install as for an editable one, and convert/inspect/verify take --token and
--cache-dir (push's options are in tests/test_push.py)."""

from __future__ import annotations

import logging
import sys
import time
import types
from pathlib import Path

import pytest
from faults import assert_one_line_error
from test_hub_cache import COMMIT, folder_files, put_in_cache

RETRY = "Retrying in 1s [Retry 1/5]."


@pytest.fixture
def retry_records():
    """What huggingface_hub's loggers let through (whatever handlers the library set up)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("huggingface_hub")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture
def fake_datasets(monkeypatch):
    """A `datasets` whose load_dataset does what the real one does without a network: huggingface_hub
    logs a retry warning six times, then the connection error comes."""
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        for _ in range(6):
            logging.getLogger("huggingface_hub.utils._http").warning(RETRY)
        raise ConnectionError("[Errno 101] Network is unreachable")

    module = types.SimpleNamespace(load_dataset=load_dataset, exceptions=types.SimpleNamespace(
        DatasetNotFoundError=FileNotFoundError))
    monkeypatch.setitem(sys.modules, "datasets", module)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


def convert_with_hub_data(run_cli, tiny_llama, tmp_path):
    return run_cli("convert", tiny_llama, tmp_path / "o", "--recipe", "nvfp4", "--activations", "static",
                   "--calibration", "someorg/somedata", "--calibration-samples", "2", "-q")


def test_hub_dataset_without_network_fails_at_once_in_one_line(tiny_llama, tmp_path, run_cli, monkeypatch,
                                                               fake_datasets, retry_records):
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    start = time.monotonic()
    code, out, err = convert_with_hub_data(run_cli, tiny_llama, tmp_path)
    assert_one_line_error(code, out, err, "someorg/somedata", "cannot reach the Hugging Face Hub", "HF_HUB_OFFLINE=1")
    assert time.monotonic() - start < 30 and not fake_datasets  # no load_dataset, no retries
    assert not retry_records and RETRY not in err


def test_retry_warnings_stay_off_the_terminal(tiny_llama, tmp_path, run_cli, monkeypatch, fake_datasets,
                                              retry_records):
    monkeypatch.setattr("huggingface_hub.HfApi.dataset_info", lambda self, *a, **kw: None)  # reachable, then not
    code, out, err = convert_with_hub_data(run_cli, tiny_llama, tmp_path)
    assert_one_line_error(code, out, err, "someorg/somedata", "cannot read the Hub dataset")
    assert fake_datasets and not retry_records and RETRY not in err


def test_the_missing_extra_hint_works_for_any_install(tiny_llama, tmp_path, run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    code, out, err = convert_with_hub_data(run_cli, tiny_llama, tmp_path)
    line = assert_one_line_error(code, out, err, "datasets package", "pip install", "'datasets>=2.16'",
                                 "'transformers>=4.56'")
    assert "pip install -e '.[calibrate]' in the quantcli source folder" not in line


@pytest.fixture
def cached_repo(tiny_llama, tmp_path, monkeypatch) -> Path:
    """acme/tiny-llama in a cache folder of its own; HF_HUB_CACHE points elsewhere (empty)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "my-cache"
    put_in_cache(cache, "acme/tiny-llama", folder_files(tiny_llama), COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "default-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_cache_dir_and_token_reach_the_hub_calls(cached_repo, tiny_llama, tmp_path, run_cli, monkeypatch):
    import huggingface_hub

    seen = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: (seen.append(kw), real(*a, **kw))[1])
    hub = ["--cache-dir", str(cached_repo), "--token", "hf_given"]
    code, out, err = run_cli("inspect", "acme/tiny-llama", "-q", *hub)
    assert code == 0 and "acme/tiny-llama: layout unquantized" in out, err
    assert seen[-1]["cache_dir"] == str(cached_repo) and seen[-1]["token"] == "hf_given"
    code, out, err = run_cli("convert", "acme/tiny-llama", tmp_path / "q", "--recipe", "fp8", "-q", *hub)
    assert code == 0, err
    code, out, err = run_cli("verify", tmp_path / "q", "--reference", "acme/tiny-llama", "-q", *hub)
    assert code == 0 and out.strip() == "PASS", (out, err)
    data = tmp_path / "ids.jsonl"
    data.write_text('{"input_ids": [1, 5, 9, 13, 17, 21]}\n')
    code, out, err = run_cli("eval", tmp_path / "q", "--reference", "acme/tiny-llama", "--data", data, "-q", *hub)
    assert code == 0 and out.startswith("ppl "), (out, err)
    assert seen[-1]["cache_dir"] == str(cached_repo) and seen[-1]["token"] == "hf_given"
    code, out, err = run_cli("inspect", "acme/tiny-llama", "-q")  # without it: the default cache, empty
    assert_one_line_error(code, out, err, "acme/tiny-llama", "not in the local Hugging Face cache",
                          str(tmp_path / "default-cache"))  # the folder searched, named
    empty = tmp_path / "empty-cache"
    code, out, err = run_cli("inspect", "acme/tiny-llama", "-q", "--cache-dir", empty)
    assert_one_line_error(code, out, err, "acme/tiny-llama", f"local Hugging Face cache {empty} ")
