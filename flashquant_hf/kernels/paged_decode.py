"""CUDA ``paged_decode``: one query token per sequence over the paged store (``flashquant_hf/paged.py``), 1- to 4-bit
codes.

Same kernel as :mod:`flashquant_hf.kernels.tq_decode` (``cuda/tq_decode.cu``, template ``MODE`` 2, built per
block size); the plan, workspace and launch live in :mod:`flashquant_hf.kernels.decode_launch`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..paged import BLOCK_SIZES, PagedLayout
from . import decode_launcher
from .decode_launch import (
    MODE_PAGED, NULL, call_signature, check_codebooks, check_query, decode_outputs, remember_call, remember_compiled,
    run_compiled, run_decode, run_prepared,
)

BLOCKS_ALIGNMENT = (1, 16, 1, 1, 1, 1)  # per tensor of a call: the blocks' bulk copies need 16-byte alignment


def _check_paged_inputs(q_rot, blocks, block_table, seq_lens, block_size, k_bits, v_bits) -> PagedLayout:
    check_query(q_rot, 3, "[S, Hq, D]")
    num_seqs, q_heads, head_dim = q_rot.shape
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"`block_size` must be one of {BLOCK_SIZES}, got {block_size!r}")
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 3:
        raise ValueError(f"`blocks` must be uint8 [num_blocks, H_kv, bytes], got {getattr(blocks, 'shape', blocks)}")
    layout = PagedLayout(block_size, int(blocks.shape[1]), head_dim, k_bits, v_bits)
    layout.check_blocks(blocks)
    if q_heads % layout.num_kv_heads:
        raise ValueError(f"`q_rot` heads ({q_heads}) must be a multiple of the KV heads ({layout.num_kv_heads})")
    if blocks.device != q_rot.device or blocks.data_ptr() % 16 or blocks.stride(0) % 16:
        raise ValueError(f"`blocks` must be 16-byte aligned on {q_rot.device}, got {blocks.device}, "
                         f"address % 16 = {blocks.data_ptr() % 16}, block stride {blocks.stride(0)}")
    if (block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != num_seqs
            or block_table.stride(1) != 1 or block_table.device != q_rot.device):
        raise ValueError(f"`block_table` must be int32 [{num_seqs}, max_blocks] (rows contiguous) on {q_rot.device}, "
                         f"got {block_table.dtype} {list(block_table.shape)} on {block_table.device}")
    if (seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (num_seqs,) or not seq_lens.is_contiguous()
            or seq_lens.device != q_rot.device):
        raise ValueError(f"`seq_lens` must be contiguous int32 [{num_seqs}] on {q_rot.device}, "
                         f"got {seq_lens.dtype} {list(seq_lens.shape)} on {seq_lens.device}")
    return layout


def paged_decode(
    q_rot: Tensor, blocks: Tensor, block_table: Tensor, seq_lens: Tensor, k_centroids: Tensor, v_centroids: Tensor,
    k_bits: int, v_bits: int, scale: float, block_size: int, max_seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Split-K decode of one query token per sequence over the paged store (CUDA): the contract of
    :func:`flashquant_hf.reference.paged_decode.paged_decode`, for these inputs.

    Parameters
    ----------
    q_rot : fp16/bf16/fp32 shape [S, Hq, D]; D in {64, 128, 256}
    blocks : shape [num_blocks, H_kv, PagedLayout.head_block_bytes], one layer of
        :class:`flashquant_hf.paged.PagedTQCache`
    k_bits, v_bits : 1 to 4
    max_seq_len : host-side upper bound of ``seq_lens`` used to plan the splits (default: read from the device,
        one synchronisation). Keys beyond it are not attended, so it must not be smaller than the true maximum.
    block_table, seq_lens, k_centroids, v_centroids, scale, block_size : as for the reference
    """
    scale = float(scale)
    signature = None
    # In the order of the kernel's pointer arguments; the compiled launcher serves calls prepared before.
    tensors = (q_rot, blocks, block_table, seq_lens, k_centroids, v_centroids)
    values = (decode_launcher.PAGED_DECODE, k_bits, v_bits, scale, block_size, max_seq_len)
    if max_seq_len is not None:  # otherwise the plan follows the lengths read from the device
        result = run_compiled(tensors, values)
        if result is not None:
            return result
        signature = call_signature("paged_decode", tensors, k_bits, v_bits, scale, block_size, max_seq_len)
    result = run_prepared(signature, tensors, values)
    if result is not None:
        return result
    check_codebooks(k_centroids, v_centroids, k_bits, v_bits, q_rot.device)
    layout = _check_paged_inputs(q_rot, blocks, block_table, seq_lens, block_size, k_bits, v_bits)
    num_seqs, q_heads, _ = q_rot.shape
    kv_heads = layout.num_kv_heads
    group = q_heads // kv_heads
    max_len = int(seq_lens.max()) if max_seq_len is None and num_seqs else int(max_seq_len or 0)
    out, lse = decode_outputs(q_rot)
    if max_len <= 0 or num_seqs == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    zero = np.int64(0)
    tensor_args = (
        blocks, zero, zero, zero,  # k_idx = block base; the kernel derives every section from it
        NULL, zero, zero, zero,
        NULL, zero, zero, zero,
        NULL, zero, zero, zero,
        NULL, zero, zero,  # key_bias
        block_table, np.int64(block_table.stride(0)), seq_lens,
        np.int64(blocks.stride(0)), layout.log2_block_size, 0,
    )
    launched = run_decode(
        MODE_PAGED, q_rot, tuple(q_rot.stride()), tensor_args, num_seqs, kv_heads, group, max_len,
        (k_centroids, v_centroids), (k_bits, v_bits), scale, out, lse, layout.log2_block_size,
    )
    found = remember_call(signature, launched, BLOCKS_ALIGNMENT)
    remember_compiled(found, tensors, values, out, lse)
    return out, lse
