"""`quantcli inspect`: explain a (quantized) checkpoint from its headers, as an InspectReport.

Headers only by default; global scales (scalars) are read because they are a few bytes each.
`stats=True` reads scales and codes to report ranges, zero blocks, saturation and NaN/Inf.
The command layer (quantcli/cli/commands.py, render.py) prints the report or serializes it (reports.to_json).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from quantcli.checkpoint.source import Source, open_source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.errors import LayoutError, QuantcliError, RecipeError
from quantcli.formats import patterns
from quantcli.formats.activation_scales import CalibratedScales, calibrated_scales, missing_kv, scale_names
from quantcli.formats.analysis import (
    FusedMismatch,
    ModuleDescription,
    describe_module,
    exclusion_list,
    fused_mismatches,
    is_excluded,
    linear_modules,
    module_stats,
    unservable_problems,
)
from quantcli.formats.consistency import CONFIG_NAME, config_fix, contradictions, missing_config
from quantcli.formats.detect import Detected, all_names, config_with_extras, detect, global_scale_fault
from quantcli.formats.engine_checks import EngineLoad, Facts, judge_checkpoint, loads_in_line
from quantcli.formats.module_kinds import is_encoder
from quantcli.model.transformers_view import view
from quantcli.planning.plan import matches
from quantcli.reports import NOT_IN_JSON, OMITTED

StatsProgress = Callable[[str, int], None]  # (module just read, modules in all), for --stats
KV_FORMATS = {"bf16": 16.0, "fp8": 8.0, "nvfp4": 4.5, "mxfp4": 4.25}
SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
              "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(text: str) -> int:
    """`80GiB`, `40 GB`, `1.5TiB`, `1024` (bytes) -> bytes; anything else is a usage error."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise QuantcliError(f"--kv-budget {text!r}: not a size; write e.g. 80GiB, 40GB or 1024MiB")
    size = int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise QuantcliError(f"--kv-budget {text!r}: must be more than 0 bytes; write e.g. 80GiB")
    return size


@dataclass
class DenseTotals:
    """Unquantized tensors of one dtype."""

    tensors: int = 0
    params: int = 0
    bytes: int = 0


@dataclass
class FormatTotals:
    """Everything stored in one format: a recipe's modules or a dense dtype's tensors."""

    modules: int = 0
    params: int = 0
    bytes: int = 0


@dataclass
class KvFormat:
    format: str
    bits_per_element: float
    bytes_per_token: float
    tokens_in_budget: int


@dataclass
class KvCacheAccount:
    """Bytes per token of the KV cache in each format, and how many tokens a budget holds."""

    layers: int
    per_layer: str
    elements_per_token: int
    budget_bytes: int
    formats: list[KvFormat]


@dataclass
class InspectReport:
    source: str
    layout: str
    consumers: str  # the engines that load it, checked on it (engines.py's table; "any" when unquantized)
    has_manifest: bool
    modules: list[ModuleDescription]
    dense: dict[str, DenseTotals]
    by_format: dict[str, FormatTotals]
    params: int
    bytes: int
    bits_per_param: float | None
    size_vs_bf16: float | None
    exclusion_list: list[str]
    unlisted_linears: list[str]
    fused_mismatches: list[FusedMismatch]
    problems: list[str]
    warnings: list[str]
    config: dict = field(metadata=NOT_IN_JSON)  # config.json (+ extras) as read, for --kv-cache
    kv_cache: KvCacheAccount = OMITTED
    # activation scheme, static input scales, KV-cache scales (quantized checkpoints only)
    calibrated: CalibratedScales = OMITTED
    # each engine's verdict on this checkpoint (quantcli/formats/engines.py, conditions settled on the files)
    engines: list[EngineLoad] = OMITTED
    # a data-aware rounding (GPTQ): the manifest's method and parameters (each module's in `modules`)
    rounding: dict = OMITTED


def inspect_checkpoint(path: str, revision: str | None = None, pattern: str | None = None,
                       stats: bool = False, progress: StatsProgress | None = None) -> InspectReport:
    source = open_source(path, revision)
    return inspect_source(source, pattern, stats, progress)


