"""Conversion options: a TOML recipe file (--config) checked once, merged with the command line
into plan.Options. The command line wins over the file; --ignore patterns add to the file's."""

from __future__ import annotations

import tomllib
from pathlib import Path

from quantcli.errors import QuantcliError, did_you_mean, pick
from quantcli.formats.facts import CALIBRATION_SAMPLES, Calibration
from quantcli.formats.layouts import LAYOUTS
from quantcli.kernels.spec import SCALE_RULES, SCALE_SEARCHES
from quantcli.planning.auto import AutoRequest, auto_request
from quantcli.planning.calibration import check_options
from quantcli.planning.plan import Options
from quantcli.planning.rounding import GPTQ_SETTINGS, METHODS, Rounding, rounding_options
from quantcli.planning.transforms import ROTATIONS
from quantcli.recipes import DENSE_RECIPES, RECIPES


def conversion_options(*, recipe: str | None, layout: str | None, ignore: list[str], config: Path | None,
                       scale_rule: str | None, calibrate: dict | None = None,
                       scale_search: str | None = None, rounding: dict | None = None,
                       rotate: str | None = None, auto: dict | None = None) -> Options:
    """The options of one conversion, from the command line and the recipe file (if any);
    `calibrate`: the command line's activations, kv_cache, calibration and calibration_* values;
    `rounding`: the command line's rounding and gptq_* values; `auto`: its auto, target_bits and
    max_size values."""
    opts = Options(recipe=recipe or "")
    data: dict = {}
    if config is not None:
        data = load_recipe_file(config)
        opts.recipe = recipe or data.get("recipe", "")
        opts.layout = data.get("layout")
        opts.scale_rule = data.get("scale_rule")
        opts.scale_search = data.get("scale_search", "none")
        opts.targets = list(data.get("targets", []))
        opts.ignore = list(data.get("ignore", []))
        opts.overrides = [(o["pattern"], o["recipe"]) for o in data.get("override", [])]
    opts.layout = layout or opts.layout
    opts.scale_rule = scale_rule or opts.scale_rule
    opts.scale_search = scale_search or opts.scale_search
    opts.ignore += ignore
    opts.rotate = rotate or data.get("rotate")
    opts.rounding = _rounding_options(data, rounding or {})
    _calibration_options(opts, data, {**(calibrate or {}), "auto": (auto or {}).get("auto")})
    opts.auto = _auto_request(opts, data, auto or {})
    return opts  # no recipe: the planner takes a quantized source's own (conversion.default_recipe)


_CALIBRATION_KEYS = {"activations": ("static", "dynamic"), "kv_cache": ("fp8", "none"), "calibration": None,
                     "calibration_samples": CALIBRATION_SAMPLES, "calibration_seq_len": 512, "calibration_batch": 1}


_AUTO_KEYS = {"auto": "--auto", "target_bits": "--target-bits", "max_size": "--max-size"}


def _auto_request(opts: Options, data: dict, given: dict) -> AutoRequest | None:
    """--auto, --target-bits, --max-size: the command line over the file; checked once."""
    values = {}
    for key, flag in _AUTO_KEYS.items():
        if given.get(key) is not None:
            values[key] = (given[key], flag)
        elif key in data:
            values[key] = (data[key], f"{key} in --config")
    if "auto" in values and opts.recipe:  # the conflict first: fixing the budget would not help
        raise QuantcliError(f"{values['auto'][1]}: chooses each module's recipe among the candidates; drop the "
                            f"recipe ({opts.recipe})")
    if "auto" in values and opts.overrides:
        raise QuantcliError(f"{values['auto'][1]}: chooses each module's recipe; [[override]] tables would fight it, "
                            f"drop them (--ignore still keeps modules dense)")
    return auto_request(values, opts.calibration is not None)


def _rounding_options(data: dict, given: dict) -> Rounding:
    """--rounding and --gptq-*: the command line over the file."""
    values = {}
    for s in GPTQ_SETTINGS:
        if given.get(s.file_key) is not None:
            values[s.key] = (given[s.file_key], s.flag)
        elif s.file_key in data:
            values[s.key] = (data[s.file_key], f"{s.file_key} in --config")
    overrides = [(o["pattern"], o["rounding"]) for o in data.get("rounding_override", [])]
    return rounding_options(given.get("rounding") or data.get("rounding"), overrides, values)


def _calibration_options(opts: Options, data: dict, given: dict) -> None:
    """--activations, --kv-cache, --calibration*: the command line over the file; checked once."""
    merged = {k: given[k] if given.get(k) is not None else data.get(k) for k in _CALIBRATION_KEYS}
    opts.activations = merged["activations"] if merged["activations"] == "static" else None
    opts.kv_cache = merged["kv_cache"] if merged["kv_cache"] == "fp8" else None
    cal = None
    if merged["calibration"] is None:  # sizes for a calibration that is not there would be ignored
        for k in (k for k in _CALIBRATION_KEYS if k.startswith("calibration_")):
            if merged[k] is not None:
                where = f"--{k.replace('_', '-')} {merged[k]}" if given.get(k) is not None else f"{k} in --config"
                raise QuantcliError(f"{where}: only used with --calibration DATA, which is not given; add "
                                    f"--calibration or drop it")
    if merged["calibration"] is not None:
        sizes = {k: merged[k] if merged[k] is not None else _CALIBRATION_KEYS[k] for k in _CALIBRATION_KEYS
                 if k.startswith("calibration_")}
        for k, v in sizes.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise QuantcliError(f"--{k.replace('_', '-')}: must be a positive integer, got {v!r}")
        cal = Calibration(str(merged["calibration"]), sizes["calibration_samples"], sizes["calibration_seq_len"],
                          sizes["calibration_batch"])
    opts.calibration = cal
    check_options(opts.activations, opts.kv_cache, cal, opts.scale_search, opts.rounding.data_aware,
                  scored=given.get("auto") is not None or "auto" in data)


