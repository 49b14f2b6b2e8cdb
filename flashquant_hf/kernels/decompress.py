"""CUDA ``decompress`` and ``dequantize_rotated`` (``cuda/decompress.cu``); same signatures as the reference.

``dequantize_rotated`` is one kernel: unpack + centroid lookup + norm scale, written with coalesced 16-byte
stores. ``decompress`` adds the inverse rotation: fused into the same kernel as a fast Walsh-Hadamard
transform when ``hadamard_signs`` is given, otherwise one fp32 GEMM (TF32 off) of the rotated-space result
with ``rotation`` (docs/kernels_codec.md says why). Importing this module does not import CuPy.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
from torch import Tensor

from ..packing import packed_size
from . import loader
from .compress import (
    BITS,
    DTYPE_NAMES,
    HEAD_DIMS,
    SUPPORTED,
    THREADS,
    aligned_rows,
    check_bits,
    check_served,
    check_tensor,
    collapse_rows,
    device_index,
    fast_divider,
    sm_count,
)
from .compress import unsupported as _unsupported

CUDA_SOURCE = "decompress.cu"
KERNELS: tuple[str, ...] = ("dequantize_rotated", "decompress_hadamard")


def kernel_name(kernel: str, head_dim: int, bits: int, dtype: torch.dtype) -> str:
    """Name expression of one instantiation, e.g. ``tq_dequantize_rotated<128, 4, __nv_bfloat16>``."""
    return f"tq_{kernel}<{head_dim}, {bits}, {DTYPE_NAMES[dtype]}>"


# Output dtypes come from the same table as the compress input dtypes.
NAME_EXPRESSIONS: tuple[str, ...] = tuple(kernel_name(k, d, b, t) for k in KERNELS for d, b, t in SUPPORTED)

# Threads per row (cuda/decompress.cu Shape::LANES): 16 coordinates each.
LANES = {64: 4, 128: 8, 256: 16}
_WAVES = 16


def unsupported(head_dim: int, bits: int) -> str | None:
    """Why no decompress kernel serves ``head_dim``-vectors at ``bits`` bits (a phrase), or None when one does
    (the compress kernels' table)."""
    return _unsupported(head_dim, bits)


def _check_decompress_inputs(
    packed: object, norms: object, centroids: object, bits: object, head_dim: object, dtype: object
) -> int:
    check_tensor("packed", packed, dtypes=(torch.uint8,))
    assert isinstance(packed, torch.Tensor)
    bits = check_bits(bits)
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
        raise ValueError(f"`head_dim` must be a positive integer, got {head_dim!r}")
    nbytes = packed_size(int(head_dim), bits)
    if packed.dim() < 1 or packed.shape[-1] != nbytes:
        raise ValueError(
            f"`packed` must have shape [..., {nbytes}] for head_dim={head_dim}, bits={bits}; got {list(packed.shape)}"
        )
    check_tensor("norms", norms, packed.device, (torch.float32,), packed.shape[:-1])
    check_tensor("centroids", centroids, packed.device, (torch.float32,), (1 << bits,))
    if dtype not in DTYPE_NAMES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in DTYPE_NAMES)
        raise ValueError(f"`dtype` must be one of {allowed}; got {dtype!r}")
    if packed.numel() // nbytes >= 2**31 - 2**20:
        raise ValueError(f"`packed` has {packed.numel() // nbytes} rows; the kernel takes fewer than 2^31 - 2^20")
    return bits


