"""CUDA ``tq_attention``: one query token per sequence goes to the split-K decode kernel, longer query
chunks to the fused FlashAttention-2 prefill kernel. Same signature as the reference."""

from __future__ import annotations

import importlib

import torch

NAME_EXPRESSIONS: tuple[str, ...] = ()  # the kernels live in tq_decode.py and tq_prefill.py


def tq_attention(
    q_rot: torch.Tensor, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal: bool = False, key_bias=None,
):
    """See :func:`flashquant_hf.reference.tq_attention.tq_attention`."""
    op = "tq_decode" if q_rot.shape[2] == 1 else "tq_prefill"
    module = importlib.import_module(f"flashquant_hf.kernels.{op}")
    return getattr(module, op)(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
        causal=causal, key_bias=key_bias,
    )
