"""Reference attention of pre-rotated queries over TurboQuant-compressed K/V, in rotated space."""

from __future__ import annotations

import torch
from torch import Tensor

from .decompress import dequantize_rotated


def causal_keep(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask ``[q_len, kv_len]``: query i sees key j iff j <= kv_len - q_len + i."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    return torch.arange(kv_len, device=device).unsqueeze(0) <= rows


def tq_attention(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, k_bits: int, v_bits: int, scale: float, causal: bool = False, key_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention over compressed keys/values, never leaving rotated space.

    Parameters
    ----------
    q_rot : shape [B, Hq, Lq, D], queries already rotated by the key rotation (``q @ Pi_K.T``)
    k_packed, v_packed : uint8 shape [B, H_kv, N, ceil(D*bits/8)]
    k_norms, v_norms : fp32 shape [B, H_kv, N]
    k_centroids, v_centroids : fp32 shape [2^bits]
    scale : softmax scale applied to q.k
    causal : bottom-right aligned causal mask (query i sees key j iff j <= N - Lq + i)
    key_bias : optional fp32 shape [B, N], added to every score of key j (0 or -inf for padding)

    Returns
    -------
    out_rot : fp32 shape [B, Hq, Lq, D], in value-rotated space (multiply by ``Pi_V`` to leave it)
    lse : fp32 shape [B, Hq, Lq], natural log-sum-exp of the scaled scores (-inf where nothing is visible)
    """
    batch, q_heads, q_len, head_dim = q_rot.shape
    kv_heads, kv_len = k_packed.shape[1], k_packed.shape[2]
    compute = torch.promote_types(q_rot.dtype, torch.float32)
    keys = dequantize_rotated(k_packed, k_norms, k_centroids, k_bits, head_dim).to(compute)
    values = dequantize_rotated(v_packed, v_norms, v_centroids, v_bits, head_dim).to(compute)
    # Query heads of one KV head side by side as extra query rows: no repeated copies of the keys and values.
    q_grouped = q_rot.to(compute).reshape(batch, kv_heads, q_heads // kv_heads * q_len, head_dim)
    scores = ((q_grouped @ keys.transpose(-1, -2)) * scale).view(batch, q_heads, q_len, kv_len)
    if causal:
        scores = scores.masked_fill(~causal_keep(q_len, kv_len, scores.device), float("-inf"))
    if key_bias is not None:
        scores = scores + key_bias.to(compute)[:, None, None, :]
    lse = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0).unsqueeze(-1))
    probs = torch.where(finite.unsqueeze(-1), probs, 0)
    out = probs.view(batch, kv_heads, q_heads // kv_heads * q_len, kv_len) @ values
    out = out.view(batch, q_heads, q_len, head_dim)
    return out.float(), lse.float()
