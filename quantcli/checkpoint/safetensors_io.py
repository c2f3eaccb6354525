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
import stat
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

import torch

from quantcli.errors import CheckpointError

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
# Every dtype name the safetensors format defines. Those quantcli cannot hold as whole bytes per
# element (complex, sub-byte floats) are refused by name rather than misread.
UNSUPPORTED_DTYPES = {"C64": "complex", "F4": "4-bit packed", "F6_E2M3": "6-bit packed", "F6_E3M2": "6-bit packed"}
MAX_HEADER = 100_000_000  # the safetensors library's own limit


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
    data_offset: int  # absolute offset of the data section (-1: read remotely, no local file yet)
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def data_size(self) -> int:
        """Bytes of the data section: validation made the tensors cover it exactly."""
        return max((t.end for t in self.tensors.values()), default=0)


def _corrupt(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: {what}; the file is corrupt (re-download or re-save it)")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {dup!r} appears twice")
    return dict(pairs)


def _is_count(v: object) -> bool:
    """A JSON non-negative integer (bool is an int in Python, not in JSON)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _decode_header(raw: bytes, path: str) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _corrupt(path, "safetensors header is not UTF-8 text") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise _corrupt(path, "safetensors header nests too deeply to be JSON a writer made") from None
    except ValueError as exc:
        raise _corrupt(path, f"safetensors header is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _corrupt(path, f"safetensors header is a JSON {type(obj).__name__}, not an object")
    return obj


def _metadata(obj: dict, path: str) -> dict[str, str]:
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "'__metadata__' must map strings to strings")
    return metadata


def _tensor_info(name: str, spec: object, path: str) -> TensorInfo:
    """One header entry, checked field by field as the safetensors library does."""
    where = f"tensor {name!r}"
    if not isinstance(spec, dict):
        raise _corrupt(path, f"{where} has a header entry that is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str):
        raise _corrupt(path, f"{where} has dtype {dtype!r}, not a dtype name")
    if dtype in UNSUPPORTED_DTYPES:
        raise CheckpointError(f"{path}: {where} has dtype {dtype} ({UNSUPPORTED_DTYPES[dtype]}), which quantcli "
                              f"cannot read; only real float, integer and bool tensors are supported")
    if dtype not in ITEMSIZE:
        raise _corrupt(path, f"{where} has unknown dtype {dtype!r} (known: {', '.join(sorted(ITEMSIZE))})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise _corrupt(path, f"{where} has shape {shape!r}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _corrupt(path, f"{where} has data_offsets {offsets!r}; they must be [begin, end] with "
                             f"0 <= begin <= end")
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    if info.numel * ITEMSIZE[dtype] != info.nbytes:
        raise _corrupt(path, f"{where} spans {info.nbytes} bytes but {dtype}{list(shape)} needs "
                             f"{info.numel * ITEMSIZE[dtype]}")
    return info


def _check_layout(tensors: dict[str, TensorInfo], path: str, buffer_size: int | None) -> None:
    """Sorted by offset, the tensors are contiguous from 0, never overlap, and end where the data
    section ends: no byte is read by two tensors or by none (as safetensors validates)."""
    ordered = sorted(tensors.values(), key=lambda t: (t.start, t.end, t.name))
    _check_overlaps(ordered, path)  # first: two tensors on the same bytes also leave bytes for none
    expected, previous = 0, None
    for info in ordered:
        if info.start != expected:
            raise _corrupt(path, f"bytes {expected}-{info.start} of the data section belong to no tensor "
                                 f"(before tensor {info.name!r})")
        expected, previous = info.end, info.name
    if buffer_size is not None and expected != buffer_size:
        if expected > buffer_size:
            raise CheckpointError(f"{path}: tensor {previous!r} ends {expected - buffer_size} bytes past the end "
                                  f"of the file; the file is truncated (re-download or re-save it)")
        raise _corrupt(path, f"the data section holds {buffer_size} bytes but the tensors cover {expected}")


def _check_overlaps(ordered: list[TensorInfo], path: str) -> None:
    """Two tensors that claim the same bytes, both named (in start order, against the one that
    reaches furthest so far)."""
    far = None
    for info in ordered:
        if far is not None and info.start < far.end:
            raise _corrupt(path, f"tensors {far.name!r} and {info.name!r} have the same data_offsets "
                                 f"[{info.start}, {info.end}]" if (info.start, info.end) == (far.start, far.end) else
                                 f"tensor {info.name!r} (bytes {info.start}-{info.end}) overlaps tensor {far.name!r} "
                                 f"(bytes {far.start}-{far.end})")
        far = info if far is None or info.end > far.end else far


def parse_header(raw: bytes, path: str, data_offset: int, file_size: int | None = None) -> Header:
    """Validate a whole header before anything reads data. `file_size` None: a header read remotely,
    whose data section cannot be measured yet (it is checked again once downloaded)."""
    obj = _decode_header(raw, path)
    metadata = _metadata(obj, path)
    tensors = {name: _tensor_info(name, spec, path) for name, spec in obj.items()}
    _check_layout(tensors, path, None if file_size is None else file_size - data_offset)
    return Header(path, data_offset, tensors, metadata)


def open_regular_file(path: str):
    """Open for reading only if the path (symlinks followed) is a regular file: opening a FIFO
    would block forever and reading a device never ends. O_NONBLOCK keeps the open itself from
    blocking on a FIFO; it changes nothing for regular files."""
    _require_regular(path, os.stat(path).st_mode)  # a socket cannot even be opened: say what it is
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(path, os.fstat(fd).st_mode)  # the file opened, should it have been swapped
    except CheckpointError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def _require_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise CheckpointError(f"{path}: is {kind}, not a regular file; point at the checkpoint's real files")


def read_header(path: str | os.PathLike) -> Header:
    path = str(path)
    try:
        with open_regular_file(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file "
                                      f"(it needs an 8-byte header length); the file is corrupt or truncated")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} is invalid for a {size}-byte file; "
                                      f"not a safetensors file, or truncated")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return parse_header(raw, path, 8 + n, size)


class TensorReader:
    """Reads single tensors from one safetensors file through a read-only memory map, as
    safetensors does: `raw` is a zero-copy view of the exact bytes, `tensor` a read-only torch
    tensor over them (no copy until a kernel upcasts it chunk by chunk)."""

    def __init__(self, header: Header):
        self.header = header
        try:
            with open_regular_file(header.path) as f:
                self._check_size(os.fstat(f.fileno()).st_size)
                # The map outlives the file object; views into it may outlive close() (they keep it alive).
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if header.data_size else b""
        except OSError as exc:
            raise CheckpointError(f"{header.path}: cannot read ({exc.strerror or exc})") from None

    def _check_size(self, size: int) -> None:
        """The header was validated against the file's size when it was read; the file may have
        changed since. A mapped read past the end of a file kills the process (SIGBUS), so the
        size of the very file being mapped (fstat on the same descriptor) must still match."""
        expected = self.header.data_offset + self.header.data_size
        if size < expected:
            raise CheckpointError(f"{self.header.path}: {size} bytes, but its header needs {expected}; the file "
                                  f"is truncated or changed while quantcli ran (re-download or re-save it)")
        if size > expected:
            raise CheckpointError(f"{self.header.path}: {size} bytes, but its header describes {expected}; the "
                                  f"file changed while quantcli ran, run the command again")

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
            raise CheckpointError(f"{self.header.path}: tensor {name!r} has dtype {info.dtype}, "
                                  "which torch cannot read")
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


# Tensors at least this big are hashed while they are written. Copying into the page cache and
# SHA-256 each take about as long per byte (1.2 s and 0.4 s for 0.72 GB of fp8 codes on a 2-core
# VM), and one after the other they were the longest chain of an fp8 convert.
OVERLAP_BYTES = 1 << 20


class ShardWriter:
    """Writes one safetensors file: the header first, then tensors in header order. It hashes
    what it writes (`sha256`, `size`), so nobody has to read the file back to checksum it."""

    def __init__(self, f: BinaryIO, specs: Iterable[OutSpec], metadata: dict[str, str] | None = None):
        header, self.order = build_header(specs, metadata)
        self._f = f
        self._hash = hashlib.sha256()
        self._hasher: ThreadPoolExecutor | None = None  # started by the first big tensor, ended by finish
        self.size = 0
        self._emit(header)
        self._next = 0

    def _emit(self, data: memoryview | bytes) -> None:
        if len(data) < OVERLAP_BYTES:
            self._f.write(data)
            self._hash.update(data)
        else:  # hash on a second thread while this one writes: both release the GIL
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="quantcli-hash")
            hashing = self._hasher.submit(self._hash.update, data)
            try:
                self._f.write(data)
            finally:
                hashing.result()  # in order: the next tensor's bytes are hashed after these
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
        if self._hasher is not None:  # no thread outlives the file (nothing left to join at exit)
            self._hasher.shutdown()
            self._hasher = None
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
