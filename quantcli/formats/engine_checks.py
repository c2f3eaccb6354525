"""The engines table's conditions settled on one checkpoint: inspect runs them on the files, the
model card and the convert summary on the output just written. A condition no file settles (a
GPU generation) is left standing and said; one the files settle becomes a yes or a no with the
reason (which module's shape, which architecture, which spelling)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from quantcli.formats.analysis import exclusion_list
from quantcli.formats.engines import CHECK_CONDITIONS, ENGINES, LOADS, NO, UNCHECKED, Verdict, verdicts
from quantcli.formats.fused import FUSED_SETS, fused_group_of
from quantcli.formats.patterns import match_rule
from quantcli.formats.transformers_view import TransformersView

# SGLang 0.5.23 classes that load through LlamaForCausalLM's loader, which renames every
# `.weight_scale_inv` to `.weight_scale` (models/llama.py, mistral.py, ministral3.py, llama4.py,
# teleflm.py): their block-FP8 and MXFP8 scales in `weight_scale_inv` are then never loaded.
LLAMA_FAMILY = ("LlamaForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM", "IQuestCoderForCausalLM",
                "Llama4ForCausalLM", "MistralForCausalLM", "Ministral3ForCausalLM", "TeleFLMForCausalLM")
YES, IF = "yes", "if"
OPTION_CHECKS = frozenset({"static"})  # conditions the conversion's options settle, which the user chose
_ORDER = {NO: 0, UNCHECKED: 1, IF: 2, YES: 3}  # combining recipes: the weakest verdict wins


@dataclass(frozen=True)
class Facts:
    """What the checks read: the quantized modules, config.json (with hf_quant_config merged, as
    detect.config_with_extras does), whether calibrated static input scales are present, and
    what transformers makes of the modules (None: transformers could not build the model here)."""

    modules: Mapping[str, tuple[str, tuple[int, ...]]]  # module -> (recipe, logical weight shape [..., N, K])
    config: Mapping = field(default_factory=dict)
    static: bool = False
    transformers: TransformersView | None = None
    dense: tuple[str, ...] = ()  # the Linears left unquantized (checkpoint names)

    def of(self, recipe: str) -> dict[str, tuple[int, ...]]:
        return {m: shape for m, (r, shape) in self.modules.items() if r == recipe and len(shape) >= 2}


@dataclass
class EngineLoad:
    """One engine's verdict on a checkpoint."""

    engine: str
    loads: str  # yes | if (a GPU the files cannot vouch for, or a load option) | no | not checked
    reason: str  # the condition and that it holds, why not, what is left to the GPU, or the load option
    rules: str  # the consumer code the verdict rests on (engines.TABLE)
    # the pair loads in this engine, these files do not (a shape, the architecture): the convert
    # summary says so; not for what the options chose (no --activations static)
    ruled_out: bool = field(default=False, metadata={"json": False})


def _shape_offenders(shapes: Mapping[str, tuple[int, ...]], bad: Callable[[tuple[int, ...]], bool]) -> str | None:
    failing = sorted(m for m, s in shapes.items() if bad(s))
    if not failing:
        return None
    m = failing[0]
    return f"{len(failing)} of {len(shapes)} weights checked fail, e.g. {m} ({'x'.join(map(str, shapes[m][-2:]))})"


def _fused(shapes: Mapping[str, tuple[int, ...]], but_last: bool) -> str | None:
    groups: dict[str, list[str]] = {}
    for m in shapes:
        g = fused_group_of(m)
        if g:
            groups.setdefault(g, []).append(m)
    parts = []
    for members in groups.values():
        order = next(s for s in FUSED_SETS if members[0].rpartition(".")[2] in s)
        members.sort(key=lambda m: order.index(m.rpartition(".")[2]))
        parts += members[:-1] if but_last and len(members) > 1 else members
    return _shape_offenders({m: shapes[m] for m in parts}, lambda s: s[-2] % 128 != 0)


def _architecture(config: Mapping) -> str:
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else f"model_type {config.get('model_type')!r}"


def _quant_algo(config: Mapping) -> object:
    section = (config.get("hf_quant_config") or {}).get("quantization") or config.get("quantization_config") or {}
    return section.get("quant_algo")


# Per-expert module names, for when transformers cannot be asked which experts it merges: every MoE
# architecture transformers 5.24 builds merges them (conversion_mapping.py, MergeModulelist).
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _merged(f: Facts, modules) -> list[str]:
    """Those of `modules` that transformers merges into 3-D expert parameters (by name without it)."""
    merged = f.transformers.merged_experts if f.transformers else None
    return sorted(m for m in modules if (m in merged if merged is not None else _EXPERT.search(m)))


