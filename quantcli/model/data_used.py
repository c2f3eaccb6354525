"""How much of the calibration data a run used, of how much the data holds: samples (those
--calibration-samples keeps) and tokens (each sample cut to --calibration-seq-len), so that the
convert summary, its --json and the manifest say `190 of 190 samples, 48,211 of 61,007 tokens`
rather than leave a dropped part of the data unsaid."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from quantcli.formats.facts import Calibration
from quantcli.model.samples import samples_held, token_ids

UNCUT = 2**31 - 1  # a seq_len that cuts no sample (tokenizers take max_length as a machine integer)


@dataclass(frozen=True)
class DataUsed:
    samples_in_data: int | None  # None: a Hub dataset, streamed only as far as --calibration-samples
    tokens: int  # the tokens run: the samples kept, each cut to seq_len
    tokens_in_data: int | None  # those of every sample in the data, uncut


def data_used(cal: Calibration, source_root: Path) -> DataUsed:
    held = samples_held(cal)
    tokens = sum(map(len, token_ids(cal, source_root)))
    return DataUsed(held, tokens, tokens_held(cal, source_root, held))


def tokens_held(cal: Calibration, source_root: Path, held: int | None) -> int | None:
    """The tokens of all `held` samples of the data, uncut (None: a Hub dataset, not read to its end)."""
    # tokenized again, uncut, only to count: one more tokenizer pass over the data
    return None if held is None else sum(map(len, token_ids(replace(cal, samples=held, seq_len=UNCUT), source_root)))
