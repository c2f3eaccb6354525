"""ShardWriter: the sha256 it records is the file's, whether a tensor was hashed on the writing
thread or (1 MiB and more) on a second thread while it was written."""

from __future__ import annotations

import hashlib

import pytest
import torch

from quantcli.checkpoint.safetensors_io import OVERLAP_BYTES, OutSpec, ShardWriter, dtype_name, tensor_bytes, write_file


def test_shard_writer_hash_is_the_files_sha256_with_and_without_overlap(tmp_path):
    """Tensors of 1 MiB and more are hashed on a second thread while they are written; the
    recorded sha256 is still the file's, in order, and a failed write still raises."""
    tensors = {f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8)
               for i, n in enumerate([10, OVERLAP_BYTES, 3 * OVERLAP_BYTES + 5, 7, OVERLAP_BYTES - 1])}
    path = tmp_path / "a.safetensors"
    write_file(path, tensors)
    specs = [OutSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with open(tmp_path / "b.safetensors", "wb") as f:
        w = ShardWriter(f, specs)
        for s in w.order:
            w.write(s.name, tensor_bytes(tensors[s.name]))
    assert w.sha256 == hashlib.sha256(path.read_bytes()).hexdigest() == \
        hashlib.sha256((tmp_path / "b.safetensors").read_bytes()).hexdigest()

    class Full:
        def write(self, data):
            if len(data) >= OVERLAP_BYTES:
                raise OSError(28, "No space left on device")

    w = ShardWriter(Full(), specs)
    with pytest.raises(OSError):
        for s in w.order:
            w.write(s.name, tensor_bytes(tensors[s.name]))
