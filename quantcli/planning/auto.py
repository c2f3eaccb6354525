"""`convert --auto R1,R2 --target-bits B` (or `--max-size SIZE`): one recipe per module group,
chosen to minimise the predicted model output error under a bit budget, from headers and scores.

Groups are what engines run in one precision: a fused group (q/k/v, gate/up, ...), the experts of
one MoE layer, else one module. A group's options are the candidates that the planner's own shape
checks (`plan.unfit_reason`) accept for every member and that no engine loading the recipe in the
layout refuses for the group's shapes (the engines table's shape conditions); `bf16` keeps the
group dense (stored as the source stores it). An option's cost is the bits the layout writes for
the group's weights in that recipe (`plan.output_specs`: codes, block scales, global scales,
shapes), its error the sum of the members' scores: each module's model output error with it alone
quantized in that recipe (evaluate/auto_scores.py). Summing assumes the errors add up (an additive
model; interactions between modules are not scored). The solve is knapsack.solve, exact on those integer costs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from fractions import Fraction

from quantcli.checkpoint.safetensors_io import DTYPES
from quantcli.errors import QuantcliError, UsageError, pick
from quantcli.formats.engine_checks import CHECKS, Facts
from quantcli.formats.engines import WHEN, verdicts
from quantcli.formats.experts import experts_module
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import Layout, get_layout, layouts_for, layouts_holding, module_of
from quantcli.planning import knapsack
from quantcli.planning.plan import Exclusion, Options, Plan, output_specs, unfit_reason
from quantcli.planning.rounding import Rounding
from quantcli.recipes import RECIPES, Recipe, get_recipe

DENSE = "bf16"  # the candidate that leaves a group dense
CANDIDATES = (*RECIPES, DENSE)
SCORER = "output error with the module alone quantized (KL for a causal LM, 1 - pooled cosine for an encoder)"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True)
class AutoRequest:
    candidates: tuple[str, ...]
    target_bits: float | None = None  # average stored bits per quantizable weight, at most
    max_size: int | None = None  # bytes of the output's tensors, at most
    max_size_text: str | None = None  # as the user wrote it

    @property
    def quantizing(self) -> tuple[str, ...]:
        return tuple(c for c in self.candidates if c != DENSE)

    @property
    def budget_label(self) -> str:
        if self.target_bits is not None:
            return f"--target-bits {self.target_bits:g}"
        return f"--max-size {self.max_size_text}"


def parse_candidates(value: object, where: str) -> tuple[str, ...]:
    """'nvfp4,fp8-block' (or a TOML array) -> canonical names, in order, each once."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) and not isinstance(items, tuple) or not all(isinstance(v, str) for v in items):
        raise UsageError(f'{where}: expected recipe names, e.g. "nvfp4,fp8-block" (or auto = ["nvfp4", "fp8-block"])')
    names = tuple(dict.fromkeys(pick(where, "candidate recipe", v.strip(), CANDIDATES) for v in items if v.strip()))
    if not any(n != DENSE for n in names):
        raise UsageError(f"{where}: needs at least one quantizing recipe (bf16 alone leaves everything dense)")
    return names


