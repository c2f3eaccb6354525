"""The output's README.md as a Hugging Face model card (huggingface_hub's ModelCard): metadata
(base_model with base_model_relation: quantized, library_name, tags) merged into the source's
card, a title that says the model is quantized, and quantcli's own section (what was quantized
how, what was left dense, how to serve it). A second conversion replaces quantcli's title and
section and keeps the rest of the source's card. No absolute local path is written: the model is
named by its Hub id or its folder name."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

from huggingface_hub import ModelCard, ModelCardData

from quantcli import __version__
from quantcli.checkpoint.manifest import MANIFEST_NAME
from quantcli.checkpoint.source import REPO_ID, Source
from quantcli.formats.engine_checks import IF, YES, EngineLoad, Facts, judge_checkpoint, loads_in_line
from quantcli.formats.engines import VLLM_KV_FLAGS, sglang_flag
from quantcli.formats.layouts import LAYOUTS
from quantcli.planning.plan import Plan
from quantcli.recipes import DENSE_RECIPES

CARD_HEADING = "## Quantization (quantcli)"
TITLE_MARK = "with quantcli)"  # quantcli's title ends so; a later conversion replaces that line
# tags by recipe family: what people search the Hub for
RECIPE_TAGS = {"fp8": "fp8", "fp8-channel": "fp8", "fp8-block": "fp8", "mxfp8": "mxfp8", "mxfp4": "mxfp4",
               "nvfp4": "nvfp4", "int8-channel": "int8"}
SERVE_PREFIXES = ("vllm serve ", "python -m sglang.launch_server --model-path ")


def write_model_card(plan: Plan, stage: Path) -> None:
    """README.md in `stage` (the source's, copied there, or none): the card for `plan`'s output.
    Its serving commands name the model MODEL (`quantcli push` puts the repo id there), so the
    output's bytes do not depend on the destination's name."""
    readme = stage / "README.md"
    card = _read_card(readme.read_text(encoding="utf-8") if readme.exists() else "")
    _update_metadata(card.data, plan)
    engines = output_loads(plan, stage)
    text = with_model_card(_without_title(card.text), card_section(plan, card.data.get("base_model"), engines))
    card.text = "\n" + _title(plan, card.data.get("base_model")) + ("" if text.startswith("\n") else "\n") + text
    readme.write_text(str(card).rstrip("\n") + "\n", encoding="utf-8")


def _read_card(text: str) -> ModelCard:
    """The card in `text`; a README without a metadata block gets an empty one (ModelCard would
    log a warning for it)."""
    if not text.startswith("---"):
        text = "---\n{}\n---\n" + text
    return ModelCard(text)


def base_model(source: Source, card_data: ModelCardData | None = None, quantized_source: bool = False) -> str | None:
    """The Hub repo the output quantizes: a quantized source's own base (its card says so), the
    source's repo id, or config.json's _name_or_path when it looks like a repo id; else None."""
    if quantized_source and card_data is not None and card_data.get("base_model_relation") == "quantized":
        base = card_data.get("base_model")
        if isinstance(base, str) and REPO_ID.match(base):
            return base
    if source.repo_id:
        return source.repo_id
    name = source.config.get("_name_or_path")
    if isinstance(name, str) and REPO_ID.match(name) and not Path(name).exists():
        return name
    return None


def _update_metadata(data: ModelCardData, plan: Plan) -> None:
    base = base_model(plan.source, data, quantized_source=plan.source_layout is not None)
    for key in ("base_model", "base_model_relation"):  # the source's own base is not ours
        data.pop(key, None)
    if base is not None:
        data.base_model = base
        if plan.layout is not None:
            data.base_model_relation = "quantized"
    # a transformers-format folder (config.json, HF names); a sentence-transformers model keeps its
    # library (its modules.json and pooling config are copied with it)
    if data.get("library_name") != "sentence-transformers":
        st = (plan.source.root / "modules.json").exists()
        data.library_name = "sentence-transformers" if st else "transformers"
    tags = list(data.tags or [])
    if "quantcli" in tags:  # a quantcli output converted again: its tags describe the source, not this
        tags = [t for t in tags if t not in _quantcli_tags()]
    ours = ["quantcli"]
    if plan.layout is None:
        ours.append(plan.dense_dtype)
    else:
        ours += ["quantized", *sorted({RECIPE_TAGS.get(r, r) for r in plan.recipes}), plan.layout.name]
    data.tags = tags + [t for t in dict.fromkeys(ours) if t not in tags]  # recipe tag fp8 = layout fp8: once


def _quantcli_tags() -> set[str]:
    return {"quantcli", "quantized", *RECIPE_TAGS.values(), *LAYOUTS, *DENSE_RECIPES}


def _model_name(plan: Plan, base: object) -> str:
    if isinstance(base, str) and base:
        return base.rsplit("/", 1)[-1]
    label = PurePosixPath(plan.source.label.rstrip("/"))
    return (label.parent.name if plan.source.single_file else label.name) or "model"


def _title(plan: Plan, base: object) -> str:
    name = _model_name(plan, base)
    if plan.layout is None:
        return f"# {name} (dequantized to {plan.dense_dtype} {TITLE_MARK}\n"
    recipes = ", ".join(r.upper() for r in sorted(plan.recipes))
    return f"# {name} ({recipes}, quantized {TITLE_MARK}\n"


def _without_title(text: str) -> str:
    """The card's text without a title an earlier quantcli conversion wrote."""
    lines = text.lstrip("\n").splitlines(keepends=True)
    if lines and lines[0].startswith("# ") and lines[0].rstrip().endswith(TITLE_MARK):
        lines = lines[1:]
    return "".join(lines).lstrip("\n")


def with_model_card(text: str, card: str) -> str:
    """`text` (the source's README) with `card` appended, or in place of the quantcli section a
    quantized source already carries (from its heading to the next '## ' heading or the end)."""
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == CARD_HEADING), None)
    if start is None:
        return text + ("\n" if text and not text.endswith("\n") else "") + card
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while start > 0 and not lines[start - 1].strip():  # the card brings its own blank line
        start -= 1
    head, tail = "".join(lines[:start]), "".join(lines[end:])
    if tail:
        card = card.rstrip("\n") + "\n\n"
    return head + card + tail


