"""What a conversion is asked to do and what it reports: plain data, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

Progress = Callable[[int, str], None]  # (bytes just done, current shard)


@dataclass
class RunOptions:
    device: str = "auto"
    backend: str = "auto"
    resume: bool = False
    overwrite: bool = False


@dataclass(frozen=True)
class Findings:
    """What converting some modules learned, per module, for the manifest and the summary."""

    globals: Mapping[str, float] = field(default_factory=dict)  # module -> global scale (multiplier)
    notes: Mapping[str, str] = field(default_factory=dict)  # module -> what the user must know
    errors: Mapping[str, float] = field(default_factory=dict)  # module -> re-quantize relative L2 error
    weighted: Mapping[str, str] = field(default_factory=dict)  # module -> what weighted its scale search
    rounding: Mapping[str, dict] = field(default_factory=dict)  # module -> how a weight pass rounded it

    @classmethod
    def merge(cls, parts: Iterable[Findings]) -> Findings:
        merged: dict[str, dict] = {"globals": {}, "notes": {}, "errors": {}, "weighted": {}, "rounding": {}}
        for part in parts:
            for key, found in merged.items():
                found.update(getattr(part, key))
        return cls(**merged)

    def note_list(self) -> list[str]:
        return [self.notes[m] for m in sorted(self.notes)]

    def to_json(self) -> dict[str, dict]:
        out = {"globals": dict(self.globals), "notes": dict(self.notes), "errors": dict(self.errors)}
        if self.weighted:  # only then: other progress records keep their form
            out["weighted"] = dict(self.weighted)
        if self.rounding:
            out["rounding"] = dict(self.rounding)
        return out


@dataclass(frozen=True)
class ShardResult:
    """Everything one shard's conversion produced besides its file: enough for --resume to
    rebuild the same manifest without converting the shard again."""

    size: int
    sha256: str
    found: Findings = field(default_factory=Findings)

    def to_json(self) -> dict:
        return {"size": self.size, "sha256": self.sha256, **self.found.to_json()}

    @classmethod
    def from_json(cls, rec: Mapping) -> ShardResult:
        return cls(rec["size"], rec["sha256"], Findings(dict(rec["globals"]), dict(rec["notes"]),
                                                        dict(rec["errors"]), dict(rec.get("weighted", {})),
                                                        dict(rec.get("rounding", {}))))


@dataclass
class ConvertResult:
    dst: Path
    seconds: float
    bytes_in: int
    bytes_out: int
    shards_written: int
    shards_resumed: int
    quantized: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    requantize_errors: dict[str, float] = field(default_factory=dict)
    already_complete: bool = False  # --resume found DST finished with the same fingerprint
    layers_resumed: tuple[int, int] = (0, 0)  # (rounded layers an interrupted run had staged, layers)
    wall_seconds: float | None = None  # since the process started (the command line sets it): start-up too
