"""One side of an evaluation: a checkpoint read as the model's FP32 parameters.

Dense tensors are read as stored; every quantized module (any layout `detect` recognises, from
quantcli or another producer) is decoded from its codes and scales, so the quantized side runs
the weights an engine multiplies by. Tensors are read one at a time and released after use
(`release`), which keeps memory to the layer in hand."""

from __future__ import annotations

import torch

from quantcli.checkpoint.tensors import CheckpointTensors, same_bytes
from quantcli.errors import CheckpointError, QuantcliError
from quantcli.formats.activation_scales import CalibratedScales, calibrated_scales
from quantcli.formats.decode import decode_module
from quantcli.formats.detect import config_with_extras, detect
from quantcli.formats.facts import NO_FACTS, ModuleFacts
from quantcli.kernels import tensor_amax
from quantcli.planning.transforms import ops_of

# Config keys two checkpoints of one model share (the architecture and its shapes).
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "num_local_experts", "num_experts", "head_dim")


class Side:
    """`get(name)`: the FP32 parameter `name` on `device`; a quantized module's `.weight` is its
    decoded weight. `names`: every parameter name it can give."""

    def __init__(self, label: str, source, tensors: CheckpointTensors, device: torch.device):
        self.label, self.source, self.tensors, self.device = label, source, tensors, device
        detected = detect(source)
        self.detected = detected if detected is not None and detected.modules else None
        self.layout = self.detected.layout if self.detected else None
        self.modules: dict[str, str] = dict(self.detected.modules) if self.detected else {}
        manifest = self.detected.manifest if self.detected else None
        self.rules = {m.module: m.scale_rule for m in manifest.modules} if manifest else {}
        self.config = config_with_extras(source, self.detected.extra_files) if self.detected else dict(source.config)
        # a quantized module's model parameter: `<module>.weight`, or the 3-D stack itself (gpt-oss)
        self.params = {self._param(m): m for m in self.modules}
        self.names = set(tensors.where) | set(self.params)

    @property
    def quantized(self) -> bool:
        return bool(self.modules)

    def _param(self, module: str) -> str:
        return self.layout.dense_name(module)[0]

    def _transposed(self, module: str) -> bool:
        """Whether the model holds the module's weight as [E, in, out] (gpt-oss's stacks)."""
        return self.layout.dense_name(module)[1]

    def _module(self, name: str) -> str | None:
        return self.params.get(name)

    def _recipe(self, module: str):
        rule = self.rules.get(module)
        return self.layout.recipe_for(self.modules[module], rule if rule in ("floor", "even", "rceil") else None)

    def get(self, name: str) -> torch.Tensor:
        module = self._module(name)
        if module is None:
            return self.tensors.get(name).to(self.device, torch.float32)
        recipe = self._recipe(module)
        try:
            q = self.layout.from_disk(module, recipe, self.tensors.get, self.tensors.where)
        except (KeyError, RuntimeError, ValueError) as exc:
            raise QuantcliError(f"{self.label}: {module} cannot be decoded as {self.layout.name} "
                                f"{recipe.name}: {exc}") from None
        w = decode_module(self.layout, module, recipe, q, transpose=self._transposed(module), device=self.device)
        bad = int((~torch.isfinite(w)).sum())
        if bad:  # else NaN runs through every later block and the report reads `perplexity: nan`, naming nothing
            raise CheckpointError(f"{self.label}: {module} decodes to {bad} non-finite value(s) (NaN or Inf from its "
                                  f"stored codes and scales); `quantcli verify {self.label}` names its tensors; "
                                  f"convert it again from its source")
        return w

    def release(self, name: str) -> None:
        module = self._module(name)
        if module is None:
            if name in self.tensors:
                self.tensors.release(name)
            return
        for d in self.layout.describe(module, self._recipe(module)):
            if d.name in self.tensors:
                self.tensors.release(d.name)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of a dense tensor, or the logical shape of a quantized module's weight."""
        module = self._module(name)
        if module is None:
            return tuple(self.tensors.info(name).shape) if name in self.tensors else None
        codes = self.layout.describe(module, self._recipe(module))[0].name
        shape = tuple(self.layout.logical_shape(self._recipe(module), tuple(self.tensors.info(codes).shape)))
        return (*shape[:-2], shape[-1], shape[-2]) if self._transposed(module) else shape

    def transforms(self) -> dict:
        """The exact transforms its manifest records ({source tensor: op}; empty: none)."""
        manifest = self.detected.manifest if self.detected else None
        return ops_of(manifest.transforms if manifest is not None else None)

    def calibrated(self) -> CalibratedScales | None:
        """The activation scheme, input scales and KV-cache scales the checkpoint declares."""
        if self.layout is None:
            return None
        return calibrated_scales(self.layout, self.config, self.modules, self.tensors.where, self.tensors)