# What transformers 5.24's CompressedTensorsDequantize.convert does with the merged experts of each
# recipe (engines._HF_EXPERTS): None where it decodes them. Dense merged experts pass through its
# 8-bit float branch only (fp8, fp8-channel; the block and group scales fail there anyway).
MERGED_EXPERTS = {
    "fp8": None, "fp8-channel": None, "mxfp4": None, "int4": None,
    "nvfp4": "never divides them by weight_global_scale (garbage logits, no error)",
    "fp8-block": "multiplies the codes by weight_scale as stored, which a 128x128 block scale does not broadcast to "
                 "(the load fails)",
    "mxfp8": "multiplies the codes by the raw E8M0 bytes of weight_scale, which do not broadcast (the load fails; "
             "K = 32 would broadcast them, wrong)",
    "int8-channel": "looks for weight_packed, which int8 experts do not have, and returns nothing (the load fails)",
}
_DENSE_EXPERTS_PASS = ("fp8", "fp8-channel")


def _merged_experts(f: Facts, recipe: str) -> str | None:
    """Merged experts transformers cannot decode: quantized ones of `recipe`, or dense ones beside them."""
    fault = MERGED_EXPERTS.get(recipe)
    quantized = _merged(f, f.of(recipe)) if fault else []
    # every merge converter gets the dequantize op, with the experts' scheme: dense experts too
    dense = _merged(f, f.dense) if recipe not in _DENSE_EXPERTS_PASS else []
    if quantized:
        served = "; vLLM and SGLang load it, as they do the default modelopt layout" if recipe == "nvfp4" else ""
        return (f"{len(quantized)} {recipe} expert Linears (e.g. {quantized[0]}) are merged, and "
                f"CompressedTensorsDequantize.convert {fault}; for transformers convert with --recipe mxfp4, int4, "
                f"fp8 or fp8-channel{served}")
    if dense:
        return (f"{len(dense)} dense expert Linears (e.g. {dense[0]}) are merged, and "
                f"CompressedTensorsDequantize.convert loads only {recipe} ones: theirs stay missing (the load fails, "
                f"or leaves them random); quantize every expert Linear, or use fp8 or fp8-channel")
    return None


def _init_reads_weight(f: Facts, recipe: str) -> str | None:
    """Where the model's own init reads `.weight` of a packed Linear (HF_INIT in engines.py)."""
    if f.transformers is None:
        return "transformers could not build the model here, so its _init_weights was not checked"
    return f.transformers.init_reads_weight(f.of(recipe))


def _names_transformers_misses(f: Facts, recipe: str) -> str | None:
    """Modules the config names only as the checkpoint does, where transformers builds them under
    another name (_HF_NAMES in engines.py): a dense Linear the `ignore` list misses, or a quantized
    one no explicit `targets` entry meets."""
    if f.transformers is None:
        return None  # transformers could not build the model here: nothing to compare with
    def named(patterns: list[str], name: str) -> bool:  # compressed-tensors: the exact name or re: (utils/match.py)
        return any(match_rule(p, name) in ("exact", "regex") for p in patterns)

    renamed, qc = f.transformers.renamed, f.config.get("quantization_config") or {}
    ignore = exclusion_list(dict(f.config))
    targets = [t for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict) for t in g.get("targets", [])]
    missed = [renamed[m] for m in f.dense if m in renamed and not named(ignore, renamed[m])]
    if "Linear" not in targets:
        missed += [renamed[m] for m in f.of(recipe) if m in renamed and not named(targets, renamed[m])]
    if not missed:
        return None
    return (f"{len(missed)} modules transformers builds under other names are not in the config by those names, "
            f"e.g. {sorted(missed)[0]} (by default it would quantize a dense one from its dense weights, or leave a "
            f"quantized one dense); or convert the source again with transformers installed")


# A failed check that a load option gets around: the engine loads it with that option ("if").
# run_compressed=False (dequantize=True) decompresses each checkpoint tensor as it loads
# (CompressedTensorsDequantize) into a dense model: no module is replaced, so neither the config's
# names nor the model's init matter; the merged experts go through the same op and stay wrong.
_DENSE_LOAD = "CompressedTensorsConfig(run_compressed=False)"
WORKAROUNDS = {"hf_init": _DENSE_LOAD, "hf_names": _DENSE_LOAD}

CHECKS: dict[str, Callable[[Facts, str], str | None]] = {
    "nk128": lambda f, r: _shape_offenders(f.of(r), lambda s: s[-1] % 128 != 0 or s[-2] % 128 != 0),
    "k128": lambda f, r: _shape_offenders(f.of(r), lambda s: s[-1] % 128 != 0),
    "fused_n128": lambda f, r: _fused(f.of(r), but_last=False),
    "fused_n128_but_last": lambda f, r: _fused(f.of(r), but_last=True),
    "static": lambda f, r: None if f.static else "the checkpoint has no static input scales",
    "gpt_oss": lambda f, r: (None if f.config.get("model_type") == "gpt_oss"
                             else f"the architecture is {_architecture(f.config)}"),
    "not_llama": lambda f, r: (f"{_architecture(f.config)} is Llama-family"
                               if set(f.config.get("architectures") or []) & set(LLAMA_FAMILY) else None),
    "pb_wo_lower": lambda f, r: (None if _quant_algo(f.config) == "fp8_pb_wo"
                                 else f"quant_algo is {_quant_algo(f.config)!r}"),
    "hf_names": _names_transformers_misses,
    "hf_experts": _merged_experts,
    "hf_init": _init_reads_weight,
}