def load_recipe_file(path: Path) -> dict:
    """Read a TOML recipe file: recipe, layout, scale_rule, targets, ignore, [[override]]. Every
    value is checked here, once, so that a wrong type is refused instead of misread (a string
    `targets` would otherwise be iterated character by character); names come back canonical."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantcliError(f"--config {path}: no such file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as exc:
        raise QuantcliError(f"--config {path}: not valid TOML ({exc})") from None
    return _check_recipe_file(data, f"--config {path}")


_TOML_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a float", list: "an array",
               dict: "a table"}


def _toml_type(value: object) -> str:
    return _TOML_TYPES.get(type(value), "a date/time")


def _check_recipe_file(data: dict, where: str) -> dict:
    known = ("recipe", "layout", "scale_rule", "scale_search", "targets", "ignore", "override", *_CALIBRATION_KEYS,
             "rounding", *(s.file_key for s in GPTQ_SETTINGS), "rounding_override", "rotate", *_AUTO_KEYS)
    for key in data:
        if key not in known:
            raise QuantcliError(f"{where}: unknown key {key!r}{did_you_mean(key, known)} (allowed: {', '.join(known)})")

    def string(key: str, value: object, example: str) -> str:
        if not isinstance(value, str):
            raise QuantcliError(f"{where}: {key} is {_toml_type(value)}; expected a string, e.g. {example}")
        return value

    def strings(key: str, example: str) -> list[str]:
        value = data[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            got = _toml_type(value) if not isinstance(value, list) else "an array holding a non-string"
            raise QuantcliError(f"{where}: {key} is {got}; expected an array of strings, e.g. {example}")
        return list(value)

    out: dict = {}
    names = {"recipe": [*RECIPES, *DENSE_RECIPES], "layout": list(LAYOUTS), "scale_rule": list(SCALE_RULES),
             "scale_search": list(SCALE_SEARCHES), "rounding": list(METHODS), "rotate": list(ROTATIONS)}
    for key, choices in names.items():
        if key in data:
            value = string(key, data[key], f'{key} = "{choices[0]}"')
            out[key] = pick(f"{where}: {key}", key.replace("_", " "), value, choices)
    for key, choices in _CALIBRATION_KEYS.items():
        if key in data and isinstance(choices, tuple):
            out[key] = pick(f"{where}: {key}", key.replace("_", " "), string(key, data[key], f'{key} = "{choices[0]}"'),
                            list(choices))
        elif key in data:
            out[key] = data[key] if key != "calibration" else string(key, data[key], 'calibration = "data.jsonl"')
    for s in GPTQ_SETTINGS:
        if s.file_key in data and s.choices:
            key = s.file_key
            out[key] = pick(f"{where}: {key}", s.key.replace("_", " "),
                            string(key, data[key], f'{key} = "{s.choices[0]}"'), list(s.choices))
        elif s.file_key in data:
            out[s.file_key] = data[s.file_key]  # numbers: checked with the command line's (Setting.checked)
    if "rounding_override" in data:
        out["rounding_override"] = _pattern_tables(data["rounding_override"], where, string, "rounding_override",
                                                   "rounding", ('"gptq"', '"gptq"'), list(METHODS))
    for key in ("targets", "ignore", "auto"):
        if key in data:
            out[key] = strings(key, f'{key} = ["*q_proj"]' if key != "auto" else 'auto = ["nvfp4", "fp8-block"]')
    if "target_bits" in data:
        out["target_bits"] = data["target_bits"]  # a number: checked with the command line's (auto.auto_request)
    if "max_size" in data:
        out["max_size"] = string("max_size", data["max_size"], 'max_size = "3.5GiB"')
    if "override" in data:
        out["override"] = _pattern_tables(data["override"], where, string, "override", "recipe",
                                          ('"NAME"', '"fp8"'), list(RECIPES))
    return out


def _pattern_tables(tables: object, where: str, string, table: str, key: str, examples: tuple[str, str],
                    choices: list[str]) -> list[dict]:
    """[[override]] (pattern, recipe) or [[rounding_override]] (pattern, rounding) tables, each
    checked: exactly `pattern` and `key`, strings, `key` one of `choices`. `examples`: the value
    shown in the table-type message and in a wrong-type one."""
    if not isinstance(tables, list):
        raise QuantcliError(f"{where}: {table} is {_toml_type(tables)}; expected [[{table}]] tables "
                            f'with pattern = "GLOB" and {key} = {examples[0]}')
    out = []
    for i, o in enumerate(tables, 1):
        label = f"[[{table}]] #{i}"
        if not isinstance(o, dict) or set(o) != {"pattern", key}:
            raise QuantcliError(f"{where}: {label} needs exactly 'pattern' and '{key}' "
                                f"(got {sorted(o) if isinstance(o, dict) else _toml_type(o)})")
        pattern = string(f"{label} pattern", o["pattern"], 'pattern = "*mlp*"')
        value = pick(f"{where}: {label} {key}", key, string(f"{label} {key}", o[key], f"{key} = {examples[1]}"),
                     choices)
        out.append({"pattern": pattern, key: value})
    return out