def _describe(det: Detected, module: str, recipe_name: str, tensors: CheckpointTensors, scale_rule: str | None,
              stats: bool) -> ModuleDescription:
    try:
        m = describe_module(det.layout, module, recipe_name, tensors, scale_rule)
    except (RecipeError, LayoutError) as exc:
        # tensors that do not fit the recipe or layout the config names are a finding about this
        # module; a broken file (CheckpointError) or a bug still stops here
        m = ModuleDescription.undescribable(module, recipe_name,
                                            f"cannot be described as {det.layout.name} {recipe_name}: {exc}")
    # the global scales were read anyway: one no producer writes means a corrupt source
    # (here only: verify reports it under its scale check, from the same helper's rule)
    m.problems.extend(f"{e.name}: {global_scale_fault(e.value)}; the checkpoint is corrupt"
                      for e in m.tensors if e.value is not OMITTED and global_scale_fault(e.value))
    if stats and not m.problems:
        m.stats = module_stats(det.layout, module, recipe_name, tensors)
    return m


def _quantized_modules(det: Detected | None, tensors: CheckpointTensors, pattern: str | None,
                       stats: bool, progress: StatsProgress | None = None) -> tuple[list[ModuleDescription], set[str]]:
    """The described modules `pattern` selects, and every disk tensor of a quantized module."""
    if det is None:
        return [], set()
    rules = {m.module: m.scale_rule for m in det.manifest.modules} if det.manifest else {}
    searches = {m.module: m.scale_search for m in det.manifest.modules if m.scale_search} if det.manifest else {}
    rounded = {m.module: dict(m.rounding) for m in det.manifest.modules if m.rounding} if det.manifest else {}
    modules, consumed = [], set()
    selected = [(m, r) for m, r in sorted(det.modules.items()) if not pattern or matches(pattern, m)]
    for module, recipe_name in selected:
        m = _describe(det, module, recipe_name, tensors, rules.get(module), stats)
        if module in searches and m.scale_rule is not OMITTED:  # how the block scales were chosen
            m.scale_rule = f"{m.scale_rule or 'absmax'} + {searches[module]} search"
        m.rounding = rounded.get(module, OMITTED)
        if stats and progress is not None:  # --stats reads every module's data: minutes on a large model
            progress(module, len(selected))
        modules.append(m)
        consumed.update(t.name for t in m.tensors)
    for module in det.modules:
        consumed.update(d.name for d in det.layout.describe(module, det.layout.recipe_for(det.modules[module])))
    return modules, consumed


def _dense_totals(names, tensors: CheckpointTensors, consumed: set[str], pattern: str | None) -> dict[str, DenseTotals]:
    dense: dict[str, DenseTotals] = {}
    for name in names:
        if name in consumed or (pattern and not matches(pattern, name)):
            continue
        info = tensors.info(name)
        d = dense.setdefault(info.dtype, DenseTotals())
        d.tensors += 1
        d.params += info.numel
        d.bytes += info.nbytes
    return dense


def _format_totals(modules: list[ModuleDescription], dense: dict[str, DenseTotals]) -> dict[str, FormatTotals]:
    by_format: dict[str, FormatTotals] = {}
    for m in modules:
        f = by_format.setdefault(m.recipe, FormatTotals())
        f.modules += 1
        f.params += m.params
        f.bytes += m.bytes
    for dtype, d in dense.items():
        f = by_format.setdefault(dtype.lower(), FormatTotals())
        f.params += d.params
        f.bytes += d.bytes
    return by_format


def _unlisted_linears(det: Detected | None, names, tensors: CheckpointTensors, excluded: list[str]) -> list[str]:
    """Linears neither quantized nor excluded: vLLM/SGLang would load a dense weight into a quantized slot."""
    if det is None:
        return []
    return sorted(m for m in linear_modules(names, tensors) if m not in det.modules and not is_excluded(m, excluded))