def parse_size(value: object, where: str) -> int:
    """'3.5GiB' -> bytes (binary units B, KiB, MiB, GiB, TiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    unit = {u.lower(): u for u in _UNITS}.get(m.group(2).lower() or "b") if m else None  # 3.5gib is 3.5GiB
    if m is None or unit is None or float(m.group(1)) <= 0:
        decimal = {"kb": "KiB", "mb": "MiB", "gb": "GiB", "tb": "TiB"}.get(m.group(2).lower()) if m else None
        hint = f"; did you mean {m.group(1)}{decimal}? (1 GiB = 2^30 bytes)" if decimal else ""
        raise UsageError(f"{where}: expected a positive size in binary units (B, KiB, MiB, GiB, TiB), e.g. 3.5GiB; "
                         f"got {value!r}{hint}")
    return int(Fraction(m.group(1)) * _UNITS[unit])


def auto_request(values: dict, calibrated: bool) -> AutoRequest | None:
    """The request from {auto, target_bits, max_size} (each with where it was given), or None."""
    (auto, a_where), (bits, b_where), (size, s_where) = (values.get(k, (None, "")) for k in
                                                         ("auto", "target_bits", "max_size"))
    if auto is None:
        given = b_where if bits is not None else s_where if size is not None else None
        if given:
            raise UsageError(f"{given}: only used with --auto R1,R2 (the candidate recipes); add --auto or drop it")
        return None
    candidates = parse_candidates(auto, a_where)
    if (bits is None) == (size is None):
        raise UsageError(f"{a_where}: give exactly one budget, --target-bits B (average bits per quantized weight) "
                         f"or --max-size SIZE (the whole output, e.g. 3.5GiB)")
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= 64):
        raise UsageError(f"{b_where}: must be a number of bits per weight above 0, e.g. 5.0; got {bits!r}")
    if not calibrated:
        raise UsageError(f"{a_where}: scores each module on data; add --calibration DATA (.txt or .jsonl)")
    if size is not None:
        return AutoRequest(candidates, max_size=parse_size(size, s_where), max_size_text=str(size).strip())
    return AutoRequest(candidates, target_bits=float(bits))


def auto_layout(request: AutoRequest, requested: str | None) -> Layout:
    """The layout that holds every candidate and any mix of them: --layout, else the first such;
    refused before any work when there is none, naming what each layout holds."""
    want = set(request.quantizing)
    if requested is not None:
        layout = get_layout(requested)
        for r in sorted(want):
            layout.require(r, layouts_for(r))
        layout.require_mix(want, layouts_holding(want))
        return layout
    holding = layouts_holding(want)
    if holding:
        return get_layout(holding[0])
    loadable = []
    for name in layouts_holding(set()):
        held = {r for r in want if get_layout(name).supports(r)}
        if held and get_layout(name).mix_problem(held) is None:
            loadable.append(f"{name} ({', '.join(sorted(held))})")
    raise QuantcliError(f"--auto {','.join(request.candidates)}: no layout holds a mix of all of them, so the choice "
                        f"could load nowhere; layouts and the candidates they can mix: {'; '.join(loadable) or 'none'}")


@dataclass(frozen=True)
class AutoGroup:
    key: str  # the fused group, the MoE layer's experts, or the module
    modules: tuple[str, ...]
    weights: int  # parameters
    costs: tuple[tuple[str, int], ...]  # (candidate, bits as written), candidates' order


BASE_RECIPE = "fp8"  # per tensor: no shape rule of its own, so its plan finds every quantizable module


def base_options(opts: Options, layout: Layout) -> Options:
    """The options of the plan that lists the quantizable modules (what --ignore, targets, module
    kinds and the layout leave), before any candidate's shape rules."""
    fits = layout.supports(BASE_RECIPE) and BASE_RECIPE not in layout.needs_static
    return replace(opts, recipe=BASE_RECIPE, layout=layout.name if fits else None, overrides=[], auto=None,
                   auto_choice=None, rounding=Rounding(), activations=None, kv_cache=None, scale_search="none",
                   scale_rule=None)


def group_key(module: str, tensor: str) -> str:
    if ".experts." in tensor:
        return experts_module(tensor)
    return fused_group_of(module) or module


def auto_groups(base: Plan, request: AutoRequest, layout: Layout, recipes: dict[str, Recipe]
                ) -> tuple[list[AutoGroup], list[str]]:
    """The groups that have at least one option, and the modules of those that have none."""
    members: dict[str, list] = {}
    for t in base.tensors:
        if t.quantized:
            members.setdefault(group_key(t.module, t.name), []).append(t)
    groups, none = [], []
    for key in sorted(members):
        ts = members[key]
        costs = []
        for c in request.candidates:
            if c == DENSE:
                costs.append((c, sum(8 * t.bytes_in for t in ts)))
            elif (all(unfit_reason(recipes[c], layout, t.name, t.logical_shape, t.dtype) is None for t in ts)
                  and engine_shape_problem(c, layout.name, {t.module: t.logical_shape for t in ts}) is None):
                costs.append((c, sum(8 * o.nbytes for t in ts for o in output_specs(
                    layout, t.module, recipes[c], t.logical_shape, DTYPES[t.dtype]))))
        modules = tuple(t.module for t in ts)
        if costs:
            groups.append(AutoGroup(key, modules, sum(t.numel for t in ts), tuple(costs)))
        else:
            none.extend(modules)
    return groups, none


