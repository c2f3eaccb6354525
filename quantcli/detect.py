"""Recognise a checkpoint's quantization layout and which recipe each module carries.

Shared by `inspect`, `verify` and `convert` from quantized sources. Detection reads configs and
tensor names only (no data)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .layouts import LAYOUTS, Layout
from .manifest import MANIFEST_NAME, Manifest
from .source import Source

MODULE_SUFFIXES = (".weight_packed", ".weight", "_blocks")


@dataclass
class Detected:
    layout: Layout
    modules: dict[str, str]  # module -> recipe
    manifest: Manifest | None
    extra_files: dict[str, dict]


def extra_files(source: Source) -> dict[str, dict]:
    out = {}
    path = source.root / "hf_quant_config.json"
    if path.exists():
        try:
            out["hf_quant_config.json"] = json.loads(path.read_text())
        except ValueError:
            out["hf_quant_config.json"] = {}
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


def quantized_modules(source: Source, layout: Layout, manifest: Manifest | None, extras: dict[str, dict]) -> dict[str, str]:
    if manifest is not None:
        return {m.module: m.recipe for m in manifest.modules}
    names = all_names(source)
    config = config_with_extras(source, extras)
    out = {}
    for name in names:
        for suffix in MODULE_SUFFIXES:
            if name.endswith(suffix):
                module = name[: -len(suffix)]
                recipe = layout.module_recipe(module, names, config)
                if recipe:
                    out[module] = recipe
                break
    return out


def detect(source: Source) -> Detected | None:
    extras = extra_files(source)
    manifest = read_manifest(source)
    layout = detect_layout(source, manifest, extras)
    if layout is None:
        return None
    return Detected(layout, quantized_modules(source, layout, manifest, extras), manifest, extras)
