"""A plain GPTQ (Frantar et al. 2022) as llm-compressor runs it, for verify's tests and
scripts/measure_verify.py: columns quantized one at a time, each one's rounding error fed back
into the columns after it through the inverse Hessian's Cholesky factor, so the codes move away
from round-to-nearest (weight error up) to lower the layer-output error on the inputs X. Group
scales (NVFP4, MX) come from the updated weights at each group's first column, as llm-compressor's
GPTQ observes them; other geometries' scales from the original weights."""

from __future__ import annotations

import torch

from quantcli.kernels import reference as R
from quantcli.kernels.decode import scale_values
from quantcli.kernels.spec import FP8_BLOCK, GROUP, ROW, TENSOR
from quantcli.recipes import QuantizedTensor


def _fake_quant(x: torch.Tensor, scale: torch.Tensor, spec, dtype: torch.dtype) -> torch.Tensor:
    v = spec.scale.scaled(x, scale, dtype)  # (a weight-dtype scale rounds the quotient to it)
    element = spec.element
    if element.name == "e2m1":
        return R.decode_e2m1(R.encode_e2m1(v.contiguous())) * scale
    if element.name.startswith("int"):
        return v.round().clamp(element.code_min, element.code_max) * scale
    return v.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def _element_scales(q, spec, n: int, k: int) -> torch.Tensor:
    s = scale_values(q.scale, q.global_scale, spec)
    if spec.geometry == TENSOR:
        return s.expand(n, k)
    if spec.geometry == ROW:
        return s.reshape(n, 1).expand(n, k)
    return s.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]


def gptq(w: torch.Tensor, x: torch.Tensor, recipe, damp: float = 0.01,
         global_amax: torch.Tensor | None = None) -> QuantizedTensor:
    """GPTQ codes and scales of the 2-D weight `w` for inputs `x` [tokens, K], in quantcli's form
    (`global_amax`: a fused group's, for NVFP4's global scale)."""
    spec = recipe.spec
    W = w.float().clone()
    n, k = W.shape
    H = 2 * x.T.double() @ x.double() / x.shape[0]
    H += damp * H.diag().mean() * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    s2 = R.global_scale_for(w, spec, global_amax)
    if spec.geometry == GROUP:
        scales = torch.empty(spec.scale_shape((n, k)), dtype=spec.scale.raw_dtype_for(w.dtype))
        S = torch.empty(n, k)
    else:
        first = R.quantize(w, spec)
        scales, S = first.scale, _element_scales(first, spec, n, k)
    Q = torch.zeros_like(W)
    for i in range(k):
        if spec.geometry == GROUP and i % spec.group == 0:
            stored, denom = R.encode_scale(W[:, i:i + spec.group].abs().amax(-1), spec, s2, w.dtype)
            scales[:, i // spec.group] = stored
            S[:, i:i + spec.group] = denom[:, None]
        Q[:, i] = _fake_quant(W[:, i], S[:, i], spec, w.dtype)
        err = (W[:, i] - Q[:, i]) / Hinv[i, i]
        W[:, i + 1:] -= err[:, None] * Hinv[i, i + 1:][None, :]
    codes = R.encode_elements(spec.scale.scaled(Q, S, w.dtype), spec.element)
    return QuantizedTensor(recipe.name, (n, k), codes, scales, s2, recipe.scale_rule)


def correlated_inputs(k: int, tokens: int = 1024, rank: int | None = None, seed: int = 0) -> torch.Tensor:
    """Activations with strongly correlated channels (a low-rank signal plus a little noise) and
    channels of very different scales, as a Linear's inputs in an LLM have: what GPTQ exploits."""
    g = torch.Generator().manual_seed(seed)
    rank = rank or max(4, k // 8)
    x = torch.randn(tokens, rank, generator=g) @ torch.randn(rank, k, generator=g)
    x += 0.1 * torch.randn(tokens, k, generator=g)
    return x * torch.exp(torch.randn(k, generator=g))