SHAPE_CHECKS = ("nk128", "k128", "fused_n128", "fused_n128_but_last")  # formats/engine_checks.py's shape rules


def engine_shape_problem(recipe: str, layout: str, shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why an engine that loads `recipe` in `layout` would not load these modules in it (the
    engines table's shape conditions: fp8-block's 128 multiples, per fused part), or None."""
    facts = Facts(modules={m: (recipe, s) for m, s in shapes.items()})
    for engine, v in verdicts(recipe, layout).items():
        if v.status != WHEN:
            continue
        for key in (k for k in v.checks if k in SHAPE_CHECKS):
            why = CHECKS[key](facts, recipe)
            if why:
                return f"{engine}: {why}"
    return None


def budget_bits(request: AutoRequest, groups: list[AutoGroup], base: Plan, left_dense: list[str]) -> int:
    """target_bits x the groups' weights; or max_size's bits less every other tensor's as written."""
    if request.target_bits is not None:
        return math.floor(Fraction(repr(request.target_bits)) * sum(g.weights for g in groups))
    auto = {m for g in groups for m in g.modules}
    fixed = sum(t.bytes_in if t.quantized and t.module in left_dense else t.bytes_out for t in base.tensors
                if not (t.quantized and t.module in auto))
    return 8 * (request.max_size - fixed)


def check_feasible(request: AutoRequest, groups: list[AutoGroup], budget: int) -> None:
    """Refuse (before any scoring) a budget below the cheapest choice, saying what is achievable."""
    least = knapsack.cheapest([[knapsack.Option(c, 0.0) for _, c in g.costs] for g in groups])
    if least <= budget:
        return
    weights = sum(g.weights for g in groups)
    if request.target_bits is not None:
        raise UsageError(f"{request.budget_label}: below the least achievable {least / weights:.4f} bits per weight "
                         f"for these candidates ({', '.join(request.candidates)}); raise it or add a smaller recipe")
    need = request.max_size + -(-(least - budget) // 8)
    raise UsageError(f"{request.budget_label}: below the least achievable output size, {need:,} bytes "
                     f"({_binary(need)}) with these candidates ({', '.join(request.candidates)})")


def _binary(size: int) -> str:
    """1190456 -> '1.14 MiB': the largest binary unit under which the size is at least 1."""
    unit = max((u for u, n in _UNITS.items() if size >= n), key=_UNITS.get, default="B")
    return f"{size / _UNITS[unit]:.2f} {unit}"


@dataclass(frozen=True)
class AutoChoice:
    request: AutoRequest
    layout: str
    budget_bits: int
    groups: tuple[AutoGroup, ...]
    picks: tuple[str, ...]  # per group, its candidate
    scores: dict[str, dict[str, float]]  # module -> candidate -> output error alone
    cost_bits: int
    predicted_error: float
    left_dense: tuple[str, ...] = ()  # modules of groups no candidate fits
    notes: tuple[str, ...] = field(default_factory=tuple)
    # (bits per weight at most, the least predicted error there): the same scores solved at other
    # budgets, so a user can see what a bit more or less would buy before choosing B
    curve: tuple[tuple[float, float], ...] = ()

    @property
    def weights(self) -> int:
        return sum(g.weights for g in self.groups)

    @property
    def achieved_bits(self) -> float:
        return self.cost_bits / max(1, self.weights)

    def recipes(self) -> dict[str, str]:
        """module -> chosen candidate."""
        return {m: r for g, r in zip(self.groups, self.picks) for m in g.modules}

    def identity(self) -> str:
        """What the fingerprint keeps: the candidates, the budget and the choice (not the scores'
        last digits, so a resumed run that scores again resumes)."""
        req = self.request
        return (f"auto|{','.join(req.candidates)}|{req.target_bits}|{req.max_size}|{self.layout}|{self.budget_bits}|"
                + ";".join(f"{g.key}={r}" for g, r in zip(self.groups, self.picks)))

    def record(self) -> dict:
        """The manifest's account: candidates, budget, per group its options' bits and errors, the choice."""
        req = self.request
        return {"candidates": list(req.candidates), "target_bits": req.target_bits, "max_size_bytes": req.max_size,
                "layout": self.layout, "budget_bits": self.budget_bits, "weights": self.weights,
                "cost_bits": self.cost_bits, "achieved_bits": round(self.achieved_bits, 6),
                "predicted_error": self.predicted_error, "scorer": SCORER,
                "model": "additive: a group's error is the sum of its modules' scores",
                "groups": [{"group": g.key, "modules": list(g.modules), "weights": g.weights, "choice": r,
                            "options": {c: {"bits": b, "error": group_error(g, c, self.scores)} for c, b in g.costs},
                            "scores": {m: dict(self.scores.get(m, {})) for m in g.modules}}
                           for g, r in zip(self.groups, self.picks)],
                "left_dense": list(self.left_dense),
                "curve": [{"bits": b, "predicted_error": e} for b, e in self.curve]}


def choice_json(choice: AutoChoice) -> dict:
    """The whole choice as JSON values, for ranks that did not score it (nothing between ranks is
    pickled); choice_from_json reads it back equal (JSON keeps a float's repr, so every bit)."""
    req = choice.request
    return {"request": {"candidates": list(req.candidates), "target_bits": req.target_bits,
                        "max_size": req.max_size, "max_size_text": req.max_size_text},
            "layout": choice.layout, "budget_bits": choice.budget_bits,
            "groups": [{"key": g.key, "modules": list(g.modules), "weights": g.weights,
                        "costs": [[c, b] for c, b in g.costs]} for g in choice.groups],
            "picks": list(choice.picks), "scores": choice.scores, "cost_bits": choice.cost_bits,
            "predicted_error": choice.predicted_error, "left_dense": list(choice.left_dense),
            "notes": list(choice.notes), "curve": [[b, e] for b, e in choice.curve]}


def choice_from_json(doc: dict) -> AutoChoice:
    req = doc["request"]
    groups = tuple(AutoGroup(g["key"], tuple(g["modules"]), g["weights"], tuple((c, b) for c, b in g["costs"]))
                   for g in doc["groups"])
    return AutoChoice(AutoRequest(tuple(req["candidates"]), req["target_bits"], req["max_size"], req["max_size_text"]),
                      doc["layout"], doc["budget_bits"], groups, tuple(doc["picks"]),
                      {m: dict(s) for m, s in doc["scores"].items()}, doc["cost_bits"], doc["predicted_error"],
                      tuple(doc["left_dense"]), tuple(doc["notes"]), tuple((b, e) for b, e in doc["curve"]))


def group_error(group: AutoGroup, candidate: str, scores: dict[str, dict[str, float]]) -> float:
    return 0.0 if candidate == DENSE else sum(scores[m][candidate] for m in group.modules)


def choose(request: AutoRequest, layout: str, groups: list[AutoGroup], scores: dict[str, dict[str, float]],
           budget: int, left_dense: list[str]) -> AutoChoice:
    """The exact least-error choice within the budget (check_feasible ran before)."""
    options = [[knapsack.Option(c, group_error(g, r, scores)) for r, c in g.costs] for g in groups]
    found = knapsack.solve(options, budget)
    if found is None:  # check_feasible refuses this before any scoring
        raise QuantcliError(f"{request.budget_label}: no choice fits the budget")
    picks = tuple(g.costs[k][0] for g, k in zip(groups, found.choice))
    return AutoChoice(request, layout, budget, tuple(groups), picks, scores, found.cost, found.error,
                      tuple(left_dense), curve=budget_curve(options, sum(g.weights for g in groups)))


CURVE_STEP = 0.5  # bits per weight between the curve's budgets


def budget_curve(options: list[list[knapsack.Option]], weights: int) -> tuple[tuple[float, float], ...]:
    """The least predicted error at budgets from the cheapest choice's bits per weight up to the
    costliest's, every CURVE_STEP bits (each exact, read off one Pareto frontier of the same scores)."""
    if not options or weights <= 0:
        return ()
    low, high = knapsack.cheapest(options), sum(max(o.cost for o in g) for g in options)
    steps = range(math.floor(low / weights / CURVE_STEP) + 1, math.ceil(high / weights / CURVE_STEP))
    budgets = [low, *(math.floor(Fraction(CURVE_STEP) * k * weights) for k in steps), high]
    pareto = knapsack.frontier(options, high)  # one pass: each budget's optimum is on it
    return tuple((round(b / weights, 4), knapsack.best_within(pareto, b).error)
                 for b in sorted(set(b for b in budgets if low <= b <= high)))


def chosen_options(opts: Options, choice: AutoChoice) -> Options:
    """The conversion the choice is: exact-name [[override]]s per module, --ignore for the dense ones."""
    chosen = choice.recipes()
    weights: dict[str, int] = {}
    for g, r in zip(choice.groups, choice.picks):
        if r != DENSE:
            weights[r] = weights.get(r, 0) + g.weights
    main = max(sorted(weights), key=lambda r: weights[r]) if weights else choice.request.quantizing[0]
    overrides = [(m, r) for m, r in sorted(chosen.items()) if r != DENSE]
    dense = sorted({m for m, r in chosen.items() if r == DENSE} | set(choice.left_dense))
    return replace(opts, recipe=main, layout=choice.layout, overrides=overrides, ignore=[*opts.ignore, *dense],
                   auto=None, auto_choice=choice)


def candidate_recipes(request: AutoRequest, layout: Layout, opts: Options) -> dict[str, Recipe]:
    """Each quantizing candidate as the layout writes it (its scale rule, the scale search)."""
    out = {}
    for name in request.quantizing:
        r = layout.recipe_for(name, opts.scale_rule if get_recipe(name).scale_rules else None)
        out[name] = r.with_scale_search(opts.scale_search if r.searches else "none")
    return out


def check_choice(plan: Plan, choice: AutoChoice) -> None:
    """The plan writes what was chosen: each module in its candidate, the chosen groups' bits as
    costed (so within the budget), and with --max-size the whole output within it."""
    chosen = choice.recipes()
    got: dict[str, str] = {}
    bits = 0
    for t in plan.tensors:
        module = t.module or (module_of(t.name) if t.name.endswith(".weight") else t.name)
        if module in chosen:
            got[module] = t.recipe or DENSE
            bits += 8 * t.bytes_out
    wrong = sorted(m for m, r in chosen.items() if got.get(m) != r)
    if wrong:
        raise QuantcliError(f"--auto: the plan gives {wrong[0]} {got.get(wrong[0], 'nothing')}, the choice "
                            f"{chosen[wrong[0]]} ({len(wrong)} module(s) differ); a bug, please report it")
    if bits != choice.cost_bits or bits > choice.budget_bits:
        raise QuantcliError(f"--auto: the plan writes {bits} bits for the chosen modules, the choice costed "
                            f"{choice.cost_bits} (budget {choice.budget_bits}); a bug, please report it")
    req = choice.request
    if req.max_size is not None and plan.bytes_out > req.max_size:
        raise QuantcliError(f"{req.budget_label}: the output's tensors come to {plan.bytes_out:,} bytes with the "
                            f"calibrated scale tensors the options add; lower --max-size by "
                            f"{plan.bytes_out - req.max_size:,} bytes")


def explained(plan: Plan, choice: AutoChoice) -> Plan:
    """The plan with --auto's reasons for what it left dense (its exact-name ignores would read
    as '--ignore', which the user did not give)."""
    dense = {m for m, r in choice.recipes().items() if r == DENSE}
    left = set(choice.left_dense)
    said = {**dict.fromkeys(dense, "--auto chose bf16 (dense)"), **dict.fromkeys(left, "--auto: no candidate fits")}
    return replace(plan, exclusions=[Exclusion(e.module, said.get(e.module, e.reason)) for e in plan.exclusions])
