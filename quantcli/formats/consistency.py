"""Whether a checkpoint's config can be loaded, and agrees with its tensors, read from the
headers: the engines load by the config, so a checkpoint without one loads nowhere.

- missing_config: no config.json (or one that names no model): no engine can load it.

inspect lists it as a problem, verify fails its config check, convert refuses the source."""

from __future__ import annotations

from quantcli.checkpoint.source import Source

CONFIG_NAME = "config.json"
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


__all__ = ["config_fix", "missing_config"]