def output_loads(plan: Plan, folder: Path) -> list[EngineLoad]:
    """Each engine's verdict on the output in `folder` (its config.json and hf_quant_config.json
    as written, the plan's quantized shapes): the same table and checks as inspect's."""
    if plan.layout is None:
        return []
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if (folder / "hf_quant_config.json").exists():
        config["hf_quant_config"] = json.loads((folder / "hf_quant_config.json").read_text(encoding="utf-8"))
    modules = {t.module: (t.recipe, t.logical_shape) for t in plan.tensors if t.quantized}
    static = any(o.name.endswith((".input_scale", ".input_global_scale")) for t in plan.tensors for o in t.outputs)
    dense = tuple(e.module for e in plan.exclusions)
    return judge_checkpoint(plan.layout.name, Facts(modules, config, static, plan.transformers, dense))


def engines_table(engines: list[EngineLoad]) -> list[str]:
    """The card's engine table: each engine's verdict, why, and the loader code it rests on."""
    lines = ["Which engines load it (quantcli's engine table, its conditions checked on these files):", "",
             "| engine | loads | why | loader code |", "|---|---|---|---|"]
    for j in engines:
        lines.append(f"| {j.engine} | {j.loads} | {j.reason.replace('|', '/') or '-'} | "
                     + ", ".join(f"`{r}`" for r in j.rules.split("; ")) + " |")
    return lines + [""]


