"""Model-level metrics from the last block's outputs of both sides.

Causal LMs: the model's own code after its layers on each side (final norm, head, whatever
scaling or soft-capping the model applies to its logits; the head decoded, and its input
quantized where the checkpoint declares it), then over every position that predicts a next token:
perplexity of each side (exp of the mean negative log-likelihood of the sample's own next
token), KL(reference || quantized) of the next-token distributions (mean, 99th percentile with
linear interpolation, max) and top-1 agreement; all in FP64 from FP32 logits.
Encoders: each sample's pooled embedding on each side as the model's pooling config says
(sentence-transformers' `1_Pooling/config.json`), and their cosine similarity (mean, min)."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantcli.errors import QuantcliError
from quantcli.evaluate.emulate import ErrorSum
from quantcli.model.stack import Tail

# sentence-transformers' Pooling modes, in the order its forward concatenates them.
POOLING_MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


@dataclass
class CausalMetrics:
    tokens: int
    perplexity_reference: float
    perplexity_quantized: float
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float
    logits_rel_err: float


@dataclass
class EncoderMetrics:
    samples: int
    pooling: list[str]
    pooling_source: str
    cosine_mean: float
    cosine_min: float


@dataclass
class CausalSums:
    """What a causal LM's metrics are made of, over the batches one process ran: the processes
    of a split run (--workers, torchrun) each send theirs as JSON and rank 0 adds them up."""

    nll: list[float]  # summed negative log-likelihood: [reference, quantized]
    kl: list[float]  # KL(ref || quant) at each predicting position
    agree: int  # positions whose top-1 tokens agree
    logits: list[float]  # ErrorSum of the logits: [d2, r2]

    @staticmethod
    def empty() -> CausalSums:
        return CausalSums([0.0, 0.0], [], 0, [0.0, 0.0])

    @staticmethod
    def merge(parts: list[CausalSums]) -> CausalSums:
        return CausalSums([sum(p.nll[k] for p in parts) for k in (0, 1)], [v for p in parts for v in p.kl],
                          sum(p.agree for p in parts), [sum(p.logits[k] for p in parts) for k in (0, 1)])

    def metrics(self) -> CausalMetrics:
        kl = torch.tensor(self.kl, dtype=torch.float64)
        n = kl.numel()
        if n == 0:
            raise QuantcliError("--data: every sample is a single token; perplexity and KL need samples of at least "
                                "2 tokens")
        logit_err = ErrorSum.of(self.logits)
        return CausalMetrics(n, math.exp(self.nll[0] / n), math.exp(self.nll[1] / n),
                             float(kl.mean()), float(torch.quantile(kl, 0.99)), float(kl.max()), self.agree / n,
                             logit_err.rel)


class Causal:
    """finish() of a causal LM: `ids` are the batches, `head_step` the head's input quantization."""

    def __init__(self, ref, quant, ids: list[torch.Tensor], head_step=None):
        self.ref, self.quant, self.ids, self.head_step = ref, quant, ids, head_step

    def __call__(self, stack, maps, bufs, input_batches) -> CausalSums:
        nll, kls, agree, logit_err = [0.0, 0.0], [], 0, ErrorSum()
        with two_tails(stack, (self.ref, self.quant), maps, bufs[0].device, self.head_step) as tails:
            for j, ids in enumerate(input_batches):
                targets = ids[:, 1:].to(bufs[0].device)
                logits = [tail(ids, buf.read(j))[:, :-1] for tail, buf in zip(tails, bufs)]
                logp = [torch.log_softmax(x.double(), dim=-1) for x in logits]
                for k in (0, 1):
                    nll[k] -= float(logp[k].gather(-1, targets[..., None]).sum())
                logit_err.add(logits[1], logits[0])
                kls.append((logp[0].exp() * (logp[0] - logp[1])).sum(-1).reshape(-1))
                agree += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
        kl = torch.cat(kls).tolist() if kls else []
        return CausalSums(nll, kl, agree, [logit_err.d2, logit_err.r2])


