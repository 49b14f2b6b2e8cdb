"""Reference ``tq_prefill``: ``tq_attention`` for query chunks (the contract of the fused CUDA prefill in
``kernels/tq_prefill.py``), computed by the shared reference math of :mod:`flashquant_hf.reference.tq_attention`."""

from __future__ import annotations

import torch

from .tq_attention import tq_attention


def tq_prefill(
    q_rot: torch.Tensor,
    k_packed: torch.Tensor,
    k_norms: torch.Tensor,
    v_packed: torch.Tensor,
    v_norms: torch.Tensor,
    k_centroids: torch.Tensor,
    v_centroids: torch.Tensor,
    k_bits: int,
    v_bits: int,
    scale: float,
    causal: bool = False,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flashquant_hf.reference.tq_attention.tq_attention` for any ``Lq >= 1`` (same parameters and results).

    >>> out_rot, lse = tq_prefill(q_rot, kp, kn, vp, vn, kc, vc, 4, 4, 128 ** -0.5, causal=True)  # doctest: +SKIP
    """
    return tq_attention(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                        causal, key_bias)
