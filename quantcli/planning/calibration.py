"""Up-front checks of a calibrated conversion, and the tensors it adds to the plan."""

from __future__ import annotations

from dataclasses import replace

from quantcli.checkpoint.safetensors_io import OutSpec
from quantcli.errors import QuantcliError
from quantcli.formats.facts import CALIBRATION_SAMPLES
from quantcli.formats.fused import fused_group_of
from quantcli.formats.layouts import LAYOUTS, module_of
from quantcli.formats.layouts.base import ONE, SCALAR
from quantcli.model.buffer import budget_bytes
from quantcli.model.reach import Reach, walk_reach
from quantcli.model.samples import check_token_ids, check_tokenizer, read_samples
from quantcli.model.stack import ENCODER, encoder_positions
from quantcli.planning.actions import Action
from quantcli.planning.plan import Exclusion, Plan, TensorPlan
from quantcli.planning.rounding_plan import check_scales_option, unreached_warnings

UNREACHED = "not in the model's forward (no calibration statistics)"
_SHAPES = {SCALAR: (), ONE: (1,)}


def check_options(activations: str | None, kv_cache: str | None, calibration, scale_search: str = "none",
                  data_aware_rounding: bool = False, scored: bool = False) -> None:
    """Flags that need --calibration, refused before the source is opened (`scored`: --auto
    scores modules on the data, so it is used even when nothing is calibrated)."""
    for flag, value in (("--activations static", activations == "static"), ("--kv-cache fp8", kv_cache == "fp8"),
                        ("--rounding gptq", data_aware_rounding)):
        if value and calibration is None:
            raise QuantcliError(f"{flag} needs --calibration DATA (a .txt or .jsonl of calibration samples)")
    if (calibration is not None and activations != "static" and kv_cache != "fp8" and scale_search != "mse"
            and not data_aware_rounding and not scored):
        raise QuantcliError("--calibration: nothing to calibrate; add --activations static, --kv-cache fp8, "
                            "--scale-search mse (activation-weighted) and/or --rounding gptq")


def checked_plan(plan: Plan) -> Plan:
    """`plan` with the calibrated tensors added to its outputs; every refusal before any work."""
    opts = plan.options
    if opts.calibration is None:
        return plan
    if plan.layout is None or plan.source_layout is not None:
        raise QuantcliError(f"--calibration: {plan.source.label} is already quantized; calibrate from the dense "
                            f"(BF16/FP16/FP32) checkpoint")
    _check_heads(plan.source.config, plan.source.label)
    reach = plan_reach(plan)
    plan = replace(plan, walk=reach)
    if reach.kind == ENCODER:
        plan = _for_encoder(plan)
        opts = plan.options
    check_scales_option(plan)
    samples = read_samples(opts.calibration)  # a missing or empty file is refused here,
    check_tokenizer(samples, opts.calibration, plan.source.root)  # text without a tokenizer too,
    check_token_ids(samples, opts.calibration, reach.vocab_size)  # ids out of range
    found = len(samples)
    budget_bytes()  # so is a malformed activation-buffer budget
    if opts.kv_cache == "fp8" and not plan.layout.kv_scales:
        recipes = set(plan.recipes)
        static = opts.activations == "static"
        able = [name for name, layout in LAYOUTS.items() if layout.kv_scales and recipes <= set(layout.recipes)
                and (static or not recipes & set(layout.needs_static))]
        fix = (f"use --layout {' or '.join(able)}" if able else
               f"no layout with KV-cache scales holds {', '.join(sorted(recipes))}; choose another recipe")
        raise QuantcliError(f"--kv-cache fp8: layout {plan.layout.name} has no KV-cache scale tensors; {fix}")
    plan = _without_unreached(plan, set(reach.tensors) | set(reach.head))
    tensors = [replace(t, outputs=t.outputs + _added(plan, t)) for t in plan.tensors]
    if opts.kv_cache == "fp8":
        _check_kv(plan)
    warnings = list(plan.warnings)
    # the default is a cap (the whole data, up to it): fewer samples than that is no surprise, and
    # the summary says how many were used of how many
    if opts.calibration.samples != CALIBRATION_SAMPLES and found < opts.calibration.samples:
        warnings.append(f"--calibration {opts.calibration.data}: holds {found} sample(s), fewer than "
                        f"--calibration-samples {opts.calibration.samples}; calibrating with {found}")
    warnings += unreached_warnings(plan)
    return replace(plan, tensors=tensors, warnings=warnings)


def plan_reach(plan: Plan) -> Reach:
    """What the layer walk of the source reaches (model/reach.py), from its headers."""
    infos = {n: info for header in plan.source.headers.values() for n, info in header.tensors.items()}
    return walk_reach(plan.source.config, set(infos), lambda n: tuple(infos[n].shape), plan.source.label)