def inspect_source(source: Source, pattern: str | None = None, stats: bool = False,
                   progress: StatsProgress | None = None) -> InspectReport:
    if pattern is not None:
        patterns.validate(pattern, "--tensors")
    det: Detected | None = detect(source)
    names = all_names(source)
    config = config_with_extras(source, det.extra_files if det else {})
    with CheckpointTensors(source) as tensors:
        modules, consumed = _quantized_modules(det, tensors, pattern, stats, progress)
        scales = _calibrated(det, config, modules, names, tensors, pattern)
        consumed |= scale_names(scales) if scales is not OMITTED else set()
        dense = _dense_totals(names, tensors, consumed, pattern)
        if pattern and not modules and not dense:
            raise QuantcliError(f"--tensors {pattern!r}: matches no tensor or module in {source.label}; try a "
                                f"module name or prefix (model.layers.0), a glob ('*q_proj') or re:REGEX, and "
                                f"`quantcli inspect {source.label} --json` to list the names")
        excluded = exclusion_list(config)
        unlisted = _unlisted_linears(det, names, tensors, excluded)
        engines = engine_loads(det, tensors, config, scales)
    by_format = _format_totals(modules, dense)
    if scales is not OMITTED:
        _count_scales(by_format, scales, tensors_bytes=4)
    total_params = sum(f.params for f in by_format.values())
    total_bytes = sum(f.bytes for f in by_format.values())
    return InspectReport(
        source=source.label, layout=det.layout.name if det else "unquantized",
        consumers=_consumers(source, det, contradictions(source, det), engines),
        has_manifest=bool(det and det.manifest),
        modules=modules, dense=dense, by_format=by_format, params=total_params, bytes=total_bytes,
        bits_per_param=round(8 * total_bytes / total_params, 4) if total_params else None,
        size_vs_bf16=round(total_bytes / (2 * total_params), 4) if total_params else None,
        exclusion_list=excluded, unlisted_linears=unlisted, fused_mismatches=fused_mismatches(modules),
        problems=_config_problems(source, det) + [f"{m.module}: {p}" for m in modules for p in m.problems]
        + unservable_problems(det, modules),
        warnings=list(source.warnings) + _kv_warnings(scales), config=config, calibrated=scales,
        engines=engines if det else OMITTED,
        rounding=dict(det.manifest.rounding) if det and det.manifest and det.manifest.rounding else OMITTED)


def engine_loads(det: Detected | None, tensors: CheckpointTensors, config: dict, scales) -> list[EngineLoad]:
    """The engines table's verdicts settled on this checkpoint: every quantized module's logical
    shape (from its codes tensor's header, also outside --tensors), the config, the static scales."""
    if det is None:
        return []
    modules = {}
    for module, recipe_name in det.modules.items():
        recipe = det.layout.recipe_for(recipe_name)
        codes = f"{module}{det.layout.rows(recipe_name)[0].suffix}"
        shape = tuple(tensors.info(codes).shape) if codes in tensors else ()
        modules[module] = (recipe_name, det.layout.logical_shape(recipe, shape) if shape else ())
    static = (scales is not OMITTED and scales.activation_scheme == "static" and bool(scales.inputs)
              and not scales.missing_inputs)
    dense = tuple(m for m in linear_modules(tensors.where, tensors) if m not in modules)
    names = [n[: -len(".weight")] for n in tensors.where if n.endswith(".weight")]  # what transformers renames
    hf = view(config, [*modules, *names])
    return judge_checkpoint(det.layout.name, Facts(modules, config, static, hf, dense))


def _consumers(source: Source, det: Detected | None, disagree: list[str], engines) -> str:
    if missing_config(source) is not None:
        return f"none: no usable {CONFIG_NAME}"
    if disagree:
        return "none: the config and the tensors disagree"
    return loads_in_line(engines) if det else "any"


def _config_problems(source: Source, det: Detected | None) -> list[str]:
    """config.json missing, or contradicted by the tensors (formats/consistency.py)."""
    missing = missing_config(source)
    problems = [] if missing is None else [f"{CONFIG_NAME}: {missing}; {config_fix(source)}"]
    return problems + [f"{CONFIG_NAME}: {p}" for p in contradictions(source, det)]


def _calibrated(det: Detected | None, config: dict, modules: list[ModuleDescription], names,
                tensors: CheckpointTensors, pattern: str | None) -> CalibratedScales:
    if det is None:
        return OMITTED
    scales = calibrated_scales(det.layout, config, {m.module: m.recipe for m in modules}, names, tensors)
    if pattern:
        scales.kv = [r for r in scales.kv if matches(pattern, r.attention)]
    return scales


