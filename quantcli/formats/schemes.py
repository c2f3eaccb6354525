"""llm-compressor's scheme names (compressed-tensors' preset schemes, `quantization/quant_scheme.py`
PRESET_SCHEMES, 0.19.0 as llm-compressor 0.14 pins it) and the quantcli conversion that writes the
same compressed-tensors config: for users coming from `QuantizationModifier(scheme=...)`.
`quantcli recipes` lists it (also --json), docs/formats.md shows it (scripts/engines_table.py).

A scheme whose recipe is not in the registry yet is listed as coming; adding the recipe is all
it takes to list it as available (one row per scheme here)."""

from __future__ import annotations

from dataclasses import dataclass

from quantcli.recipes import RECIPES

LAYOUT = "compressed-tensors"  # what llm-compressor writes
STATIC = "--activations static --calibration DATA"
_F32 = "F32 scales (llm-compressor: the model dtype)"


@dataclass(frozen=True)
class Scheme:
    name: str  # the preset name
    weights: str  # what the preset quantizes (CT 0.19 PRESET_SCHEMES), in brief
    activations: str
    recipe: str  # the quantcli recipe that writes the same weights
    flags: str = ""  # beyond --recipe and --layout: what makes the config the same
    note: str = ""  # where quantcli's output differs from the preset's


SCHEMES = (
    Scheme("FP8", "fp8, per tensor", "fp8 per tensor, static", "fp8", STATIC),
    Scheme("FP8_DYNAMIC", "fp8, per channel", "fp8 per token, dynamic", "fp8-channel",
           note=_F32),
    Scheme("FP8_BLOCK", "fp8, 128x128 blocks", "fp8 per 128-group, dynamic", "fp8-block",
           note=_F32),
    Scheme("W8A8", "int8, per channel", "int8 per token, dynamic", "int8-channel", note="also named INT8"),
    Scheme("W4A16", "int4, groups of 128", "none", "int4"),
    Scheme("NVFP4A16", "nvfp4, groups of 16", "none", "nvfp4"),
    Scheme("NVFP4", "nvfp4, groups of 16", "nvfp4, static global scale", "nvfp4", STATIC),
    Scheme("MXFP4A16", "mxfp4, groups of 32", "none", "mxfp4"),
    Scheme("MXFP4", "mxfp4, groups of 32", "mxfp4, dynamic", "mxfp4",
           note="written weight-only, as MXFP4A16"),
    Scheme("MXFP8A16", "mxfp8, groups of 32", "none", "mxfp8"),
    Scheme("MXFP8", "mxfp8, groups of 32", "mxfp8, dynamic", "mxfp8",
           note="written weight-only, as MXFP8A16"),
)


@dataclass
class SchemeInfo:
    """One llm-compressor scheme and how quantcli writes it (`quantcli recipes --json`)."""

    scheme: str
    weights: str
    activations: str
    recipe: str
    available: bool  # the recipe is in quantcli's registry (else it is coming)
    options: str  # the convert options: --recipe, --layout where not the default, flags
    note: str


def scheme_infos() -> list[SchemeInfo]:
    out = []
    for s in SCHEMES:
        available = s.recipe in RECIPES
        layout = "" if available and RECIPES[s.recipe].default_layout == LAYOUT else f" --layout {LAYOUT}"
        options = f"--recipe {s.recipe}{layout}" + (f" {s.flags}" if s.flags else "")
        out.append(SchemeInfo(s.name, s.weights, s.activations, s.recipe, available, options, s.note))
    return out


def recipe_label(info: SchemeInfo) -> str:
    return info.recipe if info.available else f"{info.recipe} (coming)"


__all__ = ["SCHEMES", "Scheme", "SchemeInfo", "recipe_label", "scheme_infos"]
