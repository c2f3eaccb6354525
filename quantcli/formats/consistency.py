"""Whether a checkpoint's config can be loaded, and agrees with its tensors, read from the
headers: the engines load by the config, so a checkpoint without one loads nowhere, and one
that its tensors contradict loads wrong.

- missing_config: no config.json (or one that names no model): no engine can load it.
- contradictions: a quantization config over tensors that carry no such format (every Linear
  dense), or quantized codes with block scales that no config declares (an engine would load
  the codes as weights).

inspect lists them as problems, verify fails its config check; convert refuses a source without
a config or with codes no config declares, and warns about a stale quantization config (the
weights are dense, and the output's config replaces it)."""

from __future__ import annotations

from quantcli.checkpoint.source import Source
from quantcli.checkpoint.tensors import CheckpointTensors
from quantcli.formats.analysis import exclusion_list, is_excluded, linear_modules
from quantcli.formats.detect import Detected, all_names, codes_suffixes, config_with_extras, recipes_the_tensors_allow

CONFIG_NAME = "config.json"
DENSE_DTYPES = ("F32", "BF16", "F16")
NO_ENGINE = "transformers, vLLM and SGLang read the model's architecture from it"


def missing_config(source: Source) -> str | None:
    """What is wrong with the source's config.json for loading it anywhere, or None."""
    if not (source.root / CONFIG_NAME).is_file():
        where = source.repo_id or source.root
        return f"missing beside the weights (in {where}), so no engine can load the checkpoint ({NO_ENGINE})"
    if not source.config.get("model_type") and not source.config.get("architectures"):
        return f"names no model_type or architectures, so no engine can load the checkpoint ({NO_ENGINE})"
    return None


def config_fix(source: Source) -> str:
    if source.repo_id is not None:
        return f"the Hub repo {source.repo_id} lacks it; use the repo of the original model, or a local copy with it"
    return (f"copy the model's own {CONFIG_NAME} (from the repo or folder the weights came from) into "
            f"{source.root} and rerun")


def undeclared_codes(source: Source, tensors: CheckpointTensors) -> dict[str, set[str]]:
    """module -> the recipes its stored codes and block scales look like, for every module that
    holds quantized codes (U8, F8, I8 weights beside a scale tensor) by its tensors alone."""
    suffixes = codes_suffixes()
    out = {}
    for name in all_names(source):
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix is None or tensors.info(name).dtype not in ("U8", "F8_E4M3", "I8"):
            continue
        looks = recipes_the_tensors_allow(name[: -len(suffix)], tensors)
        if looks:
            out[name[: -len(suffix)]] = looks
    return out


def undeclared_codes_in(source: Source) -> bool:
    """Whether any module holds quantized codes with block scales (header only)."""
    with CheckpointTensors(source) as tensors:
        return bool(undeclared_codes(source, tensors))


def _declared_by(source: Source, det: Detected) -> str:
    if det.manifest is not None:
        return "quantcli_manifest.json"
    if source.config.get("quantization_config"):
        return "quantization_config"
    return "hf_quant_config.json" if det.extra_files.get("hf_quant_config.json") else "the config"


def contradictions(source: Source, det: Detected | None) -> list[str]:
    """One line per way the config and the tensors disagree (empty when they agree)."""
    if det is not None and det.modules:
        return []
    with CheckpointTensors(source) as tensors:
        coded = undeclared_codes(source, tensors)
        if det is None:
            return [_undeclared(coded, f"no config declares a quantization ({CONFIG_NAME} has no quantization_config; "
                                       f"no hf_quant_config.json, no quantcli manifest)")] if coded else []
        declared = f"{_declared_by(source, det)} declares a {det.layout.name} quantization"
        if coded:
            return [_undeclared(coded, f"{declared} that finds none of them (another producer's names?)")]
        excluded = exclusion_list(config_with_extras(source, det.extra_files))
        dense = [m for m in linear_modules(all_names(source), tensors) if not is_excluded(m, excluded)
                 and tensors.info(f"{m}.weight").dtype in DENSE_DTYPES]
        if not dense:
            return []
        dtype = tensors.info(f"{dense[0]}.weight").dtype
    return [f"{declared}, but no tensor carries it: {len(dense)} Linear(s) are dense and not excluded (e.g. "
            f"{dense[0]}.weight is {dtype}), so an engine would look for codes and scales that are not there; if the "
            f"weights are the dense model, remove quantization_config (or hf_quant_config.json)"]


def _undeclared(coded: dict[str, set[str]], why: str) -> str:
    module = sorted(coded)[0]
    return (f"{len(coded)} module(s) hold quantized codes with block scales (e.g. {module}, which looks like "
            f"{' or '.join(sorted(coded[module]))}), but {why}: an engine would load the codes as plain weights; "
            f"restore the producer's quantization config")


__all__ = ["config_fix", "contradictions", "missing_config", "undeclared_codes", "undeclared_codes_in"]
