"""Random access to a checkpoint's tensors by name, across shards (one open file per shard)."""

from __future__ import annotations

import warnings

import torch

from quantcli.checkpoint.safetensors_io import TensorInfo, TensorReader
from quantcli.checkpoint.source import Source


def same_bytes(a: memoryview, b: memoryview) -> bool:
    """Byte identity of two buffers (CheckpointTensors.raw), compared by torch (which releases the
    GIL: a memoryview comparison holds it, 3 s per GB, and freezes the progress bar meanwhile)."""
    if a.nbytes != b.nbytes:
        return False
    if a.nbytes == 0:
        return True
    with warnings.catch_warnings():  # read-only buffers (memory maps): only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.equal(torch.frombuffer(a, dtype=torch.uint8), torch.frombuffer(b, dtype=torch.uint8))


class CheckpointTensors:
    def __init__(self, source: Source):
        self.source = source
        self.where: dict[str, str] = source.owners()
        self._readers: dict[str, TensorReader] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def info(self, name: str) -> TensorInfo:
        return self.source.headers[self.where[name]].tensors[name]

    def _reader(self, shard: str) -> TensorReader:
        if shard not in self._readers:
            self._readers[shard] = TensorReader(self.source.local_header(shard))
        return self._readers[shard]

    def get(self, name: str):
        return self._reader(self.where[name]).tensor(name)

    def raw(self, name: str) -> memoryview:
        return self._reader(self.where[name]).raw(name)

    def release(self, name: str) -> None:
        self._reader(self.where[name]).release(name)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self) -> "CheckpointTensors":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
