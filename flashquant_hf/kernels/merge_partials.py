"""CUDA ``merge_partials``: log-sum-exp merge of partial attention results (``cuda/merge_partials.cu``)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import checks
from . import loader
from .loader import get_kernel, launch

CUDA_SOURCE = "merge_partials.cu"
VECTOR_HEAD_DIMS = (64, 128, 256)
ROWS_PER_BLOCK = 8
MERGE_THREADS = 32 * ROWS_PER_BLOCK  # one warp per row
# Above this many splits a row's reads are issued 32 at a time (16 for head_dim 256; the B=1/N=128K decode has 32);
# below, 4 at a time, which keeps the registers of the prefill's many-row, 2-split merges low.
DEEP_SPLITS = 8


def reads_in_flight(head_dim: int, splits: int) -> int:
    """Row reads the merge issues before using the first (its ``kInFlight``)."""
    if splits <= DEEP_SPLITS:
        return 4
    return 16 if head_dim == 256 else 32


def merge_name(head_dim: int, splits: int = 2) -> str:
    """Name expression of the merge of ``splits`` partials for ``head_dim`` (0: the generic head_dim loop)."""
    if head_dim not in VECTOR_HEAD_DIMS:
        return "fqr::merge_partials_kernel<0, 4>"
    return f"fqr::merge_partials_kernel<{head_dim}, {reads_in_flight(head_dim, splits)}>"


def merge_kernel(head_dim: int, device_index: int, splits: int) -> tuple[object, int]:
    """The merge of ``splits`` partials for ``head_dim`` on device ``device_index`` and its CUfunction (for
    ``loader.launch_cached``)."""
    return _named_kernel(merge_name(head_dim, splits), device_index)


@functools.cache
def _named_kernel(name: str, device_index: int) -> tuple[object, int]:
    kernel = get_kernel(CUDA_SOURCE, name, torch.device("cuda", device_index))
    return kernel, loader.function_ptr(kernel, device_index)


def merge_grid(rows: int) -> tuple[int, int, int]:
    """Grid of one merge launch over ``rows`` rows."""
    return (-(-rows // ROWS_PER_BLOCK), 1, 1)


def contiguous_merge_args(part_out, part_lse, out, lse, splits: int, rows: int, head_dim: int) -> tuple:
    """Kernel arguments merging contiguous partials (``part_out`` element (s, r, d) at ``(s * rows + r) * D + d``,
    ``part_lse`` (s, r) at ``s * rows + r``; tensors or raw pointers) into contiguous ``out [rows, D]`` and
    ``lse [rows]``. The decode and prefill wrappers both launch through this, so the argument types, which
    ``loader.launch_cached`` lays out once per kernel, are the same for every caller."""
    i64 = np.int64
    return (part_out, i64(rows * head_dim), i64(head_dim), part_lse, i64(rows), i64(1), out, lse, splits, rows,
            head_dim)


NAME_EXPRESSIONS: tuple[str, ...] = tuple(
    sorted({merge_name(d, splits) for d in (0,) + VECTOR_HEAD_DIMS for splits in (2, DEEP_SPLITS + 1)})
)


def _check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    for name, t in (("outs", outs), ("lses", lses)):
        checks.check_tensor(name, t)
        if not t.is_floating_point():
            raise ValueError(f"`{name}` must be a floating tensor, got {checks.dtype_name(t.dtype)}")
    if outs.dim() < 2 or tuple(outs.shape[:-1]) != tuple(lses.shape):
        raise ValueError(
            f"`outs` must have shape [S, ..., D] and `lses` [S, ...], got {list(outs.shape)} and {list(lses.shape)}"
        )
    checks.check_same_device({"outs": outs, "lses": lses})


def launch_merge(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge fp32 ``outs [S, rows, D]`` (last dim contiguous, 16-byte aligned rows) and ``lses [S, rows]`` into
    contiguous ``out [rows, D]`` and ``lse [rows]`` (no validation: the decode wrappers call this)."""
    splits, rows, head_dim = outs.shape
    kernel, _ = merge_kernel(head_dim, loader.device_index(outs.device), splits)
    launch(
        kernel, merge_grid(rows), (MERGE_THREADS,),
        (outs, np.int64(outs.stride(0)), np.int64(outs.stride(1)), lses, np.int64(lses.stride(0)),
         np.int64(lses.stride(1)), out, lse, splits, rows, head_dim),
        outs.device,
    )


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge S partial attentions over disjoint key sets (see
    :func:`flashquant_hf.reference.merge_partials.merge_partials`).

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
