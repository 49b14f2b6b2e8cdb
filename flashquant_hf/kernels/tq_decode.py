"""CUDA ``tq_decode``: ``tq_attention`` for one query token over the contiguous per-layer layout (1- to 4-bit codes).

Same kernel as the paged decode (``cuda/tq_decode.cu``, template ``MODE`` 0, or 1 with ``key_bias``); the plan,
workspace and launch live in :mod:`flashquant_hf.kernels.decode_launch`.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from ..packing import packed_size
from ..store_layout import norms_follow_rows, slice_alignment
from . import checks, decode_launcher
from .decode_launch import (
    MODE_CONTIGUOUS, MODE_CONTIGUOUS_BIAS, NULL, PreparedDecode, call_signature, check_codebooks, check_query,
    contiguous_runs, decode_outputs, remember_call, remember_compiled, run_compiled, run_decode, run_prepared,
    staged_runs, TMA_OPTION,
)


def _check_cache_tensor(name: str, t: object, dtype: torch.dtype, shape: tuple, device: torch.device,
                        alignment: int = 0) -> None:
    checks.check_layout(name, t, dtype, shape)
    checks.check_device(name, t, device, like="`q_rot`")
    if alignment:  # the lanes' vector loads
        checks.check_aligned_rows(name, t, alignment)


def _norms_follow_rows(packed: object, norms: object) -> bool:
    try:
        return norms_follow_rows(packed, norms)
    except (AttributeError, IndexError, TypeError, RuntimeError):  # not tensors: the checks name them
        return False


def check_decode_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits, key_bias) -> None:
    """ValueError naming the problem unless the decode inputs have the shapes, dtypes, device and alignment the
    kernel reads."""
    check_query(q_rot, 4, "[B, Hq, 1, D]")
    batch, q_heads, q_len, head_dim = q_rot.shape
    if q_len != 1:
        raise ValueError(f"`q_rot` must hold one query token per sequence (Lq = 1), got Lq = {q_len}")
    dev = q_rot.device
    k_row, v_row = packed_size(head_dim, k_bits), packed_size(head_dim, v_bits)
    _check_cache_tensor("k_packed", k_packed, torch.uint8, (batch, "H_kv", "N", k_row), dev,
                        slice_alignment(head_dim, k_bits, keys=True))
    kv_heads, num_keys = int(k_packed.shape[1]), int(k_packed.shape[2])
    _check_cache_tensor("v_packed", v_packed, torch.uint8, (batch, kv_heads, num_keys, v_row), dev,
                        slice_alignment(head_dim, v_bits, keys=False))
    _check_cache_tensor("k_norms", k_norms, torch.float32, (batch, kv_heads, num_keys), dev)
    _check_cache_tensor("v_norms", v_norms, torch.float32, (batch, kv_heads, num_keys), dev)
    if q_heads % kv_heads:
        raise ValueError(f"`q_rot` heads ({q_heads}) must be a multiple of the KV heads ({kv_heads})")
    if key_bias is not None:
        _check_cache_tensor("key_bias", key_bias, torch.float32, (batch, num_keys), dev)


def tq_decode(
    q_rot: Tensor, k_packed: Tensor, k_norms: Tensor, v_packed: Tensor, v_norms: Tensor, k_centroids: Tensor,
    v_centroids: Tensor, k_bits: int, v_bits: int, scale: float, causal: bool = False, key_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Split-K decode over the contiguous layout (CUDA): the contract of
    :func:`flashquant_hf.reference.tq_decode.tq_decode` (``tq_attention`` for ``Lq == 1``), for these inputs.

    Parameters
    ----------
    q_rot : fp16/bf16/fp32 shape [B, Hq, 1, D]; D in {64, 128, 256}
    k_packed, v_packed : views of a larger capacity buffer are read in place (element strides); rows aligned as
        :func:`~flashquant_hf.store_layout.slice_alignment` says
    k_bits, v_bits : 1 to 4
    k_norms, v_norms : fp32 [B, H_kv, N], element strides; a side's norms may follow its code rows in one buffer
        (:func:`~flashquant_hf.store_layout.split_rows`)
    k_centroids, v_centroids, scale, causal, key_bias : as for the reference
    """
    scale = float(scale)
    # In the order of the kernel's pointer arguments; the compiled launcher serves calls prepared before.
    tensors = (q_rot, k_packed, k_norms, v_packed, v_norms, key_bias, k_centroids, v_centroids)
    # The staged build reads inline norms from their code rows (store_layout): a prepared call serves only calls whose
    # norms follow their rows where its first call's did.
    follow = (_norms_follow_rows(k_packed, k_norms), _norms_follow_rows(v_packed, v_norms))
    values = (decode_launcher.TQ_DECODE, k_bits, v_bits, scale, *follow)
    result = run_compiled(tensors, values)
    if result is not None:
        return result
    signature = call_signature("tq_decode", tensors, *values[1:])
    result = run_prepared(signature, tensors, values)
    if result is not None:
        return result
    check_codebooks(k_centroids, v_centroids, k_bits, v_bits, q_rot.device)
    check_decode_inputs(q_rot, k_packed, k_norms, v_packed, v_norms, k_bits, v_bits, key_bias)
    batch, q_heads, _, head_dim = q_rot.shape
    num_keys = k_packed.shape[2]
    out, lse = decode_outputs(q_rot)
    if num_keys == 0 or batch == 0:
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    launched = launch_contiguous(q_rot, k_packed, k_norms, v_packed, v_norms, k_centroids, v_centroids, k_bits,
                                 v_bits, scale, key_bias, out, lse)
    if launched is not None:  # later calls check what this one's build assumed of the addresses
        if TMA_OPTION in launched.options:  # every run bulk-copied, inline norms with their rows
            runs = (16, 4 if follow[0] else 16, 16, 4 if follow[1] else 16)
        else:
            runs = (slice_alignment(head_dim, k_bits, keys=True), 4, slice_alignment(head_dim, v_bits, keys=False), 4)
        found = remember_call(signature, launched, (1, *runs, 1, 1, 1))  # per tensor: query, runs, bias, centroids
        remember_compiled(found, tensors, values, out, lse)
    return out, lse


