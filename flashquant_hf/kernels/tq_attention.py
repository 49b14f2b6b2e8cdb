"""CUDA ``tq_attention``: one query token per sequence goes to the split-K decode kernel (1- to 4-bit codes), longer
chunks to the fused FlashAttention-2 kernel (2- to 4-bit codes). Same signature as the reference."""

from __future__ import annotations

import torch

from .decode_launch import BITS, HEAD_DIMS
from .tq_decode import tq_decode
from .tq_prefill import KERNEL_BITS, tq_prefill

NAME_EXPRESSIONS: tuple[str, ...] = ()  # the kernels live in tq_decode.py and tq_prefill.py


def unsupported(k_bits: int, v_bits: int, q_len: int, head_dim: int) -> str | None:
    """Why no kernel reads codes of these widths for ``q_len`` query tokens (a phrase), or None when one does."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernels are built for {', '.join(map(str, HEAD_DIMS))})"
    widths = BITS if q_len == 1 else KERNEL_BITS
    if k_bits in widths and v_bits in widths:
        return None
    kind = "decode" if q_len == 1 else "multi-token chunks"
    return f"k_bits={k_bits}, v_bits={v_bits} in {kind} (kernels read {', '.join(map(str, widths))}-bit codes)"


def tq_attention(
    q_rot: torch.Tensor, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal: bool = False, key_bias=None,
):
    """See :func:`flashquant_hf.reference.tq_attention.tq_attention`."""
    run = tq_decode if q_rot.shape[2] == 1 else tq_prefill
    return run(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
        causal=causal, key_bias=key_bias,
    )
