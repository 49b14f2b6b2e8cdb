"""Reference ``merge_partials``: log-sum-exp merge of partial attention results (the split-K decode's and
prefill's key splits, the compressed part and the exact window of the HF attention)."""

from __future__ import annotations

import torch


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attentions over disjoint key sets.

    outs : shape [S, ..., D], each normalised by its own softmax sum; lses : shape [S, ...]
    (natural log; -inf for a split that saw no key). Returns (out [..., D] fp32, lse [...] fp32).
    """
    outs = outs.float()
    lses = lses.float()
    m = lses.amax(dim=0)
    m_safe = torch.where(torch.isfinite(m), m, 0)
    weights = torch.exp(lses - m_safe)  # exp(-inf) = 0 for empty splits
    total = weights.sum(dim=0)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0) / total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    lse = torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, float("-inf")))
    return out, lse