def card_section(plan: Plan, base: object = None, engines: list[EngineLoad] | None = None) -> str:
    """quantcli's section: what was done, the quantization table, what stayed dense, which engines
    load it, how to serve. The source is named as the front matter's base_model (the Hub id)
    when there is one."""
    engines = engines or []
    lines = ["", CARD_HEADING, ""]
    source = base if isinstance(base, str) and base else _model_name(plan, plan.source.repo_id)
    if plan.layout is None and plan.source_layout is None:  # a transform alone (--rotate --recipe fp32)
        lines += [f"`{source}` in {plan.dense_dtype} with its weights rotated (`--rotate {plan.options.rotate}`, "
                  f"quantcli {__version__}): the same model's function, a plain checkpoint, no quantization_config.",
                  ""]
        return "\n".join(lines)
    if plan.layout is None:
        lines += [f"Dequantized to {plan.dense_dtype} from the {plan.source_layout.name} checkpoint `{source}` with "
                  f"quantcli {__version__}: a plain checkpoint, no quantization_config.", ""]
        return "\n".join(lines)
    what = {"relayout": "carried over byte for byte", "requantize": "decoded and re-quantized",
            "quantize": "quantized"}
    lines += [f"Converted from `{source}` with quantcli {__version__}, layout `{plan.layout.name}` "
              f"(loads in {loads_in_line(engines)}).", "",
              "| recipe | modules | scale rule | how |", "|---|---|---|---|"]
    for name, mods in sorted(plan.modules_by_recipe().items()):
        actions = sorted({what[t.action] for t in plan.tensors if t.recipe == name})
        recipe = plan.recipes[name]
        rule = recipe.scale_rule or "-"
        if recipe.scale_search != "none":  # only then, so absmax cards keep their bytes
            rule = f"{rule if recipe.scale_rule else 'absmax'} + {recipe.scale_search} search"
        lines.append(f"| {name} | {len(mods)} | {rule} | {', '.join(actions)} |")
    lines += ["", f"Left unquantized ({plan.layout.exclusion_key}): "
              + ", ".join(f"`{n}`" for n in plan.excluded_names()), "",
              f"Every quantized tensor, its scales and their direction are listed in `{MANIFEST_NAME}`.", ""]
    return "\n".join(lines + engines_table(engines) + _serving(plan, engines))


def _serving(plan: Plan, loads: list[EngineLoad], model: str = "MODEL") -> list[str]:
    engines = {j.engine for j in loads if j.loads in (YES, IF)}
    commands = []
    if "vLLM" in engines:  # vLLM reads an FP8 KV cache from the config in some layouts only
        kv = VLLM_KV_FLAGS.get(plan.layout.name) if plan.options.kv_cache == "fp8" else None
        commands.append(f"{SERVE_PREFIXES[0]}{model}" + (f" {kv}" if kv else ""))
    if "SGLang" in engines:
        flags = {sglang_flag(r, plan.layout.name) for r in plan.recipes} - {None}
        commands.append(f"{SERVE_PREFIXES[1]}{model}" + "".join(f" --quantization {f}" for f in sorted(flags)))
    if not commands:
        return []
    return [f"Serve it ({model}: this folder, or the Hub repo it is pushed to):", "", "```bash", *commands, "```", ""]


def retarget_serving(text: str, repo_id: str) -> str:
    """The card with its serving commands naming `repo_id` (in place of MODEL, or of the repo an
    earlier push named)."""
    out = []
    for line in text.splitlines(keepends=True):
        if line.startswith("Serve it (MODEL: "):
            line = "Serve it:\n"
        for prefix in SERVE_PREFIXES:
            if line.startswith(prefix):
                model, _, rest = line[len(prefix):].partition(" ")
                end = "" if rest else ("\n" if model.endswith("\n") else "")
                line = prefix + repo_id + (" " + rest if rest else end)
        out.append(line)
    return "".join(out)


__all__ = ["CARD_HEADING", "base_model", "card_section", "engines_table", "output_loads", "retarget_serving",
           "with_model_card", "write_model_card"]
