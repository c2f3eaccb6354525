"""What a quantized checkpoint declares for its activations and its KV cache, as emulation
steps (fake_quant.ActQuant per module, FP8 KV scales per attention), or a one-line refusal
naming what eval cannot emulate.

Read per layout from the config the checkpoint ships (docs/formats.md, "Calibrated scales"):
- compressed-tensors: each module's config group `input_activations` (num_bits, type,
  strategy, dynamic, group_size, scale_dtype: `torch.uint8` marks MX blocks, whose exponents
  compressed-tensors' fake-quantize takes by the `even` rule), and `kv_cache_scheme`;
- modelopt: `quant_algo` (NVFP4 and FP8: static `input_scale`; FP8_PER_CHANNEL_PER_TOKEN:
  dynamic per token; MXFP8: dynamic MXFP8, rule `rceil`, the rule of ModelOpt's MXFP8QTensor
  and of Triton's `downcast_to_mxfp`; W4A8_MXFP4_FP8: static FP8 `input_scale`; W4A16_NVFP4, FP8_PB_WO:
  weight-only) and `kv_cache_quant_algo`;
- fp8 (FineGrainedFP8 / DeepSeek): `activation_scheme` dynamic (per 1x128 group for block
  weights, per tensor otherwise) or static (`input_scale`); `quant_method: mxfp8` (SGLang):
  dynamic MXFP8, rule `rceil` (SGLang's `mxfp8_group_quantize` calls Triton's
  `downcast_to_mxfp`, whose default DequantScaleRoundingMode is ROUND_UP);
- gpt-oss: weight-only.
"""

from __future__ import annotations

from typing import Mapping

from quantcli.errors import QuantcliError
from quantcli.evaluate.fake_quant import ActQuant
from quantcli.formats.activation_scales import CalibratedScales
from quantcli.formats.layouts.base import Direction


class NotEmulated(QuantcliError):
    """A checkpoint declares something eval cannot reproduce exactly."""


# quant_algo -> (the recipe whose modules quantize their inputs, None: every recipe; the step,
# or for static algorithms the kind of step their `input_scale` makes)
MODELOPT_DYNAMIC = {"FP8_PER_CHANNEL_PER_TOKEN": (None, ActQuant("fp8-token")),
                    "MXFP8": ("mxfp8", ActQuant("mxfp8", rule="rceil"))}
MODELOPT_STATIC = {"NVFP4": ("nvfp4", "nvfp4"), "FP8": (None, "fp8-static"),
                   "W4A8_MXFP4_FP8": ("mxfp4", "fp8-static")}
MX_BITS = {8: "mxfp8", 4: "mxfp4"}
MODELOPT_WEIGHT_ONLY = ("", "W4A16_NVFP4", "FP8_PB_WO")
KV_MODES = ("auto", "scale-one", "none")
DECLARING = ("compressed-tensors", "modelopt", "fp8")  # the layouts whose activation declarations are read here


def _refuse(label: str, what: str) -> NotEmulated:
    return NotEmulated(f"{label}: {what}, which quantcli eval cannot emulate exactly; nothing was run")


def _static(module: str, scales: CalibratedScales, kind: str, label: str) -> ActQuant:
    found = next((s for s in scales.inputs if s.module == module), None)
    if found is None:
        raise _refuse(label, f"static activations are declared but {module} carries no input scale")
    if kind == "nvfp4":  # the global divisor: stored as is (divide), or 1 / the multiplier
        gs = found.value if found.direction == Direction.DIVIDE else 1.0 / found.value
        return ActQuant("nvfp4", float(gs))
    multiplier = 1.0 / found.value if found.direction == Direction.DIVIDE else found.value
    return ActQuant("fp8-static", float(multiplier))


def _compressed_tensors(layout, config: Mapping, module: str, scales, label: str) -> ActQuant | None:
    group = layout.scheme_of(module, config) or {}
    ia = group.get("input_activations")
    if not isinstance(ia, dict):
        return None
    bits, kind, strategy = ia.get("num_bits"), ia.get("type"), ia.get("strategy")
    dynamic, size = ia.get("dynamic"), ia.get("group_size")
    said = f"compressed-tensors input_activations {{num_bits: {bits}, type: {kind}, strategy: {strategy}, " \
           f"dynamic: {dynamic}}} on {module}"
    if ia.get("symmetric") is False or ia.get("actorder"):
        raise _refuse(label, f"asymmetric or reordered activations ({said})")
    mx_blocks = strategy == "group" and size == 32 and ia.get("scale_dtype") == "torch.uint8"
    if kind == "float" and bits in MX_BITS and dynamic is True and mx_blocks:
        return ActQuant(MX_BITS[bits], rule="even")
    if kind == "float" and bits == 8 and dynamic is True:
        if strategy == "token":
            return ActQuant("fp8-token")
        if strategy == "group" and isinstance(size, int) and size > 0 and ia.get("scale_dtype") is None:
            return ActQuant("fp8-group", group=size)
        if strategy == "tensor":
            return ActQuant("fp8-tensor")
    if kind == "float" and bits == 8 and dynamic is False and strategy == "tensor":
        return _static(module, scales, "fp8-static", label)
    if kind == "float" and bits == 4 and strategy == "tensor_group" and size == 16 and dynamic == "local":
        return _static(module, scales, "nvfp4", label)
    if kind == "int" and bits == 8 and dynamic is True and strategy == "token":
        return ActQuant("int8-token")
    raise _refuse(label, said)