def _count_scales(by_format: dict[str, FormatTotals], scales: CalibratedScales, tensors_bytes: int) -> None:
    """Input and KV-cache scales are their own line in the totals, not a dense f32 format: their bytes
    count, their values are not parameters (a parameter is a weight, as codes or dense)."""
    for key, count in (("input scales", len(scales.inputs)),
                       ("kv scales", sum((r.k_scale is not None) + (r.v_scale is not None) for r in scales.kv))):
        if count:
            by_format[key] = FormatTotals(params=0, bytes=count * tensors_bytes)


def _kv_warnings(scales: CalibratedScales) -> list[str]:
    """The engines' silent fallback: an FP8 KV cache declared, its scales absent."""
    if scales is OMITTED:
        return []
    missing = missing_kv(scales)
    if not missing:
        return []
    return [f"the config declares an FP8 KV cache ({scales.kv_cache}) but {len(missing)} KV-cache scale tensor(s) "
            f"are missing (e.g. {missing[0]}); vLLM and SGLang fall back to a scale of 1.0, which clips or wastes "
            f"FP8 range: re-convert with --kv-cache fp8 --calibration DATA"]


def _config_int(text: dict, key: str, default: int | None = None, minimum: int = 1) -> int:
    """An integer from config.json for the KV-cache account, or one line naming the key."""
    value = text.get(key)
    if value is None:
        value = default
    if value is None:
        raise QuantcliError(f"--kv-cache: {CONFIG_NAME} has no {key}; cannot size the KV cache")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise QuantcliError(f"--kv-cache: {CONFIG_NAME} {key} is {value!r}, not an integer >= {minimum}; cannot size "
                            f"the KV cache")
    return value


def _kv_elements_per_layer(text: dict) -> tuple[int, str]:
    """(cached elements per token and layer, how they are made up)."""
    if text.get("kv_lora_rank"):  # MLA caches one latent plus the rope key per token and layer
        rank, rope = _config_int(text, "kv_lora_rank"), _config_int(text, "qk_rope_head_dim", 0, minimum=0)
        return rank + rope, f"MLA latent {rank} + rope {rope}"
    heads = _config_int(text, "num_attention_heads")
    kv_heads = _config_int(text, "num_key_value_heads", heads)
    if text.get("head_dim") is not None:
        head_dim = _config_int(text, "head_dim")
    else:
        head_dim = _config_int(text, "hidden_size") // heads
    return 2 * kv_heads * head_dim, f"2 x {kv_heads} kv heads x {head_dim} head_dim"


def account_kv_cache(report: InspectReport, budget: int) -> None:
    """--kv-cache: the account in `report.kv_cache`, or, for an encoder (bidirectional, nothing
    cached between steps), a warning saying there is no KV cache to size."""
    if is_encoder(report.config):
        arch = (report.config.get("architectures") or [report.config.get("model_type")])[0]
        report.warnings.append(f"--kv-cache: {arch} is an encoder-only model; it keeps no KV cache, so there is "
                               f"nothing to size")
        return
    report.kv_cache = kv_cache_account(report.config, budget)


def kv_cache_account(config: dict, budget: int) -> KvCacheAccount:
    if not any(k != "hf_quant_config" for k in config):
        raise QuantcliError(f"--kv-cache: there is no {CONFIG_NAME} (or it is empty); the KV-cache account reads the "
                            f"layers and attention heads from it")
    text = config.get("text_config") or config
    if not isinstance(text, dict):
        raise QuantcliError("--kv-cache: config.json text_config is not an object; cannot size the KV cache")
    layers = _config_int(text, "num_hidden_layers")
    per_layer, shape = _kv_elements_per_layer(text)
    rows = []
    for fmt, bits in KV_FORMATS.items():
        per_token = layers * per_layer * bits / 8
        rows.append(KvFormat(format=fmt, bits_per_element=bits, bytes_per_token=per_token,
                             tokens_in_budget=int(budget // per_token)))
    return KvCacheAccount(layers=layers, per_layer=shape, elements_per_token=layers * per_layer, budget_bytes=budget,
                          formats=rows)


__all__ = ["InspectReport", "KvCacheAccount", "account_kv_cache", "inspect_checkpoint", "inspect_source",
           "kv_cache_account", "parse_size"]
