"""Exact, function-preserving transforms of the source's weights, applied before rounding them
(`convert --rotate vo`), recorded in the manifest so that verify and eval recompute them.

rotate vo, card:
- what: every attention's value projection and output projection, rotated per head by one
  orthogonal matrix R [d, d] (d: the head size). v_proj's rows of KV head g become R^T W_v[g]
  (its bias R^T b_v[g]); o_proj's columns of each query head h become W_o[:, h] R, where h reads
  KV head g (grouped-query attention: query heads g * heads/kv_heads ...).
- why exact: softmax(q k^T) does not involve v, so head h's output becomes o_h R, and
  (o_h R)(W_o[:, h] R)^T = o_h W_o[:, h]^T: the attention's output, and so the model's, is
  unchanged but for rounding the rotated weights (FP64 products, then the output dtype).
- R: the normalized Walsh-Hadamard matrix when d is a power of two (entries +-1/sqrt(d),
  symmetric), the rotation QuaRot uses to spread a head's outlier channels over all d; else a
  random orthogonal matrix (QR of a seeded Gaussian), the same on every run.
- what it changes for quantization: v_proj's and o_proj's weights see their outliers spread
  within each head, which block formats round with less error; nothing else changes.
- architectures: any whose layers' attention has separate v_proj and o_proj (fused q/k/v and
  MLA attentions have none to rotate: refused), each rotated by the head size its attention
  module holds; planning proves it exact by running one layer of each kind by its own code
  before and after (model/transform_check.py), and refuses where it is not (Qwen 3.5's gated
  attention output). Vision towers are not the layers walked: left as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from quantcli.checkpoint.safetensors_io import OutSpec
from quantcli.errors import QuantcliError
from quantcli.planning.actions import Action

# plan_rotation imports the model stack inside: it runs only for --rotate, and the model layer
# (transformers) stays out of every other plan.

ROTATIONS = ("vo",)
SEED = 0  # the random orthogonal matrix's (head sizes that are not powers of two)


@dataclass(frozen=True)
class TransformOp:
    """What the transform does to one source tensor: `part` rows (v_proj weight), bias (v_proj
    bias) or columns (o_proj weight), in blocks of `head` = d."""

    part: str  # rows | bias | columns
    head: int

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """The transformed tensor (FP32), computed in FP64."""
        r = rotation(self.head, t.device)
        w = t.to(torch.float64)
        if self.part == "columns":  # [N, heads * d] -> each head's d columns times R
            out = (w.reshape(w.shape[0], -1, self.head) @ r).reshape(w.shape)
        else:  # rows [kv * d, K] or bias [kv * d]: R^T times each head's d rows
            blocks = w.reshape(-1, self.head, *w.shape[1:])
            out = torch.einsum("ji,gj...->gi...", r, blocks).reshape(w.shape)
        return out.to(torch.float32)


def rotation(d: int, device=None) -> torch.Tensor:
    """R [d, d] in FP64: the normalized Walsh-Hadamard matrix for d a power of two, else a
    random orthogonal matrix from a fixed seed."""
    if d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / math.sqrt(d)).to(device)
    g = torch.Generator().manual_seed(SEED)
    q, r = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))
    return (q * torch.sign(torch.diagonal(r))).to(device)  # a unique Q: R's diagonal made positive


def plan_rotation(source, label: str) -> dict[str, TransformOp]:
    """{source tensor: TransformOp} of `--rotate vo`: every attention of the model's layers with
    separate v_proj and o_proj, by its own head size (model/transform_check.py), and only once
    its layers' own forward shows the rotation leaves their output unchanged."""
    from quantcli.checkpoint.tensors import CheckpointTensors
    from quantcli.model.layers import Weights
    from quantcli.model.stack import build_stack
    from quantcli.model.transform_check import TOLERANCE, vo_pairs, worst_change

    with CheckpointTensors(source) as tensors:
        weights = Weights.of(tensors)
        stack = build_stack(source.config, weights.names, weights.shape, f"--rotate vo: {label}")
        pairs = vo_pairs(stack)
        if not pairs:
            raise QuantcliError(f"--rotate vo: {label} has no attention with separate v_proj and o_proj (fused q/k/v "
                                f"or MLA attention has none to rotate); drop the option")
        ops: dict[str, TransformOp] = {}
        for p in pairs:
            _check_heads(p, weights.shape(p.v), weights.shape(p.o))
            ops.update({p.v: TransformOp("rows", p.head), p.o: TransformOp("columns", p.head)})
            if p.v_bias:
                ops[p.v_bias] = TransformOp("bias", p.head)
        change, layer = worst_change(stack, weights, pairs, lambda n, t: ops[n].apply(t) if n in ops else t,
                                     torch.device("cpu"))
    if change > TOLERANCE:
        raise QuantcliError(f"--rotate vo: rotating layer {layer}'s v_proj and o_proj changes its output by "
                            f"{change:.3g} (relative), so its attention does more to the values than a weighted sum "
                            f"per head (an output gate, a norm on v): not exact on {type(stack.model).__name__}, "
                            f"refused")
    return ops


def _check_heads(pair, v_shape: tuple[int, ...], o_shape: tuple[int, ...]) -> None:
    if v_shape[0] % pair.head or o_shape[-1] % pair.head:
        raise QuantcliError(f"--rotate vo: {pair.attention}: v_proj has {v_shape[0]} rows and o_proj {o_shape[-1]} "
                            f"columns, not whole heads of {pair.head}; the rotation is per head")


def with_transforms(plan, dense_dtype: str | None = None):
    """`plan` with its options' transforms (`--rotate vo`): the ops by tensor, and each dense
    tensor they change written transformed (Action.TRANSFORM). `dense_dtype`: a transform-only
    conversion of a dense source (`--recipe fp32|bf16|fp16`), every floating tensor written in
    that dtype."""
    opts = plan.options
    if not opts.rotate:
        return plan
    if plan.source_layout is not None:
        raise QuantcliError(f"--rotate {opts.rotate}: {plan.source.label} is already quantized; rotate the dense "
                            f"(BF16/FP16/FP32) checkpoint")
    ops = plan_rotation(plan.source, plan.source.label)
    tensors = []
    for t in plan.tensors:
        floating = t.dtype in ("F32", "F16", "BF16", "F64")
        if t.action == Action.COPY and (t.name in ops or (dense_dtype is not None and floating)):
            dtype = dense_dtype if dense_dtype is not None and floating else t.dtype
            t = replace(t, action=Action.TRANSFORM, outputs=(OutSpec(t.name, dtype, t.shape),))
        tensors.append(t)
    return replace(plan, tensors=tensors, transforms=ops)


def record(rotate: str, ops: dict[str, TransformOp]) -> dict:
    """The manifest's account: enough to recompute every changed tensor from the source."""
    heads = sorted({op.head for op in ops.values()})
    kind = "hadamard" if all(h & (h - 1) == 0 for h in heads) else f"random orthogonal (seed {SEED})"
    return {"rotate": rotate, "rotation": kind, "head_dim": heads[0] if len(heads) == 1 else heads,
            "tensors": {name: {"part": op.part, "head": op.head} for name, op in sorted(ops.items())}}


def ops_of(record_doc: dict | None) -> dict[str, TransformOp]:
    """The ops a manifest's `transforms` record names (empty: none)."""
    if not record_doc:
        return {}
    return {name: TransformOp(v["part"], int(v["head"])) for name, v in record_doc.get("tensors", {}).items()}
