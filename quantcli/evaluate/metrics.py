"""Model-level metrics from the last block's outputs of both sides.

Causal LMs: the final norm and the head of each side (the head decoded, and its input quantized
where the checkpoint declares it), then over every position that predicts a next token:
perplexity of each side (exp of the mean negative log-likelihood of the sample's own next
token), KL(reference || quantized) of the next-token distributions (mean, 99th percentile with
linear interpolation, max) and top-1 agreement; all in FP64 from FP32 logits.
Encoders: each sample's pooled embedding on each side as the model's pooling config says
(sentence-transformers' `1_Pooling/config.json`), and their cosine similarity (mean, min)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from quantcli.errors import QuantcliError
from quantcli.evaluate.emulate import ErrorSum
from quantcli.model.stack import EMBEDDING, HEAD

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

    @staticmethod
    def _head(side, norm_names: list[str]) -> tuple[dict, torch.Tensor, list[str]]:
        norm = {n: side.get(f"model.norm.{n}") for n in norm_names}
        head = f"{HEAD}.weight" if f"{HEAD}.weight" in side.names else EMBEDDING  # tied: the embedding
        return norm, side.get(head), [*(f"model.norm.{n}" for n in norm_names), head]

    def __call__(self, stack, bufs, count: int) -> CausalSums:
        norm = stack.model.model.norm
        sides = [(side, *self._head(side, list(norm.state_dict()))) for side in (self.ref, self.quant)]
        nll, kls, agree, logit_err = [0.0, 0.0], [], 0, ErrorSum()
        for j in range(count):
            targets = self.ids[j][:, 1:].to(bufs[0].device)
            logp = []
            for k, (side, norm_params, head, _) in enumerate(sides):
                norm.load_state_dict(norm_params, assign=True)
                h = norm(bufs[k].read(j))
                if k == 1 and self.head_step is not None:
                    h = self.head_step(h)
                logits = F.linear(h, head)[:, :-1]
                logp.append(torch.log_softmax(logits.double(), dim=-1))
                nll[k] -= float(logp[k].gather(-1, targets[..., None]).sum())
                if k == 0:
                    ref_logits = logits
            logit_err.add(logits, ref_logits)
            kls.append((logp[0].exp() * (logp[0] - logp[1])).sum(-1).reshape(-1))
            agree += int((logp[0].argmax(-1) == logp[1].argmax(-1)).sum())
        norm.to("meta")
        for side, _, _, names in sides:
            for name in names:
                side.release(name)
        kl = torch.cat(kls).tolist() if kls else []
        return CausalSums(nll, kl, agree, [logit_err.d2, logit_err.r2])


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
    def __init__(self, modes: list[str], source: str):
        self.modes, self.source = modes, source

    def __call__(self, stack, bufs, count: int) -> EncoderSums:
        cos = []
        for j in range(count):
            a, b = (pool(buf.read(j).double(), self.modes) for buf in bufs)
            cos.append(F.cosine_similarity(a, b, dim=-1))
        return EncoderSums(torch.cat(cos).tolist() if cos else [])

    def metrics(self, sums: EncoderSums) -> EncoderMetrics:
        c = torch.tensor(sums.cosines, dtype=torch.float64)
        return EncoderMetrics(c.numel(), self.modes, self.source, float(c.mean()), float(c.min()))