class _Tails:
    """The reference's and the quantized side's Tail (model/stack.py), loaded side by side: the
    quantized one on a copy of the model, its head's input quantized by `head_step`."""

    def __init__(self, stack, sides, maps, device, head_step=None):
        self.sides = sides
        self.tails = [Tail(stack, maps[0], sides[0].get, device),
                      Tail(stack, maps[1], sides[1].get, device, model=copy.deepcopy(stack.model))]
        head = stack.head()
        self.hooks = []
        if head_step is not None and head is not None:
            module = self.tails[1].model.get_submodule(head)
            self.hooks.append(module.register_forward_pre_hook(lambda m, args: (head_step(args[0]), *args[1:])))

    def __enter__(self) -> list:
        return self.tails

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()
        for side, tail in zip(self.sides, self.tails):
            read = tail.read
            tail.close()
            for name in read:
                side.release(name)


def two_tails(stack, sides, maps, device, head_step=None) -> _Tails:
    return _Tails(stack, sides, maps, device, head_step)


def pooling_config(roots: list[Path]) -> tuple[list[str], str]:
    """The pooling modes a sentence-transformers model folder declares (its modules.json's Pooling
    module, else 1_Pooling/config.json), from the first of `roots` that has one; mean pooling
    (what sentence-transformers defaults to) when none does."""
    for root in roots:
        folder = root / "1_Pooling"
        modules = root / "modules.json"
        try:
            if modules.is_file():
                for m in json.loads(modules.read_text()):
                    if str(m.get("type", "")).endswith("Pooling"):
                        folder = root / m.get("path", "1_Pooling")
            path = folder / "config.json"
            if path.is_file():
                cfg = json.loads(path.read_text())
                modes = [m for m in POOLING_MODES if cfg.get(f"pooling_mode_{m}")]
                if not modes:
                    raise QuantcliError(f"{path}: no pooling mode is on (pooling_mode_mean_tokens, ...)")
                return modes, str(path)
        except (OSError, ValueError, AttributeError) as exc:
            raise QuantcliError(f"{root}: cannot read its pooling config ({exc})") from None
    return ["mean_tokens"], "default (no 1_Pooling/config.json: mean pooling)"


def pool(hidden: torch.Tensor, modes: list[str]) -> torch.Tensor:
    """[B, T, H] (no padding: every token counts) -> [B, H * len(modes)], as sentence-transformers'
    Pooling computes each mode with an all-ones attention mask."""
    t = hidden.shape[1]
    out = []
    for m in modes:
        if m == "cls_token":
            out.append(hidden[:, 0])
        elif m == "max_tokens":
            out.append(hidden.amax(1))
        elif m == "mean_tokens":
            out.append(hidden.sum(1) / t)
        elif m == "mean_sqrt_len_tokens":
            out.append(hidden.sum(1) / t ** 0.5)
        elif m == "weightedmean_tokens":
            w = torch.arange(1, t + 1, dtype=hidden.dtype, device=hidden.device)[None, :, None]
            out.append((hidden * w).sum(1) / w.sum(1))
        else:
            out.append(hidden[:, -1])
    return torch.cat(out, dim=-1)


@dataclass
class EncoderSums:
    """An encoder's per-sample embedding cosines over the batches one process ran (see CausalSums)."""

    cosines: list[float]

    @staticmethod
    def empty() -> EncoderSums:
        return EncoderSums([])

    @staticmethod
    def merge(parts: list[EncoderSums]) -> EncoderSums:
        return EncoderSums([c for p in parts for c in p.cosines])


class Encoder:
    def __init__(self, modes: list[str], source: str, sides: tuple = ()):
        self.modes, self.source, self.sides = modes, source, sides

    def __call__(self, stack, maps, bufs, input_batches) -> EncoderSums:
        """Each sample's pooled last hidden state (the model's code after its layers run, e.g.
        ModernBERT's final norm) on both sides, and their cosine."""
        cos = []
        with two_tails(stack, self.sides, maps, bufs[0].device) as tails:
            for j, ids in enumerate(input_batches):
                a, b = (pool(tail(ids, buf.read(j)).double(), self.modes) for tail, buf in zip(tails, bufs))
                cos.append(F.cosine_similarity(a, b, dim=-1))
        return EncoderSums(torch.cat(cos).tolist() if cos else [])

    def metrics(self, sums: EncoderSums) -> EncoderMetrics:
        c = torch.tensor(sums.cosines, dtype=torch.float64)
        return EncoderMetrics(c.numel(), self.modes, self.source, float(c.mean()), float(c.min()))