def declares_inputs(config: Mapping) -> bool:
    """Whether a compressed-tensors config group quantizes its inputs (`input_activations`)."""
    groups = ((config.get("quantization_config") or {}).get("config_groups") or {}).values()
    return any(isinstance(g, dict) and isinstance(g.get("input_activations"), dict) for g in groups)


def _needs(v: Verdict, failed: Mapping[str, str]) -> str:
    """The part of the verdict's condition the failed checks are about (all of it by default)."""
    hard = [k for k in failed if k not in WORKAROUNDS]
    parts = [CHECK_CONDITIONS[k] for k in hard if k in CHECK_CONDITIONS]
    return " and ".join(parts) if parts and len(parts) == len(hard) else v.condition


def judge(recipe: str, layout: str, facts: Facts) -> list[EngineLoad]:
    """Each engine's verdict on the modules of `recipe` in a `layout` checkpoint."""
    by_engine = verdicts(recipe, layout, inputs=declares_inputs(facts.config))
    if not by_engine:  # a pair quantcli reads but never writes (ModelOpt's own MXFP4 export)
        return [EngineLoad(e, NO, f"no engine loads {recipe} in the {layout} layout", "") for e in ENGINES]
    out = []
    for engine, v in ((e, by_engine[e]) for e in ENGINES):
        if v.status == LOADS:
            out.append(EngineLoad(engine, YES, v.note, v.cites()))
        elif v.status in (NO, UNCHECKED):
            out.append(EngineLoad(engine, v.status, v.condition, v.cites()))
        else:
            failed = {key: why for key in v.checks if (why := CHECKS[key](facts, recipe))}
            hard = [why for key, why in failed.items() if key not in WORKAROUNDS]
            if hard:
                out.append(EngineLoad(engine, NO, f"needs {_needs(v, failed)}: " + "; ".join(hard), v.cites(),
                                      ruled_out=not set(failed) <= OPTION_CHECKS))
            elif failed:
                how = "; ".join(f"loads with {WORKAROUNDS[key]}: {why}" for key, why in failed.items())
                out.append(EngineLoad(engine, IF, how, v.cites()))
            elif v.hardware:
                settled = f" (checked here, the rest of: {v.condition})" if v.checks else ""
                out.append(EngineLoad(engine, IF, f"needs {v.hardware}{settled}", v.cites()))
            else:
                out.append(EngineLoad(engine, YES, f"checked here: {v.condition}", v.cites()))
    return out


def judge_checkpoint(layout: str, facts: Facts) -> list[EngineLoad]:
    """Each engine's verdict on every recipe the checkpoint holds: an engine loads a checkpoint
    when it loads each of its recipes (a mixed compressed-tensors checkpoint)."""
    recipes = sorted({r for r, _ in facts.modules.values()})
    per_recipe = {r: judge(r, layout, facts) for r in recipes}
    out = []
    for i, engine in enumerate(ENGINES):
        judged = [(r, per_recipe[r][i]) for r in recipes]
        worst = min((j.loads for _, j in judged), key=_ORDER.__getitem__, default=NO)
        said = [(r, j) for r, j in judged if j.loads == worst and j.reason]
        reason = "; ".join(dict.fromkeys(f"{r}: {j.reason}" if len(recipes) > 1 else j.reason for r, j in said))
        rules = "; ".join(dict.fromkeys(j.rules for _, j in judged))
        out.append(EngineLoad(engine, worst, reason, rules, any(j.ruled_out for _, j in judged)))
    return out


def loads_in_line(loads: list[EngineLoad]) -> str:
    """`vLLM, SGLang (needs an SM100+ GPU ...)`: the engines that load it, and what each still needs."""
    parts = [j.engine if j.loads == YES else f"{j.engine} ({j.reason})" for j in loads if j.loads in (YES, IF)]
    return ", ".join(parts) or "no engine"


def ruled_out_line(loads: list[EngineLoad]) -> str:
    """`transformers (needs ...: why)`: engines the table has load the pair, ruled out by these files."""
    return ", ".join(f"{j.engine} ({j.reason})" for j in loads if j.loads == NO and j.ruled_out)


__all__ = ["CHECKS", "EngineLoad", "Facts", "IF", "LLAMA_FAMILY", "WORKAROUNDS", "YES", "judge", "judge_checkpoint",
           "loads_in_line", "ruled_out_line"]