def _for_encoder(plan: Plan) -> Plan:
    """`plan` for an encoder: --kv-cache fp8 refused (it keeps no KV cache), samples cut to what its
    position embeddings reach (with a warning when --calibration-seq-len asks for more)."""
    opts = plan.options
    arch = (plan.source.config.get("architectures") or ["?"])[0]
    if opts.kv_cache == "fp8":
        raise QuantcliError(f"--kv-cache fp8: {arch} is an encoder-only model; it keeps no KV cache to quantize; "
                            f"drop the option")
    limit = encoder_positions(plan.source.config)
    if limit is None or opts.calibration.seq_len <= limit:
        return plan
    cal = replace(opts.calibration, seq_len=limit)
    warning = (f"--calibration-seq-len {opts.calibration.seq_len}: {arch} has position embeddings for {limit} "
               f"tokens; calibrating on at most {limit} per sample")
    return replace(plan, options=replace(opts, calibration=cal), warnings=[*plan.warnings, warning])


def _check_kv(plan: Plan) -> None:
    """--kv-cache fp8 needs every attention's k and v projections, separate or one fused Linear,
    among the planned weights (their KV-cache scales are written beside them)."""
    walk, label = plan.walk, plan.source.label
    missing = sorted(set(walk.attentions) - set(walk.kv_modules))
    if missing and missing[0] in walk.latent_attentions:
        raise QuantcliError(f"--kv-cache fp8: {label}'s attention {missing[0]} caches a compressed latent (MLA), whose "
                            f"scale engines take from that latent, not from the k and v transformers computes, and "
                            f"quantcli does not measure it; drop the option")
    if missing:
        raise QuantcliError(f"--kv-cache fp8: {label}'s attention {missing[0]} has neither k_proj/v_proj nor one "
                            f"fused q/k/v Linear, the modules quantcli names KV-cache scales by; drop the option")
    planned = {t.module or module_of(t.name) for t in plan.tensors}
    if not walk.kv_modules or not all(k in planned for kv in walk.kv_modules.values() for k in kv):
        raise QuantcliError(f"--kv-cache fp8: {label} has no attention k_proj/v_proj (or fused q/k/v) weights to "
                            f"give KV-cache scales to; drop the option")


def _added(plan: Plan, t) -> tuple[OutSpec, ...]:
    opts, layout = plan.options, plan.layout
    out: list[OutSpec] = []
    if opts.activations == "static" and t.quantized:
        rows = layout.optional.get(t.recipe, ())
        if not rows:
            able = sorted({r for name in LAYOUTS for r in LAYOUTS[name].optional if r in LAYOUTS[name].recipes})
            raise QuantcliError(f"--activations static: recipe {t.recipe} in layout {layout.name} has no static "
                                f"activation scale (recipes that do: {', '.join(able)})")
        out += [OutSpec(f"{t.module}{row.suffix}", "F32", _SHAPES[row.reshape]) for row in rows]
    if opts.kv_cache == "fp8" and t.name.endswith(".weight"):
        module = module_of(t.name)
        if plan.walk is not None and module in {m for kv in plan.walk.kv_modules.values() for m in kv}:
            out += [OutSpec(name, "F32", layout.kv_scale_shape) for name in layout.kv_names(module).values()]
    return tuple(out)


def _without_unreached(plan: Plan, reached: set[str]) -> Plan:
    """With static activations, a quantized weight the model's forward never runs (a layer
    beyond num_hidden_layers, an MTP head) gets no made-up input scale: it is left dense, with
    its whole fused group (one precision per group), and listed with the reason."""
    if plan.options.activations != "static":
        return plan
    dense = {t.module for t in plan.tensors if t.quantized and t.name not in reached}
    groups = {fused_group_of(m) for m in dense} - {None}
    dense |= {t.module for t in plan.tensors if t.quantized and fused_group_of(t.module) in groups}
    if not dense:
        return plan
    tensors = [t if t.module not in dense else
               TensorPlan(t.name, t.shard, t.dtype, t.shape, action=Action.COPY,
                          outputs=(OutSpec(t.name, t.dtype, t.shape),))
               for t in plan.tensors]
    exclusions = [*plan.exclusions, *(Exclusion(m, UNREACHED) for m in sorted(dense))]
    if not any(t.quantized for t in tensors):
        raise QuantcliError(f"--calibration: none of the quantized weights of {plan.source.label} is in the "
                            f"forward of its config's architecture; nothing can be calibrated")
    return replace(plan, tensors=tensors, exclusions=exclusions)


def _check_heads(config: dict, label: str) -> None:
    """A config transformers' attention cannot run (KV heads not dividing the heads) is refused
    before the walk, in one line, rather than failing inside the first layer."""
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        raise QuantcliError(f"{label}: config.json has num_attention_heads {heads}, not a multiple of "
                            f"num_key_value_heads {kv}; transformers cannot run this model for --calibration "
                            f"(fix the config)")
