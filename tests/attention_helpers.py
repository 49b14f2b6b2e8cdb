"""Attention in float64 or as PyTorch computes it in a lower dtype, and causal masks: the independent references of
the attention tests."""

from __future__ import annotations

import torch


def attention_in_dtype(query, keys, values, scale, bias=None, dtype=torch.float64, softcap=None, causal=False):
    """Attention as PyTorch's fused SDPA computes it in ``dtype``: inputs rounded to ``dtype``; float32 scores,
    softmax and log-sum-exp (float64 when ``dtype`` is); probabilities and output rounded to ``dtype``.

    query: shape [B, Hq, Lq, D]; keys, values: shape [B, H_kv, N, D] (Hq a multiple of H_kv); bias: additive, any
    shape that broadcasts to [B, Hq, Lq, N]; causal: query i sees key j iff j <= N - Lq + i. Returns (out
    [B, Hq, Lq, D] of ``dtype``, lse [B, Hq, Lq]); a row whose keys are all masked gets out 0 and lse -inf.
    """
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    group = query.shape[1] // keys.shape[1]
    q, k, v = (t.to(dtype).to(accumulate) for t in (query, keys, values))
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(accumulate)
    if causal:
        q_len, kv_len = scores.shape[-2:]
        visible = torch.arange(kv_len, device=scores.device) <= torch.arange(q_len, device=scores.device)[:, None] + (
            kv_len - q_len)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1))
    out = probs.to(dtype).to(accumulate) @ v.repeat_interleave(group, dim=1)
    return out.to(dtype), lse


def float64_attention(query, keys, values, bias, scale, softcap=None):
    """float64 attention over full K/V [B, H_kv, N, D] (query [B, Hq, Lq, D]; bias [B, Lq, N] additive) ->
    [B, Lq, Hq, D]."""
    bias = None if bias is None else bias[:, None]
    return attention_in_dtype(query, keys, values, scale, bias, softcap=softcap)[0].transpose(1, 2)


def merge_float64(outs, lses):
    """Log-sum-exp merge of partial attentions in float64: outs [S, ..., D], lses [S, ...] (-inf for a split that saw
    no key, whose out may hold anything) -> (out [..., D], lse [...]); a row every split missed gets 0 and -inf."""
    lses = lses.double()
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(0))
    weights = torch.where(torch.isfinite(lses), weights, 0)
    out = (weights.unsqueeze(-1) * torch.nan_to_num(outs.double())).sum(0)
    return out, lse


def causal_mask(batch, q_len, total, pad: list[int] | None = None, as_float: torch.dtype | None = None):
    """[batch, 1, q_len, total] bool (True = visible) for the last q_len positions; ``pad[b]`` left-padded keys of
    row b; ``as_float``: an additive mask of that dtype instead (eager)."""
    rows = torch.arange(total - q_len, total)[:, None]
    mask = (torch.arange(total)[None, :] <= rows)[None, None].repeat(batch, 1, 1, 1)
    for b, n in enumerate(pad or []):
        mask[b, :, :, :n] = False
    if as_float is not None:
        mask = torch.where(mask, 0.0, torch.finfo(as_float).min).to(as_float)
    return mask
