"""Reference softmax attention over uncompressed K/V: the oracle of the CUDA FlashAttention-2 kernel."""

from __future__ import annotations

import torch

from .tq_attention import causal_keep


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with grouped-query heads, computed in float math (fp32, or fp64 for fp64 inputs).

    Parameters
    ----------
    q : shape [B, Hq, Lq, D]
    k, v : shape [B, H_kv, N, D], Hq a multiple of H_kv (query head h uses KV head h // (Hq / H_kv))
    scale : softmax scale applied to q.k
    causal : bottom-right aligned causal mask (query i sees key j iff j <= N - Lq + i)

    Returns
    -------
    out : shape [B, Hq, Lq, D] in q's dtype (0 for a row that sees no key)
    lse : fp32 shape [B, Hq, Lq], natural log-sum-exp of the scaled scores (-inf for a row that sees no key)

    >>> q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    >>> out, lse = flash_attention(q, k, v, scale=8 ** -0.5, causal=True)
    >>> out.shape, lse.shape
    (torch.Size([1, 4, 3, 8]), torch.Size([1, 4, 3]))
    """
    q_heads, q_len = q.shape[1], q.shape[2]
    kv_heads, kv_len = k.shape[1], k.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"`q` heads ({q_heads}) must be a multiple of the KV heads ({kv_heads})")
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q_heads // kv_heads
    keys = k.to(compute).repeat_interleave(group, dim=1)
    values = v.to(compute).repeat_interleave(group, dim=1)
    scores = (q.to(compute) @ keys.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~causal_keep(q_len, kv_len, scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, 0)
    return (probs @ values).to(q.dtype), lse.float()
