"""The Layout type: a table of how each recipe's codes and scales are named, typed and shaped on disk.

On-disk names live only in the layout modules. Each layout declares, per recipe, the tensors a
quantized module is written as (`TensorRow`: suffix, role, reshape, direction, dtype) and the
optional per-module tensors it may also carry (activation and KV-cache scales, filled from
ModuleFacts). `to_disk`, `from_disk`, `describe` and `output_specs` here are generic over those
tables; the one place a global scale's direction (multiply vs divide) is applied is
`to_direction`. A layout module adds only its table and its config writer/reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Mapping

import torch

from quantcli.errors import LayoutError
from quantcli.formats.facts import NO_FACTS, ModuleFacts
from quantcli.formats.fused import FUSED_QKV
from quantcli.recipes import QuantizedTensor, Recipe, get_recipe

# Reads one on-disk tensor by name (from a checkpoint, or a dict in tests).
GetTensor = Callable[[str], torch.Tensor]

# Reshapes between quantcli's canonical form and the disk: canonical codes [..., N, K*bits/8] and
# scales `recipe.scale_shape` (0-d for a whole tensor, [..., N] per row).
SAME, SCALAR, ONE, COLUMN, BLOCK4D, BLOCKS16 = "same", "scalar", "one", "column", "block4d", "blocks16"


class Role(StrEnum):
    """What an on-disk tensor of a quantized module is (the manifest's `role`)."""

    CODES = "codes"
    BLOCK_SCALE = "block_scale"
    GLOBAL_SCALE = "global_scale"
    INPUT_SCALE = "input_scale"
    INPUT_GLOBAL_SCALE = "input_global_scale"
    SHAPE = "shape"  # the logical [N, K] as I64 (compressed-tensors' `weight_shape`): checked, never data


class Direction(StrEnum):
    """How a stored scale is applied: the multiplier itself, or its inverse (a divisor)."""

    MULTIPLY = "multiply"
    DIVIDE = "divide"


@dataclass(frozen=True)
class TensorRow:
    """One on-disk tensor of a quantized module: `<module><suffix>`."""

    suffix: str  # ".weight", ".weight_scale", "_blocks", ...
    role: Role
    reshape: str = SAME  # SAME | SCALAR (0-d) | ONE ([1]) | COLUMN ([N] -> [N, 1]) | BLOCK4D | BLOCKS16
    direction: Direction | None = None  # scales only
    dtype: torch.dtype | None = None  # None: the recipe's codec decides (codes, block scales)
    fact: str | None = None  # optional tensors: the ModuleFacts field (a multiplier) that fills it


@dataclass(frozen=True)
class DiskTensor:
    """One on-disk tensor of a quantized module, as the manifest records it."""

    name: str
    role: Role
    encoding: str  # e4m3fn | e2m1x2 | int8 | int4x2_offset8 | f32 | e8m0_bias127 | weight_dtype | int64
    direction: Direction | None  # scales only


def module_of(param: str) -> str:
    """`a.b.weight` -> `a.b`; a 3-D expert parameter without `.weight` names itself."""
    return param[: -len(".weight")] if param.endswith(".weight") else param


def to_direction(multiplier: torch.Tensor, direction: str | None) -> torch.Tensor:
    """A scale as stored: the multiplier itself, or its FP32 reciprocal for a divisor
    (compressed-tensors' `weight_global_scale = 1 / weight_scale_2`). Its own inverse, so
    `from_disk` uses it too: the ONE place the multiply <-> divide convention lives."""
    multiplier = multiplier.to(torch.float32)
    return 1.0 / multiplier if direction == Direction.DIVIDE else multiplier


def stored_value(multiplier: float, direction: str | None) -> float:
    """The number a scale tensor holds for a multiplier (for the manifest's `value`)."""
    return float(to_direction(torch.tensor(multiplier, dtype=torch.float32), direction))


def _reshape(t: torch.Tensor, rule: str) -> torch.Tensor:
    if rule == SCALAR:
        return t.reshape(())
    if rule == ONE:
        return t.reshape(1)
    if rule == COLUMN:
        return t.reshape(*t.shape, 1)
    if rule == BLOCK4D:
        nb, kb = t.shape
        return t.reshape(nb, 1, kb, 1)
    if rule == BLOCKS16:
        return t.reshape(*t.shape[:-1], t.shape[-1] // 16, 16)
    return t


class Layout:
    name: str = ""
    # recipe -> the tensors a module of that recipe is written as (codes row first)
    tables: Mapping[str, tuple[TensorRow, ...]] = {}
    # recipe -> optional per-module tensors, written only when the module's facts carry them
    optional: Mapping[str, tuple[TensorRow, ...]] = {}
    # KV-cache scales, relative to the attention module (docs/formats.md, "FP8 KV-cache scale names"); none when empty
    kv_scales: tuple[str, ...] = ()
    kv_scale_shape: tuple[int, ...] = ()  # F32, 0-d (modelopt) or [1] (compressed-tensors)
    # Recipes a producer writes in this layout that no serving engine loads: read (inspect,
    # verify, convert from them), never written, and verify fails them.
    unservable: tuple[str, ...] = ()
    # Recipes engines load in this layout only with calibrated static activation scales
    # (modelopt `quant_algo: FP8` reads an `input_scale` per Linear): refused without them.
    needs_static: tuple[str, ...] = ()
    default_scale_rule: str | None = None  # for MX recipes
    exclusion_key: str = ""
    experts_only = False  # the layout names 3-D MoE expert stacks only (gpt-oss)

    @property
    def recipes(self) -> tuple[str, ...]:
        """What quantcli writes in this layout."""
        return tuple(r for r in self.tables if r not in self.unservable)

    def supports(self, recipe: str) -> bool:
        return recipe in self.recipes

    def require(self, recipe: str, layouts_that_do: list[str]) -> None:
        if not self.supports(recipe):
            raise LayoutError(
                f"--layout {self.name} cannot hold recipe {recipe} (no engine loads that pair); "
                f"layouts that do: {', '.join(layouts_that_do) or 'none'}")

    def mix_problem(self, recipes: set[str]) -> str | None:
        """Why this layout cannot hold a checkpoint whose modules use all of `recipes` (several:
        `[[override]]` mixes), or None. One recipe per checkpoint unless the layout says more."""
        return None if len(recipes) <= 1 else "one recipe per checkpoint"

    def require_mix(self, recipes: set[str], layouts_that_can: list[str]) -> None:
        problem = self.mix_problem(recipes)
        if problem is not None:
            raise LayoutError(
                f"--layout {self.name} cannot hold the mix {', '.join(sorted(recipes))} ({problem}); layouts that "
                f"can: {', '.join(layouts_that_can) or 'none'}")

    def require_static(self, recipe: str, static: bool, layouts_that_do: list[str]) -> None:
        if recipe in self.needs_static and not static:
            others = [n for n in layouts_that_do if n != self.name]
            raise LayoutError(
                f"--layout {self.name} holds recipe {recipe} only with static activation scales, which engines "
                f"read per Linear: convert the dense checkpoint with --activations static --calibration DATA, or use "
                f"--layout {' or '.join(others)} (dynamic activations)")

    def recipe_for(self, recipe: str, scale_rule: str | None = None) -> Recipe:
        r = get_recipe(recipe)
        if r.scale_rules:
            return r.with_scale_rule(scale_rule or self.default_scale_rule or r.scale_rule)
        return r

    def config_problems(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> list[str]:
        """Config keys this layout's loaders need that the checkpoint lacks (verify)."""
        return []

    def check_shape(self, name: str, recipe: Recipe, shape: tuple[int, ...]) -> None:
        """Layout-specific shape limits beyond the recipe's own (raise LayoutError)."""
        if len(shape) != 2:
            raise LayoutError(
                f"{name}: {len(shape)}-D tensors have no {self.name} names for recipe "
                f"{recipe.name}; use --layout gpt-oss with mxfp4 for 3-D experts, or --ignore it")

    # --- tensors, generic over the table

    def rows(self, recipe: str) -> tuple[TensorRow, ...]:
        try:
            return self.tables[recipe]
        except KeyError:
            raise LayoutError(f"layout {self.name} has no tensor names for recipe {recipe}") from None

    def codes_suffixes(self) -> tuple[str, ...]:
        """The suffixes that mark a quantized module's codes tensor in this layout (discovery)."""
        return tuple(dict.fromkeys(rows[0].suffix for rows in self.tables.values()))

    def to_disk(self, module: str, q: QuantizedTensor, facts: ModuleFacts = NO_FACTS) -> dict[str, torch.Tensor]:
        recipe = get_recipe(q.recipe)
        canonical = {Role.CODES: q.codes, Role.BLOCK_SCALE: q.scale, Role.GLOBAL_SCALE: q.global_scale,
                     Role.SHAPE: torch.tensor(q.shape, dtype=torch.int64)}
        out = {f"{module}{row.suffix}": self._encode(row, recipe, canonical[row.role]) for row in self.rows(q.recipe)}
        for row in self.optional.get(q.recipe, ()):
            value = getattr(facts, row.fact, None)
            if value is not None:
                out[f"{module}{row.suffix}"] = self._encode(row, recipe, torch.as_tensor(value))
        return out

    def kv_names(self, module: str) -> dict[str, str]:
        """The KV-cache scale a k_proj / v_proj module carries: {ModuleFacts field: tensor name}; a
        fused q/k/v Linear carries both, on its attention module (formats/fused.py FUSED_QKV)."""
        attn, _, leaf = module.rpartition(".")
        fields = {"k_proj": ("k_scale", 0), "v_proj": ("v_scale", 1)}
        if leaf in FUSED_QKV and self.kv_scales:
            return {"k_scale": f"{attn}.k_scale", "v_scale": f"{attn}.v_scale"}
        if leaf not in fields or not self.kv_scales:
            return {}
        fact, i = fields[leaf]
        return {fact: f"{attn}.{self.kv_scales[i]}"}

    def kv_to_disk(self, module: str, facts: ModuleFacts) -> dict[str, torch.Tensor]:
        """The calibrated KV-cache scales (multipliers, F32) that `facts` hold for this module."""
        return {name: scalar_f32(getattr(facts, fact), self.kv_scale_shape)
                for fact, name in self.kv_names(module).items() if getattr(facts, fact) is not None}

    def declare_calibration(self, config: dict, extra: dict[str, dict], groups: Mapping[str, list[str]],
                            static: bool, kv_fp8: bool) -> None:
        """Declare calibrated static activations / an FP8 KV cache in the configs (in place)."""

    def activation_scheme(self, config: Mapping) -> str:
        """What the config (with extras merged, detect.config_with_extras) declares for the
        activations: static (calibrated input scales), dynamic (per token / group) or none."""
        return "none"

    def kv_cache_declared(self, config: Mapping) -> str | None:
        """How the config declares an FP8 KV cache with checkpoint scales (which key), or None."""
        return None

    def input_scale_rows(self, recipe: str) -> tuple[TensorRow, ...]:
        """The optional activation-scale rows a module of `recipe` may carry."""
        return tuple(r for r in self.optional.get(recipe, ()) if r.role in (Role.INPUT_SCALE, Role.INPUT_GLOBAL_SCALE))

    @staticmethod
    def _encode(row: TensorRow, recipe: Recipe, t: torch.Tensor) -> torch.Tensor:
        codec = recipe.scale_codec
        if row.role == Role.CODES:  # uint8 code bytes viewed as the codec's storage (INT4: I32 words)
            t = t.contiguous().view(recipe.codes_dtype)
        elif row.role == Role.BLOCK_SCALE and codec.nbytes == 1:
            t = t.contiguous().view(codec.disk_dtype)
        elif row.role == Role.BLOCK_SCALE:
            # The scale codec's dtype: F32 scales as F32 (also when read from a BF16 source);
            # weight-dtype scales (int4) as computed, since the codes were rounded with them.
            t = t.to(codec.raw_dtype_for(t.dtype))
        elif row.role == Role.SHAPE:
            t = t.to(torch.int64)
        else:  # global, input and input_global scales: FP32 in the row's direction
            t = to_direction(t, row.direction)
        return _reshape(t, row.reshape).contiguous()

    def from_disk(self, module: str, recipe: Recipe, get: GetTensor, names: Mapping[str, object]) -> QuantizedTensor:
        rows = self.rows(recipe.name)
        codes_name = f"{module}{rows[0].suffix}"
        codes = require_8bit(codes_name, as_code_bytes(get(codes_name), recipe))
        if rows[0].reshape == BLOCKS16:
            codes = codes.reshape(*codes.shape[:-2], codes.shape[-2] * codes.shape[-1])
        shape = (*codes.shape[:-1], logical_k(codes, recipe))
        scale = s2 = None
        for row in rows[1:]:
            name = f"{module}{row.suffix}"
            stored = get(name)
            if row.role == Role.GLOBAL_SCALE:
                s2 = to_direction(stored.to(torch.float32).reshape(()), row.direction)
            elif row.role == Role.SHAPE:
                check_shape_row(name, stored, shape)
            elif recipe.scale_codec.nbytes == 1:
                scale = require_8bit(name, stored)
            else:  # F32 scales widen to F32; weight-dtype scales keep the dtype their codes were made with
                scale = require_float(name, stored)
                scale = scale.to(recipe.scale_codec.raw_dtype_for(scale.dtype)).reshape(recipe.scale_shape(shape))
        return QuantizedTensor(recipe.name, shape, codes, scale, s2, recipe.scale_rule)

    def describe(self, module: str, recipe: Recipe) -> list[DiskTensor]:
        encoding = {Role.CODES: recipe.element.disk_encoding, Role.BLOCK_SCALE: recipe.scale_encoding,
                    Role.SHAPE: "int64"}
        return [DiskTensor(f"{module}{row.suffix}", row.role, encoding.get(row.role, "f32"),
                           None if row.role in (Role.CODES, Role.SHAPE) else (row.direction or Direction.MULTIPLY))
                for row in self.rows(recipe.name)]

    def output_specs(self, module: str, recipe: Recipe, shape: tuple[int, ...],
                     weight_dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple]]:
        """(name, dtype, shape) of each tensor `to_disk` writes for a `shape` weight of
        `weight_dtype` (what a scale codec of the weight's dtype stores), from a meta-device
        stand-in (no data)."""
        meta = QuantizedTensor(
            recipe.name, tuple(shape),
            torch.empty(recipe.codes_shape(shape), dtype=torch.uint8, device="meta"),
            torch.empty(recipe.scale_shape(shape), dtype=recipe.scale_codec.raw_dtype_for(weight_dtype), device="meta"),
            torch.empty((), dtype=torch.float32, device="meta") if recipe.has_global_scale else None,
            recipe.scale_rule)
        return [(n, t.dtype, tuple(t.shape)) for n, t in self.to_disk(module, meta).items()]

    def logical_shape(self, recipe: Recipe, codes_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The [..., N, K] weight shape a stored codes tensor of `recipe` holds (in its storage
        dtype: INT4's I32 words hold eight codes each)."""
        if self.rows(recipe.name)[0].reshape == BLOCKS16:
            codes_shape = (*codes_shape[:-2], codes_shape[-2] * codes_shape[-1])
        storage_bits = 8 * recipe.codes_dtype.itemsize
        return (*codes_shape[:-1], codes_shape[-1] * storage_bits // recipe.element_bits)

    def dense_name(self, module: str) -> tuple[str, bool]:
        """Where a dequantized module is written, and whether it is stored transposed: Linear
        layouts write `<module>.weight` [N, K]; layouts naming a stack itself (gpt-oss) write the
        stack [E, in, out]."""
        return f"{module}.weight", False

    # --- discovery and config

    def detect(self, config: Mapping, extra_files: Mapping[str, Mapping]) -> bool:
        raise NotImplementedError

    def module_recipe(self, module: str, names: Mapping[str, object], config: Mapping) -> str | None:
        """Which recipe a module in a checkpoint of this layout was written with, or None."""
        raise NotImplementedError

    def quantized_modules(self, names: Mapping[str, object], config: Mapping) -> dict[str, str]:
        """module -> recipe for every quantized module among the tensor `names`."""
        out = {}
        suffixes = self.codes_suffixes()
        for name in names:
            suffix = next((s for s in suffixes if name.endswith(s)), None)
            if suffix is not None:
                module = name[: -len(suffix)]
                recipe = self.module_recipe(module, names, config)
                if recipe:
                    out[module] = recipe
        return out

    def quantization_config(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict:
        raise NotImplementedError

    def extra_files(self, groups: Mapping[str, list[str]], excluded: list[str]) -> dict[str, dict]:
        return {}


def scalar_f32(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return value.to(torch.float32).reshape(shape).contiguous()


def logical_k(codes: torch.Tensor, recipe: Recipe) -> int:
    return codes.shape[-1] * 8 // recipe.element_bits


def require_8bit(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.element_size() != 1:
        raise LayoutError(f"{name}: stored as {t.dtype}, expected an 8-bit type (F8_E4M3, I8 or U8)")
    return t.view(torch.uint8)


def as_code_bytes(t: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Codes stored in a wider word than a byte (INT4's I32 `weight_packed`, eight codes per
    little-endian word) as the code bytes they are; any other dtype is left for require_8bit."""
    if t.dtype == recipe.codes_dtype and t.element_size() > 1:
        return t.contiguous().view(torch.uint8)
    return t


def require_float(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point() or t.element_size() == 1:
        raise LayoutError(f"{name}: stored as {t.dtype}, expected a float scale (F32, BF16 or F16)")
    return t


def check_shape_row(name: str, stored: torch.Tensor, shape: tuple[int, ...]) -> None:
    """compressed-tensors' `weight_shape` states the logical shape; it is checked against the one
    the codes hold, never used in its place (a wrong one would make a loader unpack wrongly)."""
    if stored.dtype != torch.int64 or stored.reshape(-1).tolist() != list(shape):
        raise LayoutError(f"{name}: holds {stored.dtype} {stored.reshape(-1).tolist()}, but the codes hold a "
                          f"{list(shape)} weight")
