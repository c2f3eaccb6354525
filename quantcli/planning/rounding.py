"""How the weights are rounded (`--rounding`, `rounding` and `[[rounding_override]]` in the TOML
recipe file): to nearest (the recipe's quantizer alone), or by GPTQ from the calibration data
(quantcli/rounding/gptq.py, run by the weight pass convert/passes/gptq_pass.py), per module
pattern, first match wins."""

from __future__ import annotations

from dataclasses import dataclass, field

from quantcli.errors import QuantcliError
from quantcli.formats.patterns import matches, validate
from quantcli.rounding.gptq import ACT_ORDERS, SCALE_CHOICES, GptqSettings

NEAREST, GPTQ = "nearest", "gptq"
METHODS = (NEAREST, GPTQ)
INPUTS = ("quantized", "dense")
# An expert (or any module) that fewer calibration tokens reached is rounded to nearest and
# named: H from a handful of tokens has rank below K and GPTQ would fit them, not the module.
MIN_TOKENS = 32


@dataclass(frozen=True)
class Rounding:
    method: str = NEAREST  # for modules no override matches
    overrides: tuple[tuple[str, str], ...] = ()  # (pattern, method), first match wins
    gptq: GptqSettings = field(default_factory=GptqSettings)
    min_tokens: int = MIN_TOKENS
    inputs: str = "quantized"  # each layer's statistics from the quantized layers before it, or the source's
    # How the user gave the scale choice (`--gptq-scales original`, `gptq_scales = "original" in
    # --config`); None: the default. Not a setting (no part of the fingerprint or of equality):
    # planning refuses it where it changes nothing (rounding_plan.check_scales_option).
    scales_given: str | None = field(default=None, compare=False)

    def method_for(self, module: str) -> str:
        for pattern, method in self.overrides:
            if matches(pattern, module):
                return method
        return self.method

    @property
    def data_aware(self) -> bool:
        """Whether any module may be rounded from the calibration data."""
        return self.method == GPTQ or any(m == GPTQ for _, m in self.overrides)

    def record(self) -> dict:
        """The manifest's account of the method (data-aware runs only)."""
        return {**self.gptq.record(), "min_tokens": self.min_tokens, "inputs": self.inputs,
                "default": self.method, "overrides": [list(o) for o in self.overrides]}

    def fingerprint(self) -> str:
        return repr((self.method, self.overrides, self.gptq, self.min_tokens, self.inputs))


GPTQ_FLAGS = {"dampening": "--gptq-dampening", "act_order": "--gptq-act-order", "scales": "--gptq-scales",
              "min_tokens": "--gptq-min-tokens", "inputs": "--gptq-inputs"}


def rounding_options(method: str | None, overrides: list[tuple[str, str]], gptq: dict, where: dict) -> Rounding:
    """The Rounding of the merged command line and recipe file; `gptq` holds the given GPTQ
    values by field (None: not given), `where` how the user gave each (for messages)."""
    method = method or NEAREST
    if method not in METHODS:
        raise QuantcliError(f"--rounding {method!r}: choose one of {', '.join(METHODS)}")
    for pattern, m in overrides:
        validate(pattern, "[[rounding_override]] pattern")
        if m not in METHODS:
            raise QuantcliError(f"[[rounding_override]] {pattern!r}: rounding {m!r} is not one of {', '.join(METHODS)}")
    r = Rounding(method, tuple(overrides))
    given = {k: v for k, v in gptq.items() if v is not None}
    if given and not r.data_aware:
        k = sorted(given)[0]
        fix = 'rounding = "gptq" in the file' if "--config" in where.get(k, "") else "--rounding gptq"
        raise QuantcliError(f"{where.get(k, GPTQ_FLAGS[k])}: only used with --rounding gptq; add {fix} or drop the "
                            f"option")
    settings = GptqSettings(dampening=_dampening(given.get("dampening", r.gptq.dampening), where),
                            act_order=_one_of("act_order", given.get("act_order", "static"), ACT_ORDERS, where),
                            scales=_one_of("scales", given.get("scales", "updated"), SCALE_CHOICES, where))
    tokens = given.get("min_tokens", MIN_TOKENS)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        flag = where.get("min_tokens", "--gptq-min-tokens")
        raise QuantcliError(f"{flag}: must be a positive integer, got {tokens!r}")
    return Rounding(method, tuple(overrides), settings, tokens, _one_of("inputs", given.get("inputs", "quantized"),
                                                                        INPUTS, where),
                    _given_as("scales", settings.scales, where) if "scales" in given else None)


def _given_as(key: str, value: str, where: dict) -> str:
    """`--gptq-scales original`, or `gptq_scales = "original" in --config`: how the user said it."""
    flag = where.get(key, GPTQ_FLAGS[key])
    return f"{flag} {value}" if flag.startswith("--") else f'{flag.split()[0]} = "{value}" in --config'


def _dampening(value: object, where: dict) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
        raise QuantcliError(f"{where.get('dampening', '--gptq-dampening')}: must be a number in (0, 1] (a fraction "
                            f"of H's mean diagonal), got {value!r}")
    return float(value)


def _one_of(key: str, value: object, choices: tuple[str, ...], where: dict) -> str:
    if value not in choices:
        raise QuantcliError(f"{where.get(key, GPTQ_FLAGS[key])}: {value!r} is not one of {', '.join(choices)}")
    return str(value)
