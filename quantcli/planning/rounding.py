"""How the weights are rounded (`--rounding`, `rounding` and `[[rounding_override]]` in the TOML
recipe file): to nearest (the recipe's quantizer alone), or by GPTQ from the calibration data
(quantcli/rounding/gptq.py, run by the weight pass convert/passes/gptq_pass.py), per module
pattern, first match wins."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from quantcli.errors import QuantcliError
from quantcli.formats.patterns import matches, validate
from quantcli.planning.settings import Setting
from quantcli.rounding.settings import ACT_ORDERS, SCALE_CHOICES, GptqSettings

NEAREST, GPTQ = "nearest", "gptq"
METHODS = (NEAREST, GPTQ)
INPUTS = ("quantized", "dense")
FORWARDS = ("float32", "bfloat16")  # the layer forwards' matmuls (model/layers.py matmuls_in)
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
    forward: str = "float32"  # the walk's layers: FP32, or their matmuls in BF16 under torch.autocast
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
        """The manifest's account of the method (data-aware runs only): GptqSettings' fields, then
        every GPTQ setting held here (GPTQ_SETTINGS), the default method and the overrides."""
        own = {s.key: getattr(self, s.key) for s in GPTQ_SETTINGS if s.owner is Rounding}
        return {"method": GPTQ, **asdict(self.gptq), **own, "default": self.method,
                "overrides": [list(o) for o in self.overrides]}

    def fingerprint(self) -> str:
        # forward only where it is not float32: what every run did before the option existed, so
        # their manifests (verify --exact) and staged layers (--resume) keep their fingerprints
        forward = () if self.forward == "float32" else (self.forward,)
        return repr((self.method, self.overrides, self.gptq, self.min_tokens, self.inputs, *forward))


GPTQ_SETTINGS = (  # the --gptq-* options (planning/settings.py), in the order --help lists them
    Setting("dampening", GptqSettings, "F", "GPTQ: dampening, a fraction of mean diag(X^T X) added to it.",
            kind=float, valid=lambda v: 0 < v <= 1, expected="a number in (0, 1] (a fraction of H's mean diagonal)"),
    Setting("act_order", GptqSettings, "ORDER",
            "GPTQ: static rounds columns by decreasing input energy, none in their order.", choices=ACT_ORDERS,
            noun="GPTQ column order"),
    Setting("scales", GptqSettings, "FROM",
            "GPTQ, block formats: choose each block's scale from the updated or the original weights (per-tensor and "
            "per-row scales always come from the original weights).", choices=SCALE_CHOICES,
            noun="GPTQ scale choice"),
    Setting("block_columns", GptqSettings, "N",
            "GPTQ: columns per lazy batch update (the error reaches later columns once per block).",
            kind=int, valid=lambda v: v >= 1, expected="a positive integer"),
    Setting("min_tokens", Rounding, "N",
            "GPTQ: a module (an MoE expert) fewer calibration tokens reached is rounded to nearest.",
            kind=int, valid=lambda v: v >= 1, expected="a positive integer"),
    Setting("inputs", Rounding, "FROM",
            "GPTQ: quantized takes each layer's inputs from the layers already quantized (sequential), dense from the "
            "source model.", choices=INPUTS, noun="GPTQ inputs"),
    Setting("forward", Rounding, "DTYPE",
            "GPTQ: the layer forwards in float32, or their matmuls and what they feed in bfloat16 (torch autocast; "
            "the residual stream stays FP32): layers ~4x faster on CPUs with AMX, other bytes, slightly less accurate "
            "(docs/gptq.md).",
            choices=FORWARDS, noun="GPTQ forward dtype", absent_means_default=True),
)


def rounding_options(method: str | None, overrides: list[tuple[str, str]], given: dict[str, tuple[object, str]]
                     ) -> Rounding:
    """The Rounding of the merged command line and recipe file; `given` holds each GPTQ value the
    user gave, by Setting key, with where it was given ('--gptq-scales', 'gptq_scales in --config')."""
    method = method or NEAREST
    if method not in METHODS:
        raise QuantcliError(f"--rounding {method!r}: choose one of {', '.join(METHODS)}")
    for pattern, m in overrides:
        validate(pattern, "[[rounding_override]] pattern")
        if m not in METHODS:
            raise QuantcliError(f"[[rounding_override]] {pattern!r}: rounding {m!r} is not one of {', '.join(METHODS)}")
    data_aware = Rounding(method, tuple(overrides)).data_aware
    if given and not data_aware:
        where = given[sorted(given)[0]][1]
        fix = 'rounding = "gptq" in the file' if "--config" in where else "--rounding gptq"
        raise QuantcliError(f"{where}: only used with --rounding gptq; add {fix} or drop the option")
    values = {s.key: s.checked(*given[s.key]) if s.key in given else s.default for s in GPTQ_SETTINGS}
    owned = {owner: {s.key: values[s.key] for s in GPTQ_SETTINGS if s.owner is owner} for owner in (GptqSettings,
                                                                                                    Rounding)}
    scales_given = None
    if "scales" in given:  # how the user said it: `--gptq-scales original` or `gptq_scales = "original" in --config`
        where = given["scales"][1]
        scales_given = f"{where} {values['scales']}" if where.startswith("--") else \
            f'{where.split()[0]} = "{values["scales"]}" in --config'
    return Rounding(method, tuple(overrides), GptqSettings(**owned[GptqSettings]), **owned[Rounding],
                    scales_given=scales_given)