def dequantize_rotated(
    packed: torch.Tensor,
    norms: torch.Tensor,
    centroids: torch.Tensor,
    bits: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``norm * centroids[idx]`` in rotated space (see :func:`flashquant_hf.reference.decompress.dequantize_rotated`).

    Parameters
    ----------
    packed : uint8 shape [..., ceil(D*bits/8)] CUDA tensor (any leading strides)
    norms : fp32 shape [...]
    centroids : fp32 shape [2^bits]
    bits, head_dim : the code's bit width (2/3/4) and D (:func:`unsupported` for the others)
    dtype : output dtype (fp32 like the reference by default; fp16/bf16 halve the bytes written)

    Returns
    -------
    ``dtype`` tensor of shape [..., D] (new, contiguous)

    >>> y = dequantize_rotated(packed, norms, centroids, 4, 128, torch.bfloat16)  # doctest: +SKIP
    """
    bits = _check_decompress_inputs(packed, norms, centroids, bits, head_dim, dtype)
    check_served("dequantize_rotated", head_dim, bits)
    out = torch.empty(tuple(packed.shape[:-1]) + (head_dim,), dtype=dtype, device=packed.device)
    if out.numel():
        launch_decompress(packed, norms, centroids, bits, None, out)
    return out


def decompress(
    packed: Tensor, norms: Tensor, rotation: Tensor, centroids: Tensor, bits: int, head_dim: int,
    dtype: torch.dtype = torch.float32, hadamard_signs: Tensor | None = None,
) -> Tensor:
    """Reconstruct ``x_hat = norm * centroids[idx] @ rotation`` on the GPU (see
    :func:`flashquant_hf.reference.decompress.decompress`).

    Parameters
    ----------
    packed : uint8 shape [..., ceil(D*bits/8)] CUDA tensor (any leading strides)
    norms : fp32 shape [...]
    rotation : fp32 shape [D, D]
    centroids : fp32 shape [2^bits]
    bits, head_dim : the code's bit width (2/3/4) and D (:func:`unsupported` for the others)
    dtype : output dtype (fp16/bf16/fp32)
    hadamard_signs : fp32 shape [D], the signs of ``rotation = H diag(s) / sqrt(D)``: the inverse rotation
        then runs inside the kernel as a fast Walsh-Hadamard transform

    Returns
    -------
    ``dtype`` tensor of shape [..., D] (new, contiguous)

    >>> x_hat = decompress(packed, norms, pi, centroids, 4, 128, torch.bfloat16)  # doctest: +SKIP
    """
    bits = _check_decompress_inputs(packed, norms, centroids, bits, head_dim, dtype)
    check_tensor("rotation", rotation, packed.device, (torch.float32,), (head_dim, head_dim))
    if hadamard_signs is not None:
        check_tensor("hadamard_signs", hadamard_signs, packed.device, (torch.float32,), (head_dim,))
    check_served("decompress", head_dim, bits)
    shape = tuple(packed.shape[:-1]) + (head_dim,)
    if hadamard_signs is not None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
        if out.numel():
            launch_decompress(packed, norms, centroids, bits, hadamard_signs, out)
        return out
    rotated = torch.empty(shape, dtype=torch.float32, device=packed.device)
    if rotated.numel():
        launch_decompress(packed, norms, centroids, bits, None, rotated)
    with ieee_fp32_matmul():
        return (rotated @ rotation).to(dtype)


@contextlib.contextmanager
def ieee_fp32_matmul() -> Iterator[None]:
    """Run fp32 matmuls without TF32 (restoring the caller's setting), so results keep fp32 accuracy."""
    matmul = torch.backends.cuda.matmul
    if not matmul.allow_tf32:
        yield
        return
    matmul.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32 = True


def launch_decompress(
    packed: torch.Tensor,
    norms: torch.Tensor,
    centroids: torch.Tensor,
    bits: int,
    hadamard_signs: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Launch a decompress kernel into a preallocated contiguous ``out [..., D]`` (no validation).

    ``hadamard_signs`` given: inverse Hadamard rotation fused (``tq_decompress_hadamard``); None: rotated
    space (``tq_dequantize_rotated``).
    """
    head_dim = out.shape[-1]
    packed = aligned_rows(packed, 4 if bits == 4 else 2 if bits == 2 else 1)
    layout = collapse_rows(packed.shape[:-1], packed.stride()[:-1], norms.stride())
    if layout is None:
        packed, norms = packed.contiguous(), norms.contiguous()
        layout = collapse_rows(packed.shape[:-1], packed.stride()[:-1], norms.stride())
    assert layout is not None
    sizes, (sp, sn) = layout
    rows = out.numel() // head_dim
    device = packed.device
    groups = -(-rows // (THREADS // LANES[head_dim]))
    grid = min(groups, sm_count(device_index(device)) * _WAVES)
    kernel_kind = "decompress_hadamard" if hadamard_signs is not None else "dequantize_rotated"
    kernel = loader.get_kernel(CUDA_SOURCE, kernel_name(kernel_kind, head_dim, bits, out.dtype), device)
    args = [
        packed, np.int64(sp[0]), np.int64(sp[1]), np.int64(sp[2]),
        norms, np.int64(sn[0]), np.int64(sn[1]), np.int64(sn[2]),
        *fast_divider(sizes[1]), *fast_divider(sizes[2]), rows, centroids.contiguous(),
    ]
    if hadamard_signs is not None:
        args.append(hadamard_signs.contiguous())
    args.append(out)
    loader.launch(kernel, (grid,), (THREADS,), args, device)
