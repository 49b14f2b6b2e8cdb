"""CUDA ``tq_attention``: one query token per sequence over TQ4 goes to the split-K decode kernel, everything
else to the fused FlashAttention-2 kernel. Same signature as the reference."""

from __future__ import annotations

import torch

from .tq_decode import tq_decode
from .tq_prefill import KERNEL_BITS, tq_prefill

NAME_EXPRESSIONS: tuple[str, ...] = ()  # the kernels live in tq_decode.py and tq_prefill.py


def unsupported(k_bits: int, v_bits: int) -> str | None:
    """Why no kernel reads codes of these widths (a phrase), or None when one does (1-bit codes exist for
    experiments only)."""
    if k_bits in KERNEL_BITS and v_bits in KERNEL_BITS:
        return None
    return f"k_bits={k_bits}, v_bits={v_bits} (kernels read {', '.join(map(str, KERNEL_BITS))}-bit codes)"


def tq_attention(
    q_rot: torch.Tensor, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal: bool = False, key_bias=None,
):
    """See :func:`flashquant_hf.reference.tq_attention.tq_attention`."""
    # The split-K decode kernel is specialised for TQ4; the fused FA2 kernel also serves one-token queries for
    # 2/3-bit codes.
    run = tq_decode if q_rot.shape[2] == 1 and (k_bits, v_bits) == (4, 4) else tq_prefill
    return run(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
        causal=causal, key_bias=key_bias,
    )
