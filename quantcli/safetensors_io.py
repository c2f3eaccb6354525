"""safetensors files at the byte level: read headers without data, read one tensor, stream-write.

Reading the header ourselves lets `plan`, `inspect` and `--dry-run` look at a 1 TB checkpoint
without touching tensor data, and lets unquantized tensors pass through as raw bytes (bit
identical, no dtype round trip). The writer takes the full header up front (every output
shape and dtype is known from the plan) and then streams one tensor at a time, so memory never
holds a whole shard.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from .errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # byte offset from the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    path: str
    data_offset: int  # absolute offset of the data section
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def parse_header(raw: bytes, path: str, data_offset: int, file_size: int | None = None) -> Header:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc}); the file is corrupt") from None
    metadata = obj.pop("__metadata__", None) or {}
    tensors = {}
    for name, spec in obj.items():
        try:
            dtype, shape, (start, end) = spec["dtype"], tuple(int(d) for d in spec["shape"]), spec["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from None
        info = TensorInfo(name, dtype, shape, int(start), int(end))
        if dtype in ITEMSIZE and info.numel * ITEMSIZE[dtype] != info.nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} spans {info.nbytes} bytes but "
                                  f"{dtype}{list(shape)} needs {info.numel * ITEMSIZE[dtype]}; the file is corrupt")
        if file_size is not None and data_offset + info.end > file_size:
            raise CheckpointError(f"{path}: tensor {name!r} ends past the end of the file; the file is truncated")
        tensors[name] = info
    return Header(path, data_offset, tensors, metadata)


def read_header(path: str | os.PathLike) -> Header:
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} is invalid; not a safetensors file")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    return parse_header(raw, path, 8 + n, size)


class TensorReader:
    """Reads single tensors from one safetensors file through a read-only memory map, as
    safetensors does: `raw` is a zero-copy view of the exact bytes, `tensor` a read-only torch
    tensor over them (no copy until a kernel upcasts it chunk by chunk)."""

    def __init__(self, header: Header):
        self.header = header
        with open(header.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # The map outlives the file object; views into it may outlive close() (they keep it alive).
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""

    def raw(self, name: str) -> memoryview:
        info = self.header.tensors[name]
        start = self.header.data_offset + info.start
        view = memoryview(self._map)[start: start + info.nbytes]
        if len(view) != info.nbytes:
            raise CheckpointError(f"{self.header.path}: tensor {name!r} is cut short; the file is truncated")
        return view

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header.tensors[name]
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{self.header.path}: tensor {name!r} has dtype {info.dtype}, which torch cannot read")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=DTYPES[info.dtype])
        with warnings.catch_warnings():  # read-only on purpose: nothing writes into a source
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(self.raw(name), dtype=DTYPES[info.dtype])
        return t.reshape(info.shape)

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process (they stay in the page cache and fault back
        in if read again): memory then tracks the tensor in flight, not the file."""
        if not isinstance(self._map, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.header.tensors[name]
        start = (self.header.data_offset + info.start) // mmap.PAGESIZE * mmap.PAGESIZE
        end = self.header.data_offset + info.end
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self._map = b""  # dropped, not closed: tensors still viewing it keep the mapping alive

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class OutSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n


def build_header(specs: Iterable[OutSpec], metadata: dict[str, str] | None = None) -> tuple[bytes, list[OutSpec]]:
    """The header bytes for tensors written in sorted-name order (deterministic output)."""
    ordered = sorted(specs, key=lambda s: s.name)
    obj: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for s in ordered:
        obj[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data section, as safetensors does
    return struct.pack("<Q", len(raw)) + raw, ordered


def tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy())


class ShardWriter:
    """Writes one safetensors file: the header first, then tensors in header order. It hashes
    what it writes (`sha256`, `size`), so nobody has to read the file back to checksum it."""

    def __init__(self, f: BinaryIO, specs: Iterable[OutSpec], metadata: dict[str, str] | None = None):
        header, self.order = build_header(specs, metadata)
        self._f = f
        self._hash = hashlib.sha256()
        self.size = 0
        self._emit(header)
        self._next = 0

    def _emit(self, data: memoryview | bytes) -> None:
        self._f.write(data)
        self._hash.update(data)
        self.size += len(data)

    def write(self, name: str, data: memoryview | bytes) -> None:
        spec = self.order[self._next]
        if spec.name != name or len(data) != spec.nbytes:
            raise RuntimeError(f"internal: expected {spec.name} ({spec.nbytes} bytes), got {name} ({len(data)})")
        self._emit(data)
        self._next += 1

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def finish(self) -> None:
        if self._next != len(self.order):
            raise RuntimeError(f"internal: {len(self.order) - self._next} tensors were not written")


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def write_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Small helper (tests, fixtures): write a whole dict with the streaming writer."""
    specs = [OutSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    with open(path, "wb") as f:
        w = ShardWriter(f, specs, metadata)
        for s in w.order:
            w.write(s.name, tensor_bytes(tensors[s.name]))
        w.finish()
