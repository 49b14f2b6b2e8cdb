"""CUDA ``tq_attention``: one query token per sequence over TQ4 goes to the split-K decode kernel, everything
else to the fused FlashAttention-2 kernel. Same signature as the reference."""

from __future__ import annotations

import importlib

import logging

import torch

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


NAME_EXPRESSIONS: tuple[str, ...] = ()  # the kernels live in tq_decode.py and tq_prefill.py


def tq_attention(
    q_rot: torch.Tensor, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
    causal: bool = False, key_bias=None,
):
    """See :func:`flashquant_hf.reference.tq_attention.tq_attention`."""
    if 1 in (k_bits, v_bits):
        # No kernel reads 1-bit codes; they exist for experiments only (logged once).
        _warn_once("no CUDA kernel reads 1-bit codes; using the PyTorch reference for tq_attention")
        module, op = importlib.import_module("flashquant_hf.reference.tq_attention"), "tq_attention"
    else:
        # The split-K decode kernel is specialised for TQ4; the fused FA2 kernel also serves one-token
        # queries for 2/3-bit codes.
        op = "tq_decode" if q_rot.shape[2] == 1 and (k_bits, v_bits) == (4, 4) else "tq_prefill"
        module = importlib.import_module(f"flashquant_hf.kernels.{op}")
    return getattr(module, op)(
        q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
        causal=causal, key_bias=key_bias,
    )
