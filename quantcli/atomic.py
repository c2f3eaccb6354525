"""Durable, all-or-nothing file writes: the content goes to `NAME.tmp` beside the target, is
flushed and fsynced, then renamed over the target (a rename within a folder is atomic on POSIX).
A crash or kill at any point leaves the old file or the new one, never a torn one, and any
failure removes the temporary file. Every file quantcli writes that a later run reads (shards,
staged layers, progress records, calibration caches, the model card) goes through here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """An open binary file whose content replaces `path` when the block ends without error."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    """`data` (text as UTF-8) as the whole content of `path`, atomically and durably."""
    with atomic_file(path) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
