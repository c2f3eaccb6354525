"""Recognise a checkpoint's quantization layout and which recipe each module carries.

Shared by `inspect`, `verify` and `convert` from quantized sources. Detection reads configs and
tensor names only (no data)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantcli.checkpoint.manifest import MANIFEST_NAME, Manifest
from quantcli.checkpoint.safetensors_io import DTYPES, dtype_name
from quantcli.checkpoint.source import Source, load_config
from quantcli.formats.layouts import LAYOUTS, Layout
from quantcli.formats.layouts.base import BLOCKS16, Role
from quantcli.recipes import RECIPES


@dataclass
class Detected:
    layout: Layout
    modules: dict[str, str]  # module -> recipe
    manifest: Manifest | None
    extra_files: dict[str, dict]


def extra_files(source: Source) -> dict[str, dict]:
    """ModelOpt's hf_quant_config.json, read and type-checked like config.json (source.load_config):
    a corrupt or wrongly typed one is refused by name rather than read as empty."""
    out = {}
    path = source.root / "hf_quant_config.json"
    if path.exists():
        out["hf_quant_config.json"] = load_config(path)
    return out


def read_manifest(source: Source) -> Manifest | None:
    path = source.root / MANIFEST_NAME
    return Manifest.from_json(path.read_text()) if path.exists() else None


def all_names(source: Source) -> dict[str, str]:
    """tensor name -> shard (the index decides for duplicated names): see source.assign_owners."""
    return source.owners()


def detect_layout(source: Source, manifest: Manifest | None, extras: dict[str, dict]) -> Layout | None:
    if manifest is not None:
        return LAYOUTS.get(manifest.layout)
    config = config_with_extras(source, extras)
    for layout in LAYOUTS.values():
        if layout.detect(config, extras):
            return layout
    return None


def config_with_extras(source: Source, extras: dict[str, dict]) -> dict:
    config = dict(source.config)
    if extras.get("hf_quant_config.json"):
        config["hf_quant_config"] = extras["hf_quant_config.json"]
    return config


def quantized_modules(source: Source, layout: Layout, manifest: Manifest | None,
                      extras: dict[str, dict]) -> dict[str, str]:
    if manifest is not None:
        return {m.module: m.recipe for m in manifest.modules}
    return layout.quantized_modules(all_names(source), config_with_extras(source, extras))


def detect(source: Source) -> Detected | None:
    extras = extra_files(source)
    manifest = read_manifest(source)
    layout = detect_layout(source, manifest, extras)
    if layout is None:
        return None
    return Detected(layout, quantized_modules(source, layout, manifest, extras), manifest, extras)


# ---------------------------------------------------------------- what the tensors themselves say

# Float dtypes a producer may store an FP32-meaning scale in: llm-compressor writes FP8-family
# scales in the model's dense dtype (docs/formats.md, "compressed-tensors presets"). Each widens
# to FP32 exactly, so reading them loses nothing; quantcli itself always writes F32 (what every
# consumer expects).
FLOAT_SCALE_DTYPES = ("F32", "BF16", "F16")


def stored_as_expected(expected_dtype: str, expected_shape: tuple[int, ...], dtype: str,
                       shape: tuple[int, ...]) -> bool:
    """Whether a stored tensor is readable as the one a layout expects: the same dtype (any float
    dtype for an F32 scale) and shape (any one-element shape for a scalar: ModelOpt writes 0-d,
    compressed-tensors [1], and vLLM accepts both)."""
    if dtype != expected_dtype and not (expected_dtype == "F32" and dtype in FLOAT_SCALE_DTYPES):
        return False
    if tuple(shape) == tuple(expected_shape):
        return True
    return math.prod(expected_shape) == 1 and math.prod(shape) == 1 and len(shape) <= 1 and len(expected_shape) <= 1


def stored_weight_dtype(layout: Layout, module: str, recipe, tensors):
    """The weight dtype a stored module was quantized in, as far as its scales say: the block
    scale's own float dtype for scales of the weight's dtype (int4: BF16, F16 or F32 alike are
    what a producer writes for such a model), else F32 (the other codecs do not depend on it)."""
    if recipe.scale_codec.dtype is None:
        for d in layout.describe(module, recipe):
            if d.role == Role.BLOCK_SCALE and d.name in tensors and tensors.info(d.name).dtype in FLOAT_SCALE_DTYPES:
                return DTYPES[tensors.info(d.name).dtype]
    return torch.float32


def disk_problems(layout: Layout, module: str, recipe, logical_shape: tuple[int, ...], tensors) -> list[str]:
    """Stored tensors of `module` whose dtype or shape the layout cannot read as `recipe`."""
    problems = []
    weight_dtype = stored_weight_dtype(layout, module, recipe, tensors)
    for name, dtype, shape in layout.output_specs(module, recipe, logical_shape, weight_dtype):
        if name in tensors:
            info = tensors.info(name)
            expected = dtype_name(dtype)
            if not stored_as_expected(expected, shape, info.dtype, tuple(info.shape)):
                floats = " (or BF16/F16)" if expected == "F32" else ""
                problems.append(f"{name} is {info.dtype}{list(info.shape)}, {layout.name} {recipe.name} "
                                f"expects {expected}{floats}{list(shape)}")
    return problems


def recipes_the_tensors_allow(module: str, tensors) -> set[str]:
    """Every recipe the stored dtypes and shapes of `module` are consistent with, ignoring the config.

    Shapes alone can be ambiguous (a [1, 32] fp8-channel weight has a [1, 1] scale, like fp8 and
    fp8-block), so this returns a set: the config's recipe wins whenever it is in it."""
    codes_row = next((r for r in _rows_of(Role.CODES) if f"{module}{r.suffix}" in tensors), None)
    scale_row = next((r for r in _rows_of(Role.BLOCK_SCALE) if f"{module}{r.suffix}" in tensors), None)
    if codes_row is None or scale_row is None:
        return set()
    codes, scale = tensors.info(f"{module}{codes_row.suffix}"), tensors.info(f"{module}{scale_row.suffix}")
    if codes.dtype == "U8":  # FP4 pairs: the group size tells NVFP4 (16) from MXFP4 (32)
        k = codes.shape[-2] * 32 if codes_row.reshape == BLOCKS16 else codes.shape[-1] * 2
        group = k // max(1, scale.shape[-1]) if scale.shape else 0
        return {r for r, recipe in RECIPES.items()
                if recipe.element.safetensors_dtype == "U8" and recipe.element.packed and recipe.block == (1, group)}
    if codes.dtype == "I32" and len(codes.shape) >= 2:  # int4: eight codes per word, a float [N, K/128] scale
        return {r for r, recipe in RECIPES.items() if recipe.element.safetensors_dtype == "I32"
                and scale.dtype in FLOAT_SCALE_DTYPES and tuple(scale.shape) == recipe.scale_shape(
                    (*codes.shape[:-1], codes.shape[-1] * 32 // recipe.element_bits))}
    if codes.dtype == "I8" and len(codes.shape) >= 2:
        return {r for r in RECIPES if RECIPES[r].element.safetensors_dtype == "I8"}
    if codes.dtype != "F8_E4M3" or len(codes.shape) < 2:
        return set()
    # FP8 codes: every E4M3 recipe whose scale codec stores the scale dtype and whose scale grid,
    # for these codes, has the stored scale's shape once the layout's unit axes are dropped.
    n, k = codes.shape[-2], codes.shape[-1]
    stored = _without_unit_axes(scale.shape)
    out = {name for name, recipe in RECIPES.items()
           if recipe.element.safetensors_dtype == "F8_E4M3" and _scale_dtype_fits(recipe, scale.dtype)
           and _without_unit_axes(recipe.scale_shape((n, k))) == stored}
    named = _only_f32_recipe_named(scale_row.suffix)  # fp8's `weight_scale_inv` is fp8-block's alone
    if named is not None and RECIPES[named].element.safetensors_dtype == "F8_E4M3":
        out.add(named)
    return out


def _without_unit_axes(shape) -> tuple[int, ...]:
    """A scale shape as the grid it covers: [N, 1], [1] and [nb, 1, kb, 1] are [N], [] and [nb, kb]."""
    return tuple(d for d in shape if d != 1)


def _scale_dtype_fits(recipe, dtype: str) -> bool:
    """One-byte scale codecs (E8M0) are stored as U8; FP32 scales as F32 (or BF16/F16 by other producers)."""
    return (dtype == "U8") == (recipe.scale_codec.nbytes == 1 and not recipe.has_global_scale)


def codes_suffixes() -> tuple[str, ...]:
    """Every layout's suffixes of a module's codes tensor (`.weight`, `.weight_packed`, `_blocks`)."""
    return tuple(r.suffix for r in _rows_of(Role.CODES))


def _rows_of(role: str) -> list:
    """Every layout's rows of `role`, one per suffix (the union over all layout tables)."""
    rows = {}
    for layout in LAYOUTS.values():
        for table in layout.tables.values():
            for row in table:
                if row.role == role:
                    rows.setdefault(row.suffix, row)
    return list(rows.values())


def _only_f32_recipe_named(scale_suffix: str) -> str | None:
    """The one FP32-scaled recipe any layout stores under `scale_suffix` (fp8 `weight_scale_inv`
    is fp8-block's alone), or None when several share the name."""
    recipes = {r for layout in LAYOUTS.values() for r, table in layout.tables.items()
               if any(row.suffix == scale_suffix and row.role == Role.BLOCK_SCALE for row in table)
               and RECIPES[r].scale_encoding == "f32"}
    return recipes.pop() if len(recipes) == 1 else None


def tensors_look_like(module: str, recipe: str, tensors) -> str | None:
    """`recipe` when the tensors are consistent with it; otherwise what they look like (None when
    they say nothing). Only a contradiction between config and tensors is worth reporting."""
    allowed = recipes_the_tensors_allow(module, tensors)
    if not allowed or recipe in allowed:
        return recipe if allowed else None
    return sorted(allowed)[0]


# ---------------------------------------------------------------- scale values no producer writes
#
# docs/formats.md, "Zero blocks and scale values producers write": a global scale is finite
# and > 0 (modelopt's multiplier and compressed-tensors' divisor alike: 0 or Inf would zero or
# blow up the whole tensor); a float
# block or channel scale is finite and >= 0 (0 is what HF FineGrainedFP8 writes for an all-zero
# block); an E4M3 block scale is not NaN (0x7F/0xFF) and not negative (0 is legal: older
# modelopt wrote it for tiny blocks); an E8M0 byte is never 255 (NaN). Anything else means the
# source is corrupt, and converting it would write NaN, zero or sign-flipped weights.


def global_scale_fault(value: float) -> str | None:
    """What is wrong with a global scale's value, or None."""
    if not math.isfinite(value) or value <= 0:
        return f"global scale {value!r} (must be finite and > 0)"
    return None


def _first(bad, values, what: str, rule: str) -> str | None:
    """The first flagged element of a scale tensor, said with its index and the rule, or None."""
    if not bool(bad.any()):
        return None
    index = [int(i) for i in torch.nonzero(bad)[0]]
    value = values[tuple(index)].item() if index else values.item()
    return f"{what} {value!r} at {index} ({int(bad.sum())} such value(s); {rule})"


def block_scale_fault(encoding: str, stored) -> str | None:
    if encoding == "e8m0_bias127":
        b = stored.view(torch.uint8)
        return _first(b == 255, b, "E8M0 block scale byte", "255 is NaN; must be 0..254")
    if encoding == "e4m3fn":
        b = stored.view(torch.uint8)
        nan = (b & 0x7F) == 0x7F
        negative = ((b & 0x80) != 0) & ((b & 0x7F) != 0) & ~nan
        as_float = b.view(torch.float8_e4m3fn).to(torch.float32)
        return _first(nan | negative, as_float, "E4M3 block scale", "must be >= 0 and not NaN")
    s = stored.to(torch.float32)
    return _first(~torch.isfinite(s) | (s < 0), s, "block scale", "must be finite and >= 0")


def scale_faults(layout: Layout, module: str, recipe, tensors) -> list[tuple[str, str]]:
    """(tensor name, what is wrong) for each scale tensor of `module` that holds a value no correct
    producer writes. Tensors that are missing or of a dtype the layout cannot read are skipped:
    `disk_problems` reports those."""
    faults = []
    for d in layout.describe(module, recipe):
        if d.role == Role.CODES or d.name not in tensors:
            continue
        if d.role == Role.SHAPE:  # no scale: from_disk checks it against the codes
            continue
        dtype = tensors.info(d.name).dtype
        readable = FLOAT_SCALE_DTYPES if d.encoding in ("f32", "weight_dtype") else ("F8_E4M3", "U8")
        if dtype not in readable:
            continue
        stored = tensors.get(d.name)
        if d.role == Role.GLOBAL_SCALE:
            values = stored.to(torch.float32).reshape(-1)
            fault = next((f for f in map(global_scale_fault, values.tolist()) if f), None)
        else:
            fault = block_scale_fault(d.encoding, stored)
        tensors.release(d.name)
        if fault:
            faults.append((d.name, fault))
    return faults
