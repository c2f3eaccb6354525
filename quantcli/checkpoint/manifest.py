"""The quantcli manifest (`quantcli_manifest.json`): a self-describing account of every quantized
tensor, independent of any runtime's config schema (docs/formats.md, "The manifest").

Written last, so its presence means the output is complete.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

from quantcli.checkpoint.safetensors_io import Header
from quantcli.errors import ManifestError

MANIFEST_NAME = "quantcli_manifest.json"
SCHEMA_VERSION = 1
# convert writes DST as DST.partial and renames it at the end; its own files there (the progress
# record, the lock, the calibration cache, the ranks' records) are named .quantcli-*.
STAGING_SUFFIX = ".partial"
STAGING_FILE_PREFIX = ".quantcli-"


def is_staging(folder: Path) -> bool:
    """Whether `folder` is convert's staging folder: DST.partial holding quantcli's own files."""
    if not folder.name.endswith(STAGING_SUFFIX) or not folder.is_dir():
        return False
    return any(p.name.startswith(STAGING_FILE_PREFIX) or p.name == MANIFEST_NAME for p in folder.iterdir())


def finish_hint(dst: Path) -> str:
    """How to finish the conversion into `dst` (push, inspect, verify and convert say it alike)."""
    return (f"finish it with `quantcli convert SRC {dst} --resume` (the same SRC and options as the run that "
            f"started it; --overwrite instead starts over)")


def unfinished_conversion(path: Path) -> str | None:
    """What to say when `path` is a staging folder, or a missing DST whose staging folder exists
    (None otherwise): that it is an unfinished conversion, and how to finish it."""
    if is_staging(path):
        dst = path.with_name(path.name[: -len(STAGING_SUFFIX)])
        return (f"{path}: a staging folder of an unfinished conversion into {dst} (running, or interrupted); "
                f"{finish_hint(dst)}, then use {dst}")
    stage = path.with_name(path.name + STAGING_SUFFIX)
    if path.name and not path.exists() and is_staging(stage):
        return (f"{path}: does not exist yet: {stage} beside it is an unfinished conversion into it (running, or "
                f"interrupted); {finish_hint(path)}")
    return None


@dataclass(frozen=True)
class DiskEntry:
    name: str
    role: str  # codes | block_scale | global_scale
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    encoding: str  # e4m3fn | e2m1x2 | f32 | e8m0_bias127
    direction: str | None = None  # multiply | divide
    value: float | None = None  # global scales: the number written


@dataclass(frozen=True)
class ModuleEntry:
    module: str
    source_name: str
    source_dtype: str
    logical_shape: tuple[int, ...]
    recipe: str
    block: tuple[int, int]  # rows x cols of W per block scale; 0 = whole dimension
    axis: int  # the dimension blocks run along (always -1: the input dim K)
    element: str  # e4m3fn | e2m1
    packing: str | None  # e2m1x2 (two codes per byte) or None
    nibble_order: str | None  # low_first: byte = code[2j] | code[2j+1] << 4
    scale_rule: str  # amax/448 | amax/2688 | floor | even | rceil
    element_rounding: str  # rne_sat
    zero_block_policy: str
    scale_layout: str  # linear (row-major, never swizzled)
    transposed_from_source: bool
    fused_group: str | None
    tensors: tuple[DiskEntry, ...]
    # Re-quantized from a quantized source (convert SRC DST --recipe OTHER): the source's recipe and
    # the relative L2 error against the decoded source. verify adds it to the yardstick against the
    # original dense model. Optional: written only when set, so other manifests keep their bytes.
    requantized_from: str | None = None
    requantize_rel_err: float | None = None
    # How block scales were chosen when not by absmax: "mse" (kernels/search.py). Absent for
    # absmax, so those manifests keep their bytes.
    scale_search: str | None = None
    # What weighted the search's squared error per input channel: "input_channel_ms" (the mean
    # squared input, from the calibration recorded under `calibration`); absent when data-free.
    # verify --exact needs that calibration (--calibration DATA) to reproduce these bytes.
    scale_search_weights: str | None = None
    # Data-aware rounding (GPTQ): how this module was rounded ("gptq", or "nearest" with the
    # reason), the calibration tokens that reached it, and the layer-output error
    # ||(W - Q) X||^2 / ||W X||^2 on them of what is written and of round to nearest.
    # Absent when every module was rounded to nearest by the recipe alone.
    rounding: Mapping[str, object] | None = None


OPTIONAL_MODULE_FIELDS = ("requantized_from", "requantize_rel_err", "scale_search", "scale_search_weights",
                          "rounding")


@dataclass(frozen=True)
class Manifest:
    quantcli_version: str
    layout: str
    recipe: str
    source: Mapping[str, str | None]
    fingerprint: str
    modules: tuple[ModuleEntry, ...]
    excluded: tuple[str, ...]
    lossless: bool = False  # True for a re-layout: no value changed
    notes: tuple[str, ...] = field(default_factory=tuple)
    schema_version: int = SCHEMA_VERSION
    # A calibrated run: the data (file name and SHA-256), how much of it ran, what it calibrated
    # (`quantcli verify --calibration` reruns it). Optional: absent from uncalibrated manifests.
    calibration: Mapping[str, object] | None = None
    # Data-aware rounding: the method and its parameters (the per-module account is in `modules`).
    rounding: Mapping[str, object] | None = None
    # Exact transforms applied to the source's weights before rounding (planning/transforms.py):
    # enough to recompute each changed tensor (verify and eval compare against the transformed source).
    transforms: Mapping[str, object] | None = None
    # convert --auto: the candidates, the budget, each group's options (bits as written, predicted
    # error from its modules' scores) and the choice (planning/auto.py AutoChoice.record).
    auto: Mapping[str, object] | None = None

    def to_json(self) -> str:
        doc = asdict(self)
        for key in ("calibration", "rounding", "transforms", "auto"):
            if doc[key] is None:
                del doc[key]
        for m in doc["modules"]:
            for key in OPTIONAL_MODULE_FIELDS:
                if m[key] is None:
                    del m[key]
        return json.dumps(doc, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        try:
            obj = json.loads(text)
        except ValueError as exc:
            raise ManifestError(f"{MANIFEST_NAME}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ManifestError(f"{MANIFEST_NAME}: expected a JSON object")
        version = obj.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestError(f"{MANIFEST_NAME}: schema_version {version!r} is not {SCHEMA_VERSION}; "
                                f"upgrade quantcli to read it")
        try:
            modules = tuple(
                ModuleEntry(**{**m, "logical_shape": tuple(m["logical_shape"]), "block": tuple(m["block"]),
                               "tensors": tuple(DiskEntry(**{**t, "shape": tuple(t["shape"])}) for t in m["tensors"])})
                for m in obj["modules"])
            return cls(**{**obj, "modules": modules, "excluded": tuple(obj["excluded"]),
                          "notes": tuple(obj.get("notes", ()))})
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"{MANIFEST_NAME}: missing or malformed field ({exc})") from None

    def check_headers(self, headers: Mapping[str, Header]) -> list[str]:
        """Problems where the manifest and the safetensors headers disagree (empty when they agree)."""
        where = {n: h.tensors[n] for h in headers.values() for n in h.tensors}
        problems = []
        for m in self.modules:
            for t in m.tensors:
                info = where.get(t.name)
                if info is None:
                    problems.append(f"{t.name}: listed in the manifest but missing from the checkpoint")
                elif info.dtype != t.dtype or tuple(info.shape) != tuple(t.shape):
                    problems.append(f"{t.name}: manifest says {t.dtype}{list(t.shape)}, file has "
                                    f"{info.dtype}{list(info.shape)}")
        return problems