def check_same_model(ref: Side, quant: Side) -> None:
    """Reference and checkpoint are one architecture with the same shapes, or a one-line refusal."""
    a, b = ref.source.config, quant.source.config
    differ = [k for k in SHAPE_KEYS if a.get(k) != b.get(k)]
    if differ:
        said = ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in differ)
        raise QuantcliError(f"--reference {ref.source.label} and {quant.label} are not the same model ({said}); "
                            f"eval compares a checkpoint with the model it was made from")


MISMATCH_TAIL = "compare two models, not a quantization"


def reference_mismatch(ref: Side, quant: Side, stack) -> str | None:
    """A note when a tensor outside the layers that both sides keep dense and alike in dtype and
    shape (the embedding, the final norm) differs in its bytes: the shapes agree, but DST was
    likely not made from SRC (another seed or fine-tune); the metrics then measure two models,
    not a quantization."""
    outer = {src for n in stack.model.state_dict() if not n.startswith(stack.layer_path + ".")
             for src in stack.names.sources(n)}
    embedding = next((p for p, m in stack.model.named_modules() if m is stack.model.get_input_embeddings()), "")
    first = set(stack.names.sources(f"{embedding}.weight"))  # the embedding is the one named when several differ
    both = ref.tensors.where.keys() & quant.tensors.where.keys()
    for name in sorted((n for n in both if n in outer), key=lambda n: (n not in first, n)):
        a, b = ref.tensors.info(name), quant.tensors.info(name)
        if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
            continue
        differ = not same_bytes(ref.tensors.raw(name), quant.tensors.raw(name))
        ref.tensors.release(name)
        quant.tensors.release(name)
        if differ:
            return (f"{name} differs between --reference {ref.source.label} and {quant.label} (same dtype and shape, "
                    f"other values): {quant.label} was likely not made from this reference, and the numbers "
                    f"{MISMATCH_TAIL}")
    return None


class RecipeSide(Side):
    """A dense checkpoint with a conversion plan applied in memory: every tensor the plan
    quantizes is quantized with its recipe (fused groups sharing one global scale, as convert
    does) and decoded back, nothing written. `get` returns what `convert` then decoding would."""

    def __init__(self, label: str, source, tensors: CheckpointTensors, device: torch.device, plan):
        super().__init__(label, source, tensors, device)
        if self.quantized:
            raise QuantcliError(f"--recipe: {source.label} is already quantized ({self.layout.name}); emulate a "
                                f"recipe on the dense model, or evaluate this checkpoint with --reference SRC")
        self.plan = plan
        self.planned = {t.name: t for t in plan.tensors if t.quantized}
        self.groups = plan.fused_groups()
        self.modules = {t.module: t.recipe for t in self.planned.values()}
        self.layout = plan.layout
        self._amax: dict[str, torch.Tensor] = {}

    def _group_amax(self, group: str) -> torch.Tensor:
        if group not in self._amax:
            self._amax[group] = torch.stack([tensor_amax(self.tensors.get(t.name), name=t.name).cpu()
                                             for t in self.groups[group]]).amax()
        return self._amax[group]

    def get(self, name: str) -> torch.Tensor:
        t = self.planned.get(name)
        if t is None:
            return self.tensors.get(name).to(self.device, torch.float32)
        recipe = self.plan.recipes[t.recipe]
        facts = ModuleFacts(group_amax=self._group_amax(t.fused_group)) \
            if t.fused_group and recipe.has_global_scale else NO_FACTS
        w = self.tensors.get(name).to(self.device)
        # a stack stored [E, in, out] (gpt-oss) is quantized as [E, out, in], as convert does
        q = recipe.quantize(name, w.transpose(-1, -2) if t.transpose else w, facts=facts)
        # through the layout's tensors and back, as a converted checkpoint is read: a divisor scale
        # (compressed-tensors' weight_global_scale = 1 / scale_2) is stored as its FP32 reciprocal,
        # whose reciprocal is not always the scale to the last bit
        disk = self.layout.to_disk(t.module, q)
        q = self.layout.from_disk(t.module, recipe, disk.__getitem__, disk)
        d = recipe.dequantize(q).to(torch.float32)
        return d.transpose(-1, -2) if t.transpose else d

    def release(self, name: str) -> None:
        if name in self.tensors:
            self.tensors.release(name)

    def declared_config(self) -> dict:
        """The config the conversion would write (with ModelOpt's hf_quant_config merged in)."""
        groups, excluded = self.plan.modules_by_recipe(), self.plan.excluded_names()
        config = {**self.source.config, "quantization_config": self.layout.quantization_config(groups, excluded)}
        extra = self.layout.extra_files(groups, excluded).get("hf_quant_config.json")
        return {**config, "hf_quant_config": extra} if extra else config

    def calibrated(self) -> CalibratedScales | None:
        self.config = self.declared_config()
        return CalibratedScales(self.layout.activation_scheme(self.config), None)
