"""Reference TurboQuant compression: norm, rotation, bucketize, pack; ``compress_into`` writes the codes into rows of
a store."""

from __future__ import annotations

import torch
from torch import Tensor

from ..packing import pack_indices
from ..store_rows import check_start_value, check_store_rows


def compress(
    x: Tensor, rotation: Tensor, boundaries: Tensor, bits: int, centroids: Tensor | None = None,
    norm_correction: bool = False, hadamard_signs: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Compress head vectors.

    Parameters
    ----------
    x : shape [..., D], fp16/bf16/fp32
    rotation : shape [D, D] fp32, rows rotate as ``x @ rotation.T``
    boundaries : shape [2^bits - 1] fp32, sorted
    centroids : shape [2^bits] fp32; needed only for ``norm_correction``
    norm_correction : store ``||x|| / ||centroids[idx]||`` so the reconstruction keeps the exact norm
    hadamard_signs : shape [D] fp32, given when ``rotation`` is ``H diag(s) / sqrt(D)``; kernels may then use a
        fast Walsh-Hadamard transform. The reference always uses the dense matrix.

    Returns
    -------
    packed : uint8 [..., ceil(D*bits/8)]; norms : fp32 [...]
    """
    xf = x.float()
    norms = torch.linalg.vector_norm(xf, dim=-1)
    unit = xf / norms.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    rotated = unit @ rotation.T
    indices = torch.bucketize(rotated, boundaries, right=True)
    if norm_correction:
        if centroids is None:
            raise ValueError("`centroids` are required when `norm_correction` is True")
        recon_norm = torch.linalg.vector_norm(centroids[indices], dim=-1)
        norms = norms / recon_norm.clamp_min(torch.finfo(torch.float32).tiny)
    return pack_indices(indices, bits), norms


def compress_into(
    x: Tensor, rotation: Tensor, boundaries: Tensor, bits: int, packed: Tensor, norms: Tensor, start: Tensor,
    centroids: Tensor | None = None, norm_correction: bool = False, hadamard_signs: Tensor | None = None,
) -> None:
    """Compress ``x`` (as :func:`compress`) into rows ``start .. start + n`` of a store, in place.

    Parameters
    ----------
    x : shape [..., n, D]
    packed : uint8 shape [..., N, ceil(D*bits/8)], N >= n; norms : fp32 shape [..., N]. Either may be a strided
        view, e.g. codes and fp32 norm side by side in rows of one uint8 buffer (the rows are written through it).
    start : int64, one element, on the store's device: the first row. On the CPU a start outside [0, N - n]
        raises a ValueError; on a GPU its value is not read on the host (no synchronisation) and such a start
        writes nothing.
    rotation, boundaries, bits, centroids, norm_correction, hadamard_signs : as for :func:`compress`

    >>> compress_into(x, pi, boundaries, 4, store_packed, store_norms, torch.tensor(16))  # doctest: +SKIP
    """
    n = check_store_rows(x, packed, norms, start, bits)
    slots = packed.shape[-2]
    if start.device.type == "cpu":
        check_start_value(start, n, slots)
    codes, code_norms = compress(x, rotation, boundaries, bits, centroids, norm_correction, hadamard_signs)
    positions = start.reshape(()) + torch.arange(n, device=start.device)
    if start.device.type != "cpu":
        # Out of range: rewrite the rows at the clamped positions with what they hold (no bounds fault, no change).
        inside = (start.reshape(()) >= 0) & (start.reshape(()) <= slots - n)
        positions = positions.clamp(0, slots - 1)
        codes = torch.where(inside, codes, packed.index_select(-2, positions))
        code_norms = torch.where(inside, code_norms, norms.index_select(-1, positions))
    packed.index_copy_(packed.dim() - 2, positions, codes)
    norms.index_copy_(norms.dim() - 1, positions, code_norms)