def launch_contiguous(
    q_rot: torch.Tensor, k_packed: torch.Tensor, k_norms: torch.Tensor, v_packed: torch.Tensor, v_norms: torch.Tensor,
    k_centroids: torch.Tensor, v_centroids: torch.Tensor, k_bits: int, v_bits: int, scale: float,
    key_bias: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor, lengths: torch.Tensor | None = None,
    extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PreparedDecode | None:
    """Launch the decode over the contiguous layout into ``out`` / ``lse`` (checked inputs, at least one key of
    capacity). ``lengths``: int32 ``[B]`` live keys per sequence on the device (default: all ``N`` keys);
    ``extra``: one more partial merged in (see :func:`~flashquant_hf.kernels.decode_launch.run_decode`, which
    returns the prepared call)."""
    batch, q_heads, _, head_dim = q_rot.shape
    kv_heads, num_keys = k_packed.shape[1], k_packed.shape[2]
    i64 = np.int64
    ks, kns, vs, vns = k_packed.stride(), k_norms.stride(), v_packed.stride(), v_norms.stride()
    if key_bias is None:
        mode, bias_args = MODE_CONTIGUOUS, (NULL, i64(0), i64(0))
    else:
        mode, bias_args = MODE_CONTIGUOUS_BIAS, (key_bias, i64(key_bias.stride(0)), i64(key_bias.stride(1)))
    tensor_args = (
        k_packed, i64(ks[0]), i64(ks[1]), i64(ks[2]),
        k_norms, i64(kns[0]), i64(kns[1]), i64(kns[2]),
        v_packed, i64(vs[0]), i64(vs[1]), i64(vs[2]),
        v_norms, i64(vns[0]), i64(vns[1]), i64(vns[2]),
        *bias_args,
        NULL, i64(0), NULL if lengths is None else lengths,
        i64(0), 0, num_keys,
    )
    qs = q_rot.stride()
    runs_staged = 0 if key_bias is not None else staged_runs(
        head_dim, k_bits, v_bits, contiguous_runs(k_packed, k_norms, v_packed, v_norms))
    return run_decode(
        mode, q_rot, (qs[0], qs[1], qs[3]), tensor_args, batch, kv_heads, q_heads // kv_heads,
        num_keys, (k_centroids, v_centroids), (k_bits, v_bits), float(scale), out, lse, extra=extra,
        runs_staged=runs_staged,
    )
