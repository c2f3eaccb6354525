"""The conversion options a quantcli manifest records, rebuilt (verify --exact reruns GPTQ with
them): the recipe and per-module recipes, the layout, the MX scale rule, the scale search, the
excluded modules, the calibration (activations, KV cache, amounts) and the rounding settings.

What the manifest does not record exactly is rebuilt from what it does: per-module recipes
become exact-name overrides, the excluded modules exact-name ignores. A manifest whose modules
no single set of options gives (two MX scale rules, a scale search on some modules of a recipe
and not others) is refused in one line. The caller checks the plan of these options against
the manifest's fingerprint, which settles that they are the options convert ran with."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

from quantcli.checkpoint.manifest import Manifest
from quantcli.errors import QuantcliError
from quantcli.formats.facts import Calibration
from quantcli.planning.plan import Options
from quantcli.planning.rounding import GPTQ_SETTINGS, Rounding
from quantcli.recipes import get_recipe
from quantcli.rounding.gptq import GptqSettings

CANNOT = "--exact: cannot rebuild the conversion options from {label}'s manifest: "


def recorded_options(manifest: Manifest, cal: Calibration, label: str) -> Iterator[Options]:
    """The options `manifest` records, with `cal` as the calibration; more than one candidate
    where the manifest's record stands for several settings that round alike (act_order static
    records scales "original", whichever --gptq-scales was given): the caller keeps the one whose
    plan has the manifest's fingerprint."""
    if manifest.rounding is None or manifest.calibration is None:
        raise QuantcliError(CANNOT.format(label=label) + "it records no GPTQ rounding or no calibration")
    base = Options(recipe=manifest.recipe, layout=manifest.layout, ignore=list(manifest.excluded),
                   overrides=[(m.module, m.recipe) for m in manifest.modules if m.recipe != manifest.recipe],
                   scale_rule=_scale_rule(manifest, label), scale_search=_scale_search(manifest, label),
                   activations="static" if manifest.calibration.get("activations") == "static" else None,
                   kv_cache="fp8" if manifest.calibration.get("kv_cache") == "fp8" else None, calibration=cal)
    for rounding in _roundings(manifest.rounding, label):
        yield replace(base, ignore=list(base.ignore), overrides=list(base.overrides), rounding=rounding)


def _scale_rule(manifest: Manifest, label: str) -> str | None:
    """The MX scale rule (--scale-rule): one for every MX module, or none."""
    rules = {m.scale_rule for m in manifest.modules if get_recipe(m.recipe).scale_rules}
    if len(rules) > 1:
        raise QuantcliError(CANNOT.format(label=label) + f"its MX modules use scale rules "
                            f"{', '.join(sorted(rules))}, which no one --scale-rule gives")
    return next(iter(rules), None)


def _scale_search(manifest: Manifest, label: str) -> str:
    """--scale-search: what every module of a recipe that searches records, or none."""
    searching = [m for m in manifest.modules if get_recipe(m.recipe).searches]
    found = {m.scale_search or "none" for m in searching}
    if len(found) > 1:
        raise QuantcliError(CANNOT.format(label=label) + f"its modules were written with scale searches "
                            f"{', '.join(sorted(found))}, which no one --scale-search gives")
    return next(iter(found), "none")


def _roundings(record: Mapping[str, object], label: str) -> list[Rounding]:
    try:
        overrides = tuple((str(p), str(m)) for p, m in record["overrides"])  # type: ignore[union-attr]
        values = {s.key: s.read_back(dict(record)) for s in GPTQ_SETTINGS}
        owned = {owner: {s.key: values[s.key] for s in GPTQ_SETTINGS if s.owner is owner}
                 for owner in (GptqSettings, Rounding)}
        gptq = GptqSettings(**owned[GptqSettings])
        # act_order static records scales "original" whichever was asked (see recorded_options)
        scales = ["updated", "original"] if gptq.act_order == "static" else [gptq.scales]
        return [Rounding(str(record["default"]), overrides, replace(gptq, scales=s), **owned[Rounding])
                for s in scales]
    except (KeyError, TypeError, ValueError) as exc:
        raise QuantcliError(CANNOT.format(label=label) + f"its rounding record is malformed ({exc})") from None