def _modelopt(algo: str, module: str, recipe: str, scales, label: str) -> ActQuant | None:
    if algo in MODELOPT_WEIGHT_ONLY:
        return None
    if algo in MODELOPT_DYNAMIC:
        applies_to, step = MODELOPT_DYNAMIC[algo]
        return step if applies_to in (None, recipe) else None
    if algo in MODELOPT_STATIC:
        applies_to, kind = MODELOPT_STATIC[algo]
        return _static(module, scales, kind, label) if applies_to in (None, recipe) else None
    raise _refuse(label, f"modelopt quant_algo {algo} (its activation quantization)")


def _fp8(config: Mapping, module: str, recipe: str, scales, label: str) -> ActQuant | None:
    qc = config.get("quantization_config") or {}
    scheme = qc.get("activation_scheme")
    if qc.get("quant_method") == "mxfp8" or recipe == "mxfp8":
        return ActQuant("mxfp8", rule="rceil")
    if scheme == "static":
        return _static(module, scales, "fp8-static", label)
    if scheme == "dynamic":
        return ActQuant("fp8-group", group=128) if recipe == "fp8-block" else ActQuant("fp8-tensor")
    return None


def _modelopt_algo(config: Mapping) -> str:
    """hf_quant_config.json's quant_algo (merged into the config by detect), else config.json's."""
    qc = config.get("quantization_config") or {}
    section = (config.get("hf_quant_config") or {}).get("quantization") or qc
    return str(section.get("quant_algo") or "").upper()


def activation_steps(layout, config: Mapping, modules: Mapping[str, str], scales: CalibratedScales,
                     label: str) -> dict[str, ActQuant]:
    """{quantized module: how its input is quantized} for the modules whose input the
    checkpoint declares quantized; NotEmulated for a declaration eval cannot reproduce."""
    out: dict[str, ActQuant] = {}
    if layout is None or layout.name == "gpt-oss":
        return out
    if layout.name not in DECLARING:  # a layout added later must say how it declares activations, not pass as fp8
        raise NotEmulated(f"{label}: layout {layout.name}: eval emulates the activation quantization declared in the "
                          f"{', '.join(DECLARING)} layouts (gpt-oss is weight-only), not in this one; nothing was run")
    algo = _modelopt_algo(config) if layout.name == "modelopt" else ""
    for module, recipe in sorted(modules.items()):
        if layout.name == "compressed-tensors":
            step = _compressed_tensors(layout, config, module, scales, label)
        elif layout.name == "modelopt":
            step = _modelopt(algo, module, recipe, scales, label)
        else:  # fp8, the one left in DECLARING
            step = _fp8(config, module, recipe, scales, label)
        if step is not None:
            out[module] = step
    return out


def kv_steps(scales: CalibratedScales | None, mode: str, attentions: list[str], label: str) -> dict[str, tuple]:
    """{attention module: (k_scale, v_scale)} of an FP8 KV cache: the checkpoint's own scales
    where it declares one (`auto`), 1.0 for every attention (`scale-one`, what SGLang does when
    the scales are missing), or nothing (`none`)."""
    if mode == "none":
        return {}
    if mode == "scale-one":
        return {a: (1.0, 1.0) for a in attentions}
    if scales is None or scales.kv_cache is None:
        return {}
    out = {}
    for row in scales.kv:
        if row.k_scale is None or row.v_scale is None:
            missing = row.k_tensor if row.k_scale is None else row.v_tensor
            raise NotEmulated(f"{label}: declares an FP8 KV cache ({scales.kv_cache}) but {missing} is missing; "
                              f"pass --kv-cache scale-one to quantize it with scale 1.0 (what SGLang does), or "
                              f"--kv-cache none")
        out[row.attention] = (row.k_scale, row.v_scale)
    return out
