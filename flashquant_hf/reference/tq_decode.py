"""Reference ``tq_decode``: ``tq_attention`` for one query token per sequence (the contract of the CUDA decode in
``kernels/tq_decode.py``), computed by the shared reference math of :mod:`flashquant_hf.reference.tq_attention`."""

from __future__ import annotations

import torch
from torch import Tensor

from .tq_attention import tq_attention


def tq_decode(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, k_bits: int, v_bits: int, scale: float, causal: bool = False, key_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`flashquant_hf.reference.tq_attention.tq_attention` for ``Lq == 1``: same parameters, ``q_rot`` of shape
    [B, Hq, 1, D], results of shape [B, Hq, 1, D] and [B, Hq, 1]. ``causal`` changes nothing: with one query token
    the bottom-right aligned mask hides nothing.

    >>> out_rot, lse = tq_decode(q_rot, kp, kn, vp, vn, kc, vc, 4, 4, 128 ** -0.5)  # doctest: +SKIP
    """
    if isinstance(q_rot, torch.Tensor) and q_rot.dim() == 4 and q_rot.shape[2] != 1:
        raise ValueError(f"`q_rot` must hold one query token per sequence (Lq = 1), got Lq = {q_rot.shape[2]}")
    return tq_attention(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                        causal, key_bias)
