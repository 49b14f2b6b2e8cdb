"""CUDA ``decode_merged``: the split-K decode (``cuda/tq_decode.cu``, contiguous layout) over a fixed-capacity store
whose live length per sequence is a device tensor, with one more partial result merged in the same
``cuda/merge_partials.cu`` launch. No host synchronisation and no allocation outside torch's allocator, so a
CUDA graph can capture it."""

from __future__ import annotations

import torch
from torch import Tensor

from . import checks, tq_attention
from .decode_launch import check_codebooks
from .tq_decode import check_decode_inputs, launch_contiguous

NAME_EXPRESSIONS: tuple[str, ...] = ()  # the kernels of tq_decode.py and merge_partials.py


def unsupported(k_bits: int, v_bits: int, head_dim: int) -> str | None:
    """Why no kernel serves this decode (a phrase), or None when one does: the widths and head_dims of the one-query
    decode that ``tq_attention`` routes."""
    return tq_attention.unsupported(k_bits, v_bits, 1, head_dim)


def decode_merged(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, lengths: Tensor, key_bias: Tensor | None, extra_out: Tensor, extra_lse: Tensor, k_bits: int,
    v_bits: int, scale: float,
) -> tuple[Tensor, Tensor]:
    """See :func:`flashquant_hf.reference.decode_merged.decode_merged` (``lengths`` int32 [B] on the device)."""
    check_codebooks(k_centroids, v_centroids, k_bits, v_bits, q_rot.device)
    check_decode_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits, key_bias)
    batch, q_heads, _, head_dim = q_rot.shape
    capacity = k_packed.shape[2]
    checks.check_layout("lengths", lengths, torch.int32, (batch,))
    checks.check_device("lengths", lengths, q_rot.device, like="`q_rot`")
    if not lengths.is_contiguous():
        raise ValueError(f"`lengths` must be contiguous, got strides {lengths.stride()}")
    checks.check_layout("extra_out", extra_out, torch.float32, (batch, q_heads, 1, head_dim))
    checks.check_layout("extra_lse", extra_lse, torch.float32, (batch, q_heads, 1))
    out = torch.empty(batch, q_heads, 1, head_dim, dtype=torch.float32, device=q_rot.device)
    lse = torch.empty(batch, q_heads, 1, dtype=torch.float32, device=q_rot.device)
    if capacity == 0:  # nothing compressed can be live: the merge of the extra part alone
        out.copy_(torch.where(torch.isfinite(extra_lse).unsqueeze(-1), extra_out, 0))
        lse.copy_(extra_lse)
        return out, lse
    launch_contiguous(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits, v_bits, scale,
                      key_bias, out, lse, lengths, (extra_out.contiguous(), extra_lse.contiguous()))
    return out, lse
