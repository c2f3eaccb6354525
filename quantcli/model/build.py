"""The source's transformers model, built from its config.json with no weights: every parameter and
persistent buffer on the meta device (no memory), and the non-persistent buffers (rotary
frequencies, Gemma's `embed_scale`, position ids) computed for real by the model's own
initialization, as `from_pretrained` computes them. The class is the one config.json names in
`architectures`, from transformers itself (never remote code); its experts run transformers'
eager loop, which hands each expert's weights to a matmul one expert at a time (model/experts.py
traces those calls)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from quantcli.errors import QuantcliError
from quantcli.model.samples import EXTRA

# transformers (optional: the calibrate extra) is imported by transformers_module, Ctrl-C held.

@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C held until the block ends, then raised: transformers imports a model's code (and
    through it Triton's native modules) lazily, on first use, and an interrupt landing inside
    those imports comes out as an import error, or aborts the process from native code, instead
    of a KeyboardInterrupt. Only the main thread can set handlers; an ignored SIGINT stays ignored."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def transformers_module():
    try:
        with interrupts_deferred():
            import transformers
    except ImportError:
        raise QuantcliError(f"--calibration needs transformers: {EXTRA}") from None
    return transformers


def model_config(config_dict: dict, label: str):
    """transformers' config object for `config_dict` (a config.json)."""
    transformers = transformers_module()
    cfg = dict(config_dict)
    decode = getattr(transformers.PretrainedConfig, "_decode_special_floats", None)
    cfg = decode(cfg) if decode is not None else cfg  # {"__float__": "Infinity"}, as from_pretrained reads it
    model_type = cfg.pop("model_type", None)
    for key in ("quantization_config", "hf_quant_config"):  # the model's shape only: nothing is loaded
        cfg.pop(key, None)
    try:
        with interrupts_deferred():
            config = transformers.AutoConfig.for_model(model_type, **cfg)
    except Exception as exc:  # noqa: BLE001 - any refusal of the config (huggingface_hub's validators raise their own)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise QuantcliError(f"{label}: transformers {transformers.__version__} cannot build model_type "
                            f"{model_type!r} from config.json ({first}); quantcli runs the architectures "
                            f"transformers ships, never remote code") from None
    config._experts_implementation = "eager"  # one matmul per expert: what model/expert_calls.py traces
    # Run as transformers runs a quantized model: the few models that would otherwise use a Linear's
    # weight without calling it (Jamba's and Falcon-Mamba's dt_proj) then call it, so its input is seen.
    config._is_quantized = True
    return config


def model_class(config, config_dict: dict, label: str):
    """The class `from_pretrained` would build: the first of config.json's `architectures` that
    transformers ships; without any, its causal LM for the config (else its base model)."""
    transformers = transformers_module()
    archs = [a for a in config_dict.get("architectures") or [] if isinstance(a, str)]
    for arch in archs:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            wants = getattr(cls, "config_class", None)
            if isinstance(wants, type) and not isinstance(config, wants):
                raise QuantcliError(f"{label}: config.json names architecture {arch} (a {wants.__name__}) but "
                                    f"model_type {config.model_type!r} (a {type(config).__name__}); fix config.json")
            return cls
    if archs:
        raise QuantcliError(f"{label}: architecture {archs[0]} is not a transformers {transformers.__version__} "
                            f"class (remote code, which quantcli never runs); a layer walk needs a model "
                            f"transformers builds")
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            return auto._model_mapping[type(config)]
        except KeyError:
            continue
    raise QuantcliError(f"{label}: transformers {transformers.__version__} has no model for model_type "
                        f"{config.model_type!r}")


def _built(cls, config, pooler: bool):
    if not pooler:
        try:  # BERT-likes build a pooler no walk runs (sentence-transformers pools the hidden states)
            return cls._from_config(config, dtype=torch.float32, add_pooling_layer=False)
        except TypeError:
            pass
    return cls._from_config(config, dtype=torch.float32)


def meta_model(config_dict: dict, label: str, quiet: bool = True, as_loaded: bool = False) -> torch.nn.Module:
    """The model of `config_dict`, FP32, in eval mode: parameters and persistent buffers on meta,
    non-persistent buffers real (see the module docstring). `quiet`: transformers' own warnings
    (about training, generation defaults) are not shown. `as_loaded`: every module from_pretrained
    builds (a BERT's pooler too), for the names transformers gives them; else what a walk runs."""
    transformers = transformers_module()
    verbosity = transformers.logging.get_verbosity()
    if quiet:
        transformers.logging.set_verbosity_error()
    try:
        return _meta_model(config_dict, label, as_loaded)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _meta_model(config_dict: dict, label: str, as_loaded: bool) -> torch.nn.Module:
    config = model_config(config_dict, label)
    if getattr(config, "is_encoder_decoder", False):
        raise QuantcliError(f"{label}: {type(config).__name__} is an encoder-decoder model; quantcli's layer walk "
                            f"runs one stack of layers (a decoder or an encoder), so calibration, GPTQ and eval "
                            f"do not run on it (convert without --calibration does)")
    cls = model_class(config, config_dict, label)
    with torch.device("meta"), interrupts_deferred():
        try:
            model = _built(cls, config, as_loaded)
        except (ValueError, TypeError, AssertionError, AttributeError, KeyError, IndexError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise QuantcliError(f"{label}: transformers cannot build {cls.__name__} from its config.json ({first}); "
                                f"fix the config") from None
    for name, buffer in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._non_persistent_buffers_set:
            module._buffers[leaf] = torch.empty_like(buffer, device="cpu")
    with interrupts_deferred():
        model.initialize_weights()  # fills the real buffers; init on meta parameters does nothing
    for module in model.modules():  # as built: a later initialize_weights runs again (transformers_view's check)
        module.__dict__.pop("_is_hf_initialized", None)
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                t.__dict__.pop("_is_hf_initialized", None)
    return model.float().eval()
