"""float64 attention and causal masks: the independent references of the attention tests."""

from __future__ import annotations

import torch


def float64_attention(query, keys, values, bias, scale, softcap=None):
    """float64 attention over full K/V [B, H_kv, N, D] (query [B, Hq, Lq, D]; bias [B, Lq, N] additive) ->
    [B, Lq, Hq, D]."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias[:, None].double()
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


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
