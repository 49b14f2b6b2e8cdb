"""CUDA ``merge_partials``: log-sum-exp merge of partial attention results (``cuda/split_k_reduce.cu``)."""

from __future__ import annotations

import numpy as np
import torch

from .loader import get_kernel, launch

CUDA_SOURCE = "split_k_reduce.cu"
VECTOR_HEAD_DIMS = (64, 128, 256)
NAME_EXPRESSIONS: tuple[str, ...] = tuple(f"fqr::split_k_merge<{d}>" for d in (0,) + VECTOR_HEAD_DIMS)
ROWS_PER_BLOCK = 8


def _check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"`{name}` must be on a CUDA device, got {t.device}")
        if not t.is_floating_point():
            raise ValueError(f"`{name}` must be a floating tensor, got {t.dtype}")
    if outs.dim() < 2 or tuple(outs.shape[:-1]) != tuple(lses.shape):
        raise ValueError(
            f"`outs` must have shape [S, ..., D] and `lses` [S, ...], got {list(outs.shape)} and {list(lses.shape)}"
        )
    if outs.device != lses.device:
        raise ValueError(f"`outs` and `lses` must share a device, got {outs.device} and {lses.device}")


def launch_merge(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge fp32 ``outs [S, rows, D]`` (last dim contiguous, 16-byte aligned rows) and ``lses [S, rows]`` into
    contiguous ``out [rows, D]`` and ``lse [rows]`` (no validation: the decode wrappers call this)."""
    splits, rows, head_dim = outs.shape
    variant = head_dim if head_dim in VECTOR_HEAD_DIMS else 0
    kernel = get_kernel(CUDA_SOURCE, f"fqr::split_k_merge<{variant}>", outs.device)
    launch(
        kernel, (-(-rows // ROWS_PER_BLOCK),), (32 * ROWS_PER_BLOCK,),
        (outs, np.int64(outs.stride(0)), np.int64(outs.stride(1)), lses, np.int64(lses.stride(0)),
         np.int64(lses.stride(1)), out, lse, splits, rows, head_dim),
        outs.device,
    )


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attentions over disjoint key sets (see :func:`flashquant_hf.reference.split_k.merge_partials`).

    outs : shape [S, ..., D], each normalised by its own softmax sum; lses : shape [S, ...] natural log, -inf for
    an empty split. Returns (out [..., D] fp32, lse [...] fp32); rows whose splits are all empty get out 0, lse -inf.

    >>> out, lse = merge_partials(torch.randn(4, 2, 8, 128, device="cuda"), torch.randn(4, 2, 8, device="cuda"))
    """
    _check_merge_inputs(outs, lses)
    splits, head_dim = outs.shape[0], outs.shape[-1]
    batch_shape = tuple(outs.shape[1:-1])
    flat_outs = outs.float().reshape(splits, -1, head_dim)
    flat_lses = lses.float().reshape(splits, -1)
    vector = head_dim in VECTOR_HEAD_DIMS
    if flat_outs.stride(-1) != 1 or (vector and (flat_outs.data_ptr() % 16 or flat_outs.stride(0) % 4 or flat_outs.stride(1) % 4)):
        flat_outs = flat_outs.contiguous()
    rows = flat_outs.shape[1]
    out = torch.empty(rows, head_dim, dtype=torch.float32, device=outs.device)
    lse = torch.empty(rows, dtype=torch.float32, device=outs.device)
    if rows and splits:
        launch_merge(flat_outs, flat_lses, out, lse)
    elif rows:
        out.zero_()
        lse.fill_(float("-inf"))
    return out.reshape(*batch_shape, head_dim), lse.reshape(batch_shape)
